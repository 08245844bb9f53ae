"""`CostGraph`: the torch-free record of one profiled training step.

A `CostGraph` is what the solvers and the simulator see of a model. It imports no torch: it
can be loaded from JSON, generated synthetically and solved on a machine without PyTorch.

What it holds, keyed by node name and in forward execution order:

* ``nodes``: one `Node` per graph node that runs (FX ``call_module`` / ``call_function`` /
  ``call_method``), with its measured forward and backward times, the bytes of new storage its
  outputs allocate, and the tensors autograd saved for its backward (`Saved`).
* ``storages``: every storage allocated in forward (`Storage`): its bytes, the node that
  allocated it, whether it backs one of that node's outputs, the last forward node that reads it,
  and which nodes' backward saved it. This is what lets `simulate` decide when a storage is
  freed under any schedule.
* ``fwd_events``: the allocations and frees observed *inside* each node (op temporaries).
* ``bwd_steps``: the backward pass as it ran, a step per contiguous run of one node's
  backward functions, with the gradient storages allocated and freed. A schedule does not
  change the backward order or the gradients, so the simulator replays these as recorded.
* graph-level bytes (parameters, buffers, inputs) and the measured unscheduled peak and step time.
* what each recompute region costs beyond its nodes' replay: the checkpoint call and its
  saved-tensor hooks (``checkpoint_call_s``, ``checkpoint_saved_s``), measured on the device.
* ``written_reads``: values read by one node and written in place by a later one
  (`WrittenRead`), which decide where a recompute region may start (`ir.replays`).

All bytes are integers; all times are seconds (floats).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import networkx as nx

from ..files import check_destination, write_atomic
from .checks import read_json
from .graph_json import (
    CHECKPOINT_COSTS,
    SCHEMA,
    VERSION,
    check_references,
    graph_fields,
)
from .nodes import BwdStep, CostGraphError, Node, Saved, Storage, WrittenRead

__all__ = [
    "SCHEMA",
    "VERSION",
    "BwdStep",
    "CostGraph",
    "CostGraphError",
    "Node",
    "Saved",
    "Storage",
    "WrittenRead",
    "with_step_time",
]



@dataclass
class CostGraph:
    """A profiled training step, torch-free. See the module docstring."""

    name: str
    nodes: list[Node]
    storages: dict[int, Storage] = field(default_factory=dict)
    fwd_events: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    bwd_steps: list[BwdStep] = field(default_factory=list)
    param_bytes: int = 0
    buffer_bytes: int = 0
    input_bytes: int = 0
    grad_bytes: int = 0  # gradients of parameters (and inputs) alive after the step
    measured_peak_bytes: int = 0  # unscheduled step, measured by profile
    measured_step_s: float = 0.0  # unscheduled step, median wall time
    meta: dict[str, Any] = field(default_factory=dict)
    #: what a recompute region costs beyond replaying its nodes, measured by `profile` on the
    #: device: each `torch.utils.checkpoint` call (``checkpoint_call_s``), and each tensor its
    #: nodes save for backward (``checkpoint_saved_s``: the checkpoint's pack and unpack hooks
    #: and the replay's own pack). Zero in graphs recorded before it was measured.
    checkpoint_call_s: float = 0.0
    checkpoint_saved_s: float = 0.0
    #: values written in place after a node read them (`WrittenRead`): where the rewriter
    #: refuses a recompute region, so where no solver puts one (`ir.replays`). Empty in graphs
    #: recorded before it was (and in graphs of models without such writes).
    written_reads: tuple[WrittenRead, ...] = ()
    #: module paths of the plan's units (`scheduler.units`): submodules whose calls the plan
    #: takes over, the rest of the step being the model's own code. A recompute region lies
    #: within one call of one unit (`ir.replays`); nodes outside every unit are kept. Empty
    #: for a whole-graph plan (regions anywhere).
    units: tuple[str, ...] = ()
    #: what a parallel engine holds in forward beyond the storages (FSDP2's gathered
    #: parameters: `scheduler.parallel`), by node name: ``(held, spike)``, the bytes held while
    #: the node runs and the bytes held more, before its events only (a gather's transient
    #: buffers). No schedule changes them and no replay allocates them (in backward the
    #: engine's memory is in ``bwd_steps``' events). Empty for a step on one device.
    engine_bytes: dict[str, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._index = {n.name: i for i, n in enumerate(self.nodes)}
        if len(self._index) != len(self.nodes):
            seen: set[str] = set()
            dup = next(n.name for n in self.nodes if n.name in seen or seen.add(n.name))
            raise CostGraphError(f"nodes: duplicate node name {dup!r}")
        self._check()

    # -- structure ---------------------------------------------------------------------------
    def index(self, name: str) -> int:
        """Forward position of node ``name``."""
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"no node named {name!r} in graph {self.name!r}") from None

    def node(self, name: str) -> Node:
        return self.nodes[self.index(name)]

    @property
    def compute_nodes(self) -> list[str]:
        """The nodes a schedule assigns to regions: every model node (loss nodes excluded)."""
        return [n.name for n in self.nodes if not n.is_loss]

    @property
    def base_bytes(self) -> int:
        """Bytes alive throughout the step before anything runs: parameters, buffers, inputs."""
        return self.param_bytes + self.buffer_bytes + self.input_bytes

    def allocates(self, name: str) -> bool:
        """Whether node ``name`` allocated any storage in forward (views and no-ops do not);
        only such nodes can be in a save set."""
        return any(kind == "a" for kind, _ in self.fwd_events.get(name, ()))

    def replay_mark(self, name: str) -> int:
        """How many of node ``name``'s forward events a replay that stops at it runs: its
        recorded `Node.pack_mark`; for graphs without one, all of them if it saves a tensor it
        produced (packed after the op runs), else none (its saved inputs are packed first)."""
        node = self.node(name)
        if node.pack_mark is not None:
            return node.pack_mark
        if any(sv.source == name for sv in node.saved):
            return len(self.fwd_events.get(name, ()))
        return 0

    def saved_bytes(self) -> int:
        """Bytes of the unique storages autograd saves in the step (parameters included)."""
        seen: dict[Any, int] = {}
        for n in self.nodes:
            for s in n.saved:
                key = s.storage if s.storage is not None else s.source
                seen[key] = s.bytes
        return sum(seen.values())

    def to_networkx(self) -> nx.DiGraph:
        """The data-flow DAG: an edge u -> v when v reads u's value; node attributes are the
        `Node` fields."""
        g = nx.DiGraph()
        for n in self.nodes:
            g.add_node(n.name, **asdict(n))
        for n in self.nodes:
            for u in n.inputs:
                g.add_edge(u, n.name)
        return g

    @property
    def fingerprint(self) -> str:
        """A hash of the structure and shapes (names, ops, targets, edges, output shapes), not of
        measured times or bytes: it changes exactly when the model or its input shapes do.

        Cached while the node objects stay the same (they are frozen), since every schedule
        checks it: solvers build thousands."""
        cached = self.__dict__.get("_fingerprint")
        if cached is not None and len(cached[0]) == len(self.nodes) and all(
                a is b for a, b in zip(cached[0], self.nodes)):
            return cached[1]
        fp = structure_fingerprint(
            (n.name, n.op, n.target, n.inputs, n.shape, n.is_loss) for n in self.nodes)
        self.__dict__["_fingerprint"] = (tuple(self.nodes), fp)
        return fp

    def _check(self) -> None:
        names = self._index
        for k in CHECKPOINT_COSTS:
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and 0 <= v < float("inf")):
                raise CostGraphError(f"{k}: {v!r} is not a finite time >= 0 (seconds)")
        for n in self.nodes:
            for u in n.inputs:
                if u not in names:
                    raise CostGraphError(f"nodes[{n.name!r}].inputs: unknown node {u!r}")
                if names[u] >= names[n.name]:
                    raise CostGraphError(
                        f"nodes[{n.name!r}].inputs: {u!r} does not run before {n.name!r}; "
                        "nodes must be in execution order")
            for s in n.saved:
                if s.storage is not None and s.storage not in self.storages:
                    raise CostGraphError(
                        f"nodes[{n.name!r}].saved: unknown storage {s.storage}")
            if n.sac_s is not None and not n.sac_s >= 0:
                raise CostGraphError(f"nodes[{n.name!r}].sac_s: {n.sac_s!r} is negative")
            if n.flop_share is not None and not 0 <= n.flop_share <= 1:
                raise CostGraphError(
                    f"nodes[{n.name!r}].flop_share: {n.flop_share!r} is not in [0, 1]")
            if n.pack_mark is not None and not (
                    0 <= n.pack_mark <= len(self.fwd_events.get(n.name, ()))):
                raise CostGraphError(
                    f"nodes[{n.name!r}].pack_mark: {n.pack_mark} is not in [0, "
                    f"{len(self.fwd_events.get(n.name, ()))}] (its number of forward events)")
        for name, b in self.engine_bytes.items():
            if name not in names:
                raise CostGraphError(f"engine_bytes: unknown node {name!r}")
            if not (isinstance(b, tuple) and len(b) == 2
                    and all(isinstance(x, int) and x >= 0 for x in b)):
                raise CostGraphError(f"engine_bytes[{name!r}]: {b!r} is not (held, spike), "
                                     "two byte counts >= 0")
        for sid, st in self.storages.items():
            for attr in ("producer", "last_use"):
                if getattr(st, attr) not in names:
                    raise CostGraphError(
                        f"storages[{sid}].{attr}: unknown node {getattr(st, attr)!r}")
            for m in (*st.savers, *st.views):
                if m not in names:
                    raise CostGraphError(f"storages[{sid}]: unknown node {m!r}")
            if st.bytes < 0:
                raise CostGraphError(f"storages[{sid}].bytes: negative ({st.bytes})")
        for i, w in enumerate(self.written_reads):
            for attr in ("reader", "writer"):
                if getattr(w, attr) not in names:
                    raise CostGraphError(
                        f"written_reads[{i}].{attr}: unknown node {getattr(w, attr)!r}")
            if w.value not in names and not w.value.startswith("input:"):
                raise CostGraphError(f"written_reads[{i}].value: unknown node {w.value!r} "
                                     "(a node, or input:<name>)")
        for name in self.fwd_events:
            if name not in names:
                raise CostGraphError(f"fwd_events: unknown node {name!r}")
        for i, step in enumerate(self.bwd_steps):
            if step.node and step.node not in names:
                raise CostGraphError(f"bwd_steps[{i}].node: unknown node {step.node!r}")

    # -- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "version": VERSION,
            "name": self.name,
            "fingerprint": self.fingerprint,
            "param_bytes": self.param_bytes,
            "buffer_bytes": self.buffer_bytes,
            "input_bytes": self.input_bytes,
            "grad_bytes": self.grad_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "measured_step_s": self.measured_step_s,
            "checkpoint_call_s": self.checkpoint_call_s,
            "checkpoint_saved_s": self.checkpoint_saved_s,
            "meta": self.meta,
            "nodes": [
                {**asdict(n), "inputs": list(n.inputs),
                 "saved": [[s.source, s.storage, s.bytes] for s in n.saved]}
                for n in self.nodes
            ],
            "storages": [
                [s.id, s.bytes, s.producer, s.output, s.inner_free, s.last_use, list(s.savers),
                 list(s.views)]
                for s in self.storages.values()
            ],
            "fwd_events": {k: [list(e) for e in v] for k, v in self.fwd_events.items()},
            "bwd_steps": [[b.node, b.time_s, [list(e) for e in b.events]] for b in self.bwd_steps],
            # (only when there are any: graphs without them are written as before)
            **({"written_reads": [[w.reader, w.value, w.writer] for w in self.written_reads]}
               if self.written_reads else {}),
            **({"units": list(self.units)} if self.units else {}),
            **({"engine_bytes": {k: list(v) for k, v in self.engine_bytes.items()}}
               if self.engine_bytes else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostGraph:
        """The graph in a parsed JSON document, every field checked (`graph_json`): raises
        `CostGraphError` naming the first bad field."""
        kwargs, fingerprint = graph_fields(d)
        g = cls(**kwargs)
        check_references(g, g._index)
        if fingerprint is not None and fingerprint != g.fingerprint:
            raise CostGraphError(
                f"fingerprint: the file says {fingerprint!r} but its nodes hash to "
                f"{g.fingerprint!r}; the file was edited or corrupted")
        return g

    def save(self, path: str | Path) -> None:
        """Write the graph as JSON (schema `SCHEMA`, version `VERSION`), atomically
        (`files.write_atomic`); an existing file that is not JSON is not replaced (ValueError)."""
        write_atomic(check_destination(path, "json", what="the graph file"),
                     json.dumps(self.to_dict(), separators=(",", ":")))

    @classmethod
    def load(cls, path: str | Path) -> CostGraph:
        """Read a graph written by `save`. Raises `CostGraphError` naming the file and the bad
        field (or why the file is not a graph: a directory, binary, not JSON)."""
        d = read_json(path, CostGraphError, "a cost graph")
        try:
            return cls.from_dict(d)
        except CostGraphError as e:
            raise CostGraphError(f"{path}: {e}") from e

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CostGraph) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return (f"CostGraph({self.name!r}, {len(self.nodes)} nodes, "
                f"{len(self.storages)} storages, fingerprint={self.fingerprint})")


def structure_fingerprint(rows: Iterable[tuple[Any, ...]]) -> str:
    """Hash of ``(name, op, target, inputs, shape, is_loss)`` rows, one per node in order."""
    h = hashlib.sha256()
    for row in rows:
        h.update(repr(tuple(row)).encode())
    return h.hexdigest()[:16]


def with_step_time(graph: CostGraph, step_s: float) -> CostGraph:
    """``graph`` with its unscheduled step re-timed to ``step_s``: every forward and backward
    time scaled by the same factor (their proportions, which the solvers compare, kept)."""
    if not (step_s > 0) or not (graph.measured_step_s > 0):
        raise ValueError(f"step times must be positive, got {step_s!r} for a graph measured at "
                         f"{graph.measured_step_s!r}")
    f = step_s / graph.measured_step_s
    nodes = [replace(n, time_s=n.time_s * f, bwd_time_s=n.bwd_time_s * f,
                     sac_s=None if n.sac_s is None else n.sac_s * f) for n in graph.nodes]
    steps = [replace(b, time_s=b.time_s * f) for b in graph.bwd_steps]
    return replace(graph, nodes=nodes, bwd_steps=steps, measured_step_s=step_s,
                   checkpoint_call_s=graph.checkpoint_call_s * f,
                   checkpoint_saved_s=graph.checkpoint_saved_s * f)
