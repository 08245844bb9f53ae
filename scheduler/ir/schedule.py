"""`Schedule`: which parts of forward are replayed in backward, as plain data.

A schedule cuts a graph's compute nodes (`CostGraph.compute_nodes`, in execution order) into
contiguous regions. A ``keep`` region runs as usual. A ``recompute`` region runs under
non-reentrant `torch.utils.checkpoint.checkpoint`: forward keeps only its inputs and the
outputs of the nodes in its ``save`` set (a selective-checkpoint MUST_SAVE policy), and
backward replays the rest. Semantics are in DESIGN.md; costs are computed by `simulate`.

**Nested regions** (multi-level checkpointing): a ``recompute`` region may hold ``inner``
regions that cover its nodes exactly, in order, each ``keep`` or ``recompute`` and the latter
nesting further. It runs as nested non-reentrant checkpoints (PyTorch's NOTE [ Nestable
Checkpoint ]): forward keeps only the outer region's inputs; backward replays the outer region
when it first needs one of its tensors, and during that replay the inner ``keep`` regions keep
what they save while the inner ``recompute`` regions keep only their inputs and are replayed
again when backward reaches them. Build one from `Region` objects,
``Schedule([Region(RECOMPUTE, nodes, inner=(Region(KEEP, a), Region(RECOMPUTE, b))), ...],
fingerprint=graph.fingerprint)``, then ``validate(graph)``; `Schedule.depth` says how deep it
nests. Save sets are refused anywhere in a nested region (`ScheduleError`).

Schedules are torch-free and saved as versioned JSON carrying the fingerprint of the graph they
were made for, so that applying one to a different model is caught. A schedule without nesting
is written as version 1, exactly as before nesting existed; a nested one as version 2, whose
region objects may carry ``"inner": [region objects]``. Both versions are read.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..files import check_destination, write_atomic
from .checks import Checks, read_json
from .region import KEEP, RECOMPUTE, Region, ScheduleError, region_from_dict
from .replays import check

if TYPE_CHECKING:
    from .graph import CostGraph

#: (`KEEP`, `RECOMPUTE`, `Region` and `ScheduleError` are `region`'s: re-exported, the names a
#: schedule is written with)
__all__ = ["KEEP", "NESTED_VERSION", "RECOMPUTE", "SCHEMA", "VERSION", "Region", "Schedule",
           "ScheduleError"]

SCHEMA = "scheduler.schedule"
#: the version a schedule without nested regions is written as
VERSION = 1
#: the version a schedule with nested regions is written as (the newest this reads)
NESTED_VERSION = 2

_C = Checks(ScheduleError)
#: the fields of a schedule's JSON document (`Schedule.to_dict`)
_FIELDS = frozenset({"schema", "version", "fingerprint", "budget_bytes", "solver", "status",
                     "gap", "solve_s", "estimate", "meta", "regions"})


@dataclass
class Schedule:
    """Regions over a graph's compute nodes plus where the schedule came from.

    Build one with `Schedule.from_regions` (validated against the graph) or load one with
    `Schedule.load`; `validate(graph)` checks that it fits a graph.
    """

    regions: list[Region]
    fingerprint: str = ""
    budget_bytes: int | None = None
    solver: str = ""
    status: str = ""
    gap: float | None = None
    solve_s: float | None = None
    estimate: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    # -- constructors -----------------------------------------------------------------------
    @classmethod
    def from_regions(
        cls,
        graph: CostGraph,
        spans: Iterable[tuple[int, int, str] | tuple[int, int, str, Iterable[str]]],
        **info: Any,
    ) -> Schedule:
        """Regions from ``(start, stop, policy[, save])`` spans over ``graph.compute_nodes``
        (indices, ``stop`` exclusive). Validated against ``graph``."""
        names = graph.compute_nodes
        regions = []
        for span in spans:
            start, stop, policy, *rest = span
            save = frozenset(rest[0]) if rest else frozenset()
            regions.append(Region(policy, tuple(names[start:stop]), save))
        s = cls(regions, fingerprint=graph.fingerprint, **info)
        s.validate(graph)
        return s

    @classmethod
    def none(cls, graph: CostGraph, **info: Any) -> Schedule:
        """No checkpointing: one keep region over every compute node."""
        return cls.from_regions(graph, [(0, len(graph.compute_nodes), KEEP)],
                                **{"solver": "none", **info})

    @classmethod
    def from_cuts(cls, graph: CostGraph, cuts: Sequence[int], policies: Sequence[str],
                  saves: Sequence[Iterable[str]] | None = None, **info: Any) -> Schedule:
        """Regions between consecutive ``cuts`` (0 < c < n, increasing), one policy each."""
        n = len(graph.compute_nodes)
        bounds = [0, *cuts, n]
        if len(policies) != len(bounds) - 1:
            raise ScheduleError(f"{len(bounds) - 1} regions but {len(policies)} policies")
        saves = saves or [()] * len(policies)
        return cls.from_regions(
            graph, [(a, b, p, s) for a, b, p, s in zip(bounds, bounds[1:], policies, saves)],
            **info)

    # -- checks -----------------------------------------------------------------------------
    def validate(self, graph: CostGraph, *, rewritable: bool = False) -> None:
        """Raise `ScheduleError` unless the regions cover ``graph``'s compute nodes exactly once,
        in order, and the fingerprint (if set) is the graph's. With ``rewritable``, also
        unless the rewriter runs every recompute region: none replays a value written in
        place after forward read it (`ir.replays.check`; the simulator prices such regions
        too, since solvers measure costs with them, but no solver returns one)."""
        if self.fingerprint and self.fingerprint != graph.fingerprint:
            raise ScheduleError(
                f"schedule was made for a graph with fingerprint {self.fingerprint!r}, but this "
                f"model's graph has {graph.fingerprint!r}: the model's structure or input shapes "
                "differ; solve again for this model")
        expected = graph.compute_nodes
        if not self.regions or not all(isinstance(r, Region) for r in self.regions):
            raise ScheduleError("a schedule's regions must be a non-empty list of Region objects")
        got = [n for r in self.regions for n in r.nodes]
        if got != expected:
            _raise_coverage(expected, got)
        for r in self.regions:
            for name in sorted(r.save):
                if not graph.allocates(name):
                    raise ScheduleError(
                        f"save-set node {name!r} allocates no storage (a view, an alias or a "
                        "no-op): caching it would pin its base tensor and save no compute; "
                        "leave it out of the save set")
        if rewritable:
            check(graph, self)

    # -- queries ----------------------------------------------------------------------------
    def policy_of(self) -> dict[str, str]:
        return {n: r.policy for r in self.regions for n in r.nodes}

    @property
    def recompute_regions(self) -> list[Region]:
        """The top-level recompute regions (a nested one counts once, its inner ones not)."""
        return [r for r in self.regions if r.recompute]

    @property
    def depth(self) -> int:
        """How deep the regions nest: 1 for a flat schedule, 2 when some region holds inner
        regions that do not nest further, and so on."""
        return max((r.depth for r in self.regions), default=1)

    @property
    def nested(self) -> bool:
        """Whether some region holds inner regions (``depth > 1``)."""
        return self.depth > 1

    def describe(self) -> str:
        """One line per region, e.g. ``recompute  blocks.0.fc1 .. blocks.1.add  (12 nodes, save 2)``;
        inner regions indented under theirs."""
        def lines(regions: Sequence[Region], indent: str) -> Iterable[str]:
            for r in regions:
                extra = f", save {len(r.save)}" if r.save else ""
                yield (f"{indent}{r.policy:<9}  {r.nodes[0]} .. {r.nodes[-1]}  "
                       f"({len(r.nodes)} nodes{extra})")
                yield from lines(r.inner, indent + "  ")

        return "\n".join(lines(self.regions, ""))

    # -- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "version": NESTED_VERSION if self.nested else VERSION,
            "fingerprint": self.fingerprint,
            "budget_bytes": self.budget_bytes,
            "solver": self.solver,
            "status": self.status,
            "gap": self.gap,
            "solve_s": self.solve_s,
            "estimate": self.estimate,
            "meta": self.meta,
            "regions": [r.to_dict() for r in self.regions],
        }

    @classmethod
    def from_dict(cls, d: Any) -> Schedule:
        """The schedule in a parsed JSON document, every field checked: raises
        `ScheduleError` naming the first bad field."""
        if not isinstance(d, dict):
            raise ScheduleError(f"expected a JSON object, got {type(d).__name__}")
        if d.get("schema") != SCHEMA:
            raise ScheduleError(f"schema: expected {SCHEMA!r}, got {d.get('schema')!r}")
        v = d.get("version")
        if isinstance(v, int) and not isinstance(v, bool) and v > NESTED_VERSION:
            raise ScheduleError(
                f"version: the file has schedule version {v}, newer than the {NESTED_VERSION} "
                "this scheduler reads; upgrade scheduler (`pip install -U scheduler`)")
        if v not in (VERSION, NESTED_VERSION) or isinstance(v, bool):
            raise ScheduleError(
                f"version: this scheduler reads schedule version {VERSION} or "
                f"{NESTED_VERSION}, the file has {v!r}; solve again to write a current one")
        _C.fields("", d, _FIELDS)
        regions_raw = d.get("regions")
        if not isinstance(regions_raw, list) or not regions_raw:
            raise ScheduleError("regions: missing or empty")
        regions = [region_from_dict(f"regions[{i}]", r, nested=v == NESTED_VERSION)
                   for i, r in enumerate(regions_raw)]
        fp = d.get("fingerprint", "")
        if not isinstance(fp, str):
            raise ScheduleError(f"fingerprint: expected a string, got {fp!r:.40}")
        estimate = _C.type("estimate", d.get("estimate"), (dict, type(None)))
        for k, x in (estimate or {}).items():
            if k.endswith("_bytes"):
                _C.bytes(f"estimate.{k}", x)
            elif k != "timeline":
                _C.number(f"estimate.{k}", x)
        return cls(regions,
                   fingerprint=fp,
                   budget_bytes=_C.bytes("budget_bytes", d.get("budget_bytes"), optional=True,
                                         limit=2**63 - 1),
                   solver=_C.type("solver", d.get("solver", ""), str),
                   status=_C.type("status", d.get("status", ""), str),
                   gap=_C.number("gap", d.get("gap"), optional=True),
                   solve_s=_C.seconds("solve_s", d.get("solve_s"), optional=True),
                   estimate=estimate,
                   meta=_C.type("meta", d.get("meta", {}), dict))

    def save(self, path: str | Path) -> None:
        """Write the schedule as JSON, atomically (`files.write_atomic`); an existing file
        that is not JSON is not replaced (ValueError)."""
        write_atomic(check_destination(path, "json", what="the schedule file"),
                     json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        """Read a schedule written by `save`. Raises `ScheduleError` naming the file and the
        bad field (or why the file is not a schedule: a directory, binary, not JSON); warns
        (UserWarning) when the file records no graph fingerprint."""
        d = read_json(path, ScheduleError, "a schedule")
        try:
            s = cls.from_dict(d)
        except ScheduleError as e:
            raise ScheduleError(f"{path}: {e}") from e
        if not s.fingerprint:
            # hand-written schedules may leave it out, but then only node names are checked
            warnings.warn(
                f"{path}: no fingerprint: the schedule is checked against the model's node "
                "names only, so using it at another input shape (batch size, sequence length) "
                "goes unseen; solve again to record one", UserWarning, stacklevel=2)
        return s


def _raise_coverage(expected: list[str], got: list[str]) -> None:
    """Name the first node where ``got`` stops following ``expected``."""
    pos = {n: i for i, n in enumerate(expected)}
    seen: set[str] = set()
    for i, name in enumerate(got):
        if name not in pos:
            raise ScheduleError(f"region node {name!r} is not a compute node of the graph")
        if name in seen:
            raise ScheduleError(f"node {name!r} appears in more than one region")
        seen.add(name)
        if i >= len(expected) or expected[i] != name:
            raise ScheduleError(
                f"regions skip node {expected[i]!r} or put {name!r} out of execution order "
                f"(position {i})")
    raise ScheduleError(f"regions stop early: node {expected[len(got)]!r} is not covered")
