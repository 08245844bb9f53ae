"""Per-rank memory under data-parallel training: a profiled step as one rank of DDP or FSDP2
runs it, so that a budget is what each device holds.

The profile is of the unsharded step on one device. `per_rank` turns it into the step of one
rank: what the engine adds is written into the graph in the forms every solver already
prices, so the solvers, `simulate` and the floor need no other change:

* what lives through the step (sharded parameters, DDP's gradient buckets, optimizer state)
  is in ``param_bytes``;
* what the engine holds while a unit runs in forward (FSDP2's gathered parameters) is in
  `CostGraph.engine_bytes` (no schedule changes it and no replay allocates it: in backward the
  parameters are gathered already);
* what it does in backward (FSDP2's gathers and prefetch, the unsharded gradients' reduce-
  scatter into sharded ones; DDP's copy into its buckets) is in ``bwd_steps``' events, which
  no schedule changes either.

The engines' memory was measured on torch 2.13 (gloo, CPU; docs/distributed.md). DDP: the
reducer keeps one flat bucket per dtype of the trainable parameters' bytes from construction
on; with ``gradient_as_bucket_view=False`` (the default) each gradient also lives as
``param.grad``, with ``True`` the one backward computed is freed once copied into its bucket
(at the end of the backward step that made it). FSDP2: see `_fsdp2`.

Parameters come from the model (`distributed.param_groups`), by unit and root (``""``): FSDP2
shards dim 0 into ``ceil(rows / world)`` rows per rank, padded."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .ir.graph import CostGraph
from .ir.graph_json import check_references
from .ir.replays import unit_calls

__all__ = ["DDP", "FSDP2", "OPTIMIZER_STATES", "Param", "ParallelError", "parse_parallel",
           "per_rank"]


class ParallelError(ValueError):
    """A parallel configuration that is malformed, or that the profiled step cannot be
    planned for (the message names the value and the way out)."""


@dataclass(frozen=True)
class Param:
    """One parameter: ``rows`` (its dim 0; 1 for a scalar), the elements of one row, bytes per
    element, and whether it gets a gradient."""

    rows: int
    row_numel: int
    itemsize: int
    trainable: bool = True

    @property
    def bytes(self) -> int:
        return self.rows * self.row_numel * self.itemsize

    def shard_bytes(self, world: int) -> int:
        """Bytes of one rank's padded shard (FSDP2: dim 0 chunked, every chunk padded to the
        first one's size)."""
        return math.ceil(self.rows / world) * self.row_numel * self.itemsize


#: optimizers whose state ``optimizer=`` counts, per trainable parameter: tensors like it, and
#: bytes of scalars (Adam's ``step``, float32)
OPTIMIZER_STATES = {"adamw": (2, 4), "adam": (2, 4), "sgd-momentum": (1, 0), "sgd": (0, 0)}


def _check_optimizer(cls: str, optimizer: str | None) -> None:
    if optimizer is not None and optimizer not in OPTIMIZER_STATES:
        raise ParallelError(f"{cls}(optimizer={optimizer!r}): name one of "
                            f"{', '.join(OPTIMIZER_STATES)}, or None to leave optimizer state "
                            "out of the budget")


def _optimizer_bytes(optimizer: str | None, groups: Mapping[str, Sequence[Param]],
                     size: Callable[[Param], int]) -> int:
    if not optimizer:
        return 0
    like, scalar = OPTIMIZER_STATES[optimizer]
    train = [p for ps in groups.values() for p in ps if p.trainable]
    return sum(like * size(p) + scalar for p in train)


@dataclass(frozen=True)
class DDP:
    """``DistributedDataParallel(plan.module, gradient_as_bucket_view=...)``; the world size
    does not change a rank's memory. ``optimizer``: count that optimizer's state (``"adamw"``:
    two tensors like each trainable parameter, as ``torch.optim.AdamW`` keeps) as held
    through the step, so that the budget can be the device's memory; None leaves it out."""

    gradient_as_bucket_view: bool = False
    optimizer: str | None = None

    def __post_init__(self) -> None:
        _check_optimizer("DDP", self.optimizer)

    def describe(self) -> str:
        opt = f", {self.optimizer} state" if self.optimizer else ""
        return f"DDP (gradient_as_bucket_view={self.gradient_as_bucket_view}{opt})"


@dataclass(frozen=True)
class FSDP2:
    """``fully_shard`` on each unit of the plan's module, then on the root, over ``world``
    ranks (one shard group), with PyTorch's defaults: units reshard after forward, the root
    does not, backward prefetches one unit, no mixed-precision policy (parameters gathered in
    their own dtype). ``backend``: ``"gloo"`` counts the scratch buffers gloo's CPU
    collectives allocate (an all-gather's output-size buffer, a reduce-scatter's copy of its
    input); ``"nccl"`` allocates none through PyTorch. ``optimizer``: count that optimizer's
    state, sharded like the parameters (see `DDP`)."""

    world: int
    backend: str = "nccl"
    optimizer: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.world, bool) or not isinstance(self.world, int) or self.world < 1:
            raise ParallelError(f"FSDP2(world={self.world!r}): the world size is the number of "
                                "ranks sharing the parameters, an integer >= 1")
        if self.backend not in ("gloo", "nccl"):
            raise ParallelError(f"FSDP2(backend={self.backend!r}): 'nccl' (GPUs) or 'gloo' "
                                "(CPU)")
        _check_optimizer("FSDP2", self.optimizer)

    def describe(self) -> str:
        opt = f", {self.optimizer} state" if self.optimizer else ""
        return f"FSDP2 over {self.world} ranks ({self.backend}{opt})"


Parallel = DDP | FSDP2


def parse_parallel(spec: Any, world: int | None = None, backend: str = "nccl"
                   ) -> Parallel | None:
    """A parallel configuration from what users write: None; a `DDP` or `FSDP2`; ``"ddp"``;
    ``"fsdp2"`` (over ``world`` ranks: the initialised process group's size) or
    ``"fsdp2:8"``, over ``backend``; ``+adamw`` (any of `OPTIMIZER_STATES`) counts that
    optimizer's state: ``"fsdp2:8+adamw"``."""
    if spec is None or isinstance(spec, (DDP, FSDP2)):
        return spec
    if isinstance(spec, str):
        text, _, opt = spec.strip().lower().partition("+")
        kind, _, n = text.partition(":")
        if kind == "ddp" and not n:
            return DDP(optimizer=opt or None)
        if kind == "fsdp2":
            if n and (not n.isdigit() or int(n) < 1):
                raise ParallelError(f"parallel={spec!r}: the world size after 'fsdp2:' must "
                                    "be an integer >= 1, e.g. 'fsdp2:8'")
            if not n and world is None:
                raise ParallelError(f"parallel={spec!r} needs the world size: write "
                                    "'fsdp2:8', pass FSDP2(world=8), or initialise "
                                    "torch.distributed first")
            return FSDP2(int(n) if n else world, backend, optimizer=opt or None)
    raise ParallelError(f"parallel={spec!r} is not understood: pass 'ddp', 'fsdp2', "
                        "'fsdp2:<world>' (each with '+adamw' to count its state), "
                        "scheduler.parallel.DDP(...) or FSDP2(world=...)")


def per_rank(graph: CostGraph, parallel: Parallel,
             groups: Mapping[str, Sequence[Param]]) -> CostGraph:
    """``graph`` (the unsharded step on one device) as one rank of ``parallel`` runs it.

    ``groups``: the parameters of each unit (by path) and of the root (``""``), see the module
    docstring. The graph's units are FSDP2's: each is sharded on its own, the rest with the
    root. Raises `ParallelError` where the step's gradients cannot be told apart by unit."""
    if isinstance(parallel, DDP):
        return _ddp(graph, parallel, groups)
    return _fsdp2(graph, parallel, groups)


def _persistent_grads(graph: CostGraph) -> dict[int, tuple[int, int]]:
    """The gradients alive when backward ends (of parameters, or of inputs): id -> (the step
    that allocated it, bytes)."""
    live: dict[int, tuple[int, int]] = {}
    for i, step in enumerate(graph.bwd_steps):
        for kind, gid, b in step.events:
            if kind == "a":
                live[gid] = (i, b)
            else:
                live.pop(gid, None)
    return live


def _ddp(graph: CostGraph, cfg: DDP, groups: Mapping[str, Sequence[Param]]) -> CostGraph:
    buckets = sum(p.bytes for ps in groups.values() for p in ps if p.trainable)
    state = _optimizer_bytes(cfg.optimizer, groups, lambda p: p.bytes)
    steps = list(graph.bwd_steps)
    if cfg.gradient_as_bucket_view:
        for gid, (i, _) in _persistent_grads(graph).items():
            steps[i] = dataclasses.replace(steps[i], events=(*steps[i].events, ("f", gid, 0)))
    return _stamped(dataclasses.replace(graph, param_bytes=graph.param_bytes + buckets + state,
                                        bwd_steps=steps), cfg)


def _stamped(graph: CostGraph, cfg: Parallel) -> CostGraph:
    out = dataclasses.replace(graph, measured_peak_bytes=0,
                              meta={**graph.meta, "parallel": cfg.describe()})
    check_references(out, {n.name: i for i, n in enumerate(out.nodes)})
    return out


@dataclass(frozen=True)
class _Group:
    """What FSDP2 moves for one ``fully_shard`` module (bytes, on one rank)."""

    gathered: int  # the all-gather's output, and the unsharded parameters copied out of it
    sharded: int  # this rank's padded shards
    reduce_in: int  # the reduce-scatter's input: every trainable parameter's padded gradient
    reduce_out: int  # its output, which becomes the sharded gradients
    pads: tuple[int, ...]  # per trainable parameter whose rows the world does not divide
    last_grad: int  # the last trainable parameter's gradient (kept until the reduce returns)


def _group(params: Sequence[Param], world: int) -> _Group:
    train = [p for p in params if p.trainable]
    sharded = sum(p.shard_bytes(world) for p in params)
    reduce_out = sum(p.shard_bytes(world) for p in train)
    return _Group(gathered=world * sharded, sharded=sharded, reduce_in=world * reduce_out,
                  reduce_out=reduce_out,
                  pads=tuple(world * p.shard_bytes(world) for p in train if p.rows % world),
                  last_grad=train[-1].bytes if train else 0)


class _Events:
    """Synthetic engine events, with gradient ids of their own."""

    def __init__(self, first_id: int):
        self.next = first_id
        self.out: list[tuple[str, int, int]] = []
        self.empty: set[int] = set()  # ids of nothing (0 bytes): never written

    def alloc(self, b: int) -> int:
        gid, self.next = self.next, self.next + 1
        if b:
            self.out.append(("a", gid, b))
        else:
            self.empty.add(gid)
        return gid

    def free(self, gid: int) -> None:
        if gid not in self.empty:
            self.out.append(("f", gid, 0))

    def scratch(self, b: int) -> None:
        if b:
            self.free(self.alloc(b))

    def take(self) -> list[tuple[str, int, int]]:
        out, self.out = self.out, []
        return out


def _fsdp2(graph: CostGraph, cfg: FSDP2, groups: Mapping[str, Sequence[Param]]) -> CostGraph:
    """FSDP2's memory on one rank, in the order measured on torch 2.13 (docs/distributed.md
    has it in words): shards always; in forward the root's gathered parameters throughout, a
    unit's while it runs, and each gather's flat buffer until the next copy-out; in backward
    the prefetch of the unit before, and at a unit's end its reshard, then the reduce-scatter
    of its gradients (the previous one's input freed, its own kept until the next)."""
    world, gloo = cfg.world, cfg.backend == "gloo"
    calls = unit_calls(graph)
    paths = [p for p, _, _ in calls]
    if len(set(paths)) != len(paths) or set(paths) != set(groups) - {""}:
        raise ParallelError(
            f"FSDP2 per unit needs each unit called once in the step and its parameters: "
            f"units {sorted(set(paths))}, parameter groups {sorted(set(groups) - {''})}")
    g = {path: _group(ps, world) for path, ps in groups.items()}
    root = g[""]
    names = graph.compute_nodes
    unit_of = {names[i]: path for path, a, b in calls for i in range(a, b)}
    first = {names[a]: path for path, a, _ in calls}
    after = {names[b]: path for path, _, b in calls if b < len(names)}

    # forward: each node's engine bytes, held and spike (`CostGraph.engine_bytes`)
    engine: dict[str, tuple[int, int]] = {}
    level = top = 0

    def add(b: int) -> None:
        nonlocal level, top
        level += b
        top = max(top, level)

    deferred = 0  # the flat buffer of the last gather, kept until the next copy-out

    def gather(grp: _Group) -> None:
        nonlocal deferred
        add(grp.gathered)  # the flat output
        if gloo:
            add(grp.gathered)
            add(-grp.gathered)
        add(grp.gathered)  # the parameters copied out
        add(-deferred)
        deferred = grp.gathered

    for i, n in enumerate(graph.nodes):
        top = level
        if i == 0:
            gather(root)
        if n.name in after:
            add(-g[after[n.name]].gathered)  # the unit before resharded after its forward
        if n.name in first:
            gather(g[first[n.name]])
        engine[n.name] = (level, top - level)

    # backward: events appended to the steps (`CostGraph.bwd_steps`)
    steps = list(graph.bwd_steps)
    mine: dict[str, list[int]] = {p: [] for p in paths}
    for i, st in enumerate(steps):
        if st.node in unit_of:
            mine[unit_of[st.node]].append(i)
    grads = _persistent_grads(graph)
    unit_grads: dict[str, list[tuple[int, int]]] = {p: [] for p in (*paths, "")}
    for gid, (i, b) in grads.items():
        unit_grads[unit_of.get(steps[i].node, "")].append((gid, b))
    for path in paths:
        want = sum(p.bytes for p in groups[path] if p.trainable)
        got = sum(b for _, b in unit_grads[path])
        if got != want or not mine[path]:
            raise ParallelError(
                f"unit {path!r}: the profiled backward leaves {got} bytes of gradients in its "
                f"steps, its trainable parameters have {want}: FSDP2's memory cannot be "
                "placed (a parameter used outside its unit?); plan for one device, or name "
                "other units (units=...)")
    ev = _Events(1 + max((gid for st in steps for _, gid, _ in st.events), default=0))
    held: dict[str, int] = {}  # module -> its unsharded parameters' id
    prefetched: dict[str, int] = {}  # module -> its pending flat buffer's id
    pending_reduce: list[int] = []

    def all_gather(path: str) -> int:
        flat = ev.alloc(g[path].gathered)
        if gloo:
            ev.scratch(g[path].gathered)
            ev.scratch(g[path].gathered)
        return flat

    def unshard(path: str) -> None:
        flat = prefetched.pop(path, None)
        if flat is None:
            flat = all_gather(path)
        held[path] = ev.alloc(g[path].gathered)
        ev.free(flat)

    def post_backward(path: str) -> None:
        grp = g[path]
        ev.free(held.pop(path))
        for rid in pending_reduce:
            ev.free(rid)
        pending_reduce[:] = [ev.alloc(grp.reduce_in)]
        pads = [ev.alloc(b) for b in grp.pads]
        for pid in pads:
            ev.free(pid)
        ours = sorted(unit_grads[path], key=lambda t: t[1] != grp.last_grad)
        for gid, _ in ours[1:]:
            ev.free(gid)
        ev.alloc(grp.reduce_out)
        if gloo:  # (a copy of the input, then the average's scalars)
            ev.scratch(grp.reduce_in)
            scalars = [ev.alloc(8), ev.alloc(4)]
            for sid in scalars:
                ev.free(sid)
        if ours:
            ev.free(ours[0][0])

    def append(i: int, events: list[tuple[str, int, int]], *, front: bool = False) -> None:
        old = steps[i].events
        steps[i] = dataclasses.replace(steps[i], events=(
            (*events, *old) if front else (*old, *events)))

    held[""] = ev.alloc(root.gathered)  # (forward's last node dropped the engine's bytes)
    if paths:
        prefetched[paths[-1]] = all_gather(paths[-1])
    append(0, ev.take(), front=True)
    for k in range(len(paths) - 1, -1, -1):
        path = paths[k]
        unshard(path)
        if k:
            prefetched[paths[k - 1]] = all_gather(paths[k - 1])
        append(mine[path][0] - 1, ev.take())
        post_backward(path)
        append(mine[path][-1], ev.take())
    post_backward("")
    for rid in pending_reduce:
        ev.free(rid)
    append(len(steps) - 1, ev.take())
    sharded = sum(grp.sharded for grp in g.values())
    sharded += _optimizer_bytes(cfg.optimizer, groups, lambda p: p.shard_bytes(world))
    return _stamped(dataclasses.replace(
        graph, param_bytes=sharded, engine_bytes=engine, bwd_steps=steps,
        grad_bytes=sum(grp.reduce_out for grp in g.values())), cfg)
