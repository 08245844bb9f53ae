"""`Schedule`: which parts of forward are replayed in backward, as plain data.

A schedule cuts a graph's compute nodes (`CostGraph.compute_nodes`, in execution order) into
contiguous regions. A ``keep`` region runs as usual. A ``recompute`` region runs under
non-reentrant `torch.utils.checkpoint.checkpoint`: forward keeps only its inputs and the
outputs of the nodes in its ``save`` set (a selective-checkpoint MUST_SAVE policy), and
backward replays the rest. Semantics are in DESIGN.md; costs are computed by `simulate`.

Schedules are torch-free and saved as versioned JSON carrying the fingerprint of the graph they
were made for, so that applying one to a different model is caught.
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

if TYPE_CHECKING:
    from .graph import CostGraph

__all__ = ["KEEP", "RECOMPUTE", "SCHEMA", "VERSION", "Region", "Schedule", "ScheduleError"]

SCHEMA = "scheduler.schedule"
VERSION = 1
KEEP = "keep"
RECOMPUTE = "recompute"


class ScheduleError(ValueError):
    """A schedule is malformed or does not match the graph: the message names the node/field."""


_C = Checks(ScheduleError)
#: the fields of a schedule's JSON document (`Schedule.to_dict`)
_FIELDS = frozenset({"schema", "version", "fingerprint", "budget_bytes", "solver", "status",
                     "gap", "solve_s", "estimate", "meta", "regions"})


@dataclass(frozen=True)
class Region:
    """A contiguous run of compute nodes with one policy. ``save`` is only for ``recompute``."""

    policy: str
    nodes: tuple[str, ...]
    save: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.policy not in (KEEP, RECOMPUTE):
            raise ScheduleError(
                f"region policy {self.policy!r} is not one of {KEEP!r}, {RECOMPUTE!r}")
        if not self.nodes:
            raise ScheduleError("a region must hold at least one node")
        if self.save and self.policy != RECOMPUTE:
            raise ScheduleError(
                f"region starting at {self.nodes[0]!r} is {self.policy!r} but has a save set; "
                "only recompute regions have one")
        stray = sorted(set(self.save) - set(self.nodes))
        if stray:
            raise ScheduleError(
                f"save-set node {stray[0]!r} is not in its region "
                f"({self.nodes[0]!r} .. {self.nodes[-1]!r})")

    @property
    def recompute(self) -> bool:
        return self.policy == RECOMPUTE


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
    def validate(self, graph: CostGraph) -> None:
        """Raise `ScheduleError` unless the regions cover ``graph``'s compute nodes exactly once,
        in order, and the fingerprint (if set) is the graph's."""
        if self.fingerprint and self.fingerprint != graph.fingerprint:
            raise ScheduleError(
                f"schedule was made for a graph with fingerprint {self.fingerprint!r}, but this "
                f"model's graph has {graph.fingerprint!r}: the model's structure or input shapes "
                "differ; solve again for this model")
        expected = graph.compute_nodes
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

    # -- queries ----------------------------------------------------------------------------
    def policy_of(self) -> dict[str, str]:
        return {n: r.policy for r in self.regions for n in r.nodes}

    @property
    def recompute_regions(self) -> list[Region]:
        return [r for r in self.regions if r.recompute]

    def describe(self) -> str:
        """One line per region, e.g. ``recompute  blocks.0.fc1 .. blocks.1.add  (12 nodes, save 2)``."""
        lines = []
        for r in self.regions:
            extra = f", save {len(r.save)}" if r.save else ""
            lines.append(f"{r.policy:<9}  {r.nodes[0]} .. {r.nodes[-1]}  "
                         f"({len(r.nodes)} nodes{extra})")
        return "\n".join(lines)

    # -- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "version": VERSION,
            "fingerprint": self.fingerprint,
            "budget_bytes": self.budget_bytes,
            "solver": self.solver,
            "status": self.status,
            "gap": self.gap,
            "solve_s": self.solve_s,
            "estimate": self.estimate,
            "meta": self.meta,
            "regions": [{"policy": r.policy, "nodes": list(r.nodes), "save": sorted(r.save)}
                        for r in self.regions],
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
        if isinstance(v, int) and not isinstance(v, bool) and v > VERSION:
            raise ScheduleError(
                f"version: the file has schedule version {v}, newer than the {VERSION} this "
                "scheduler reads; upgrade scheduler (`pip install -U scheduler`)")
        if v != VERSION or isinstance(v, bool):
            raise ScheduleError(
                f"version: this scheduler reads schedule version {VERSION}, the file has "
                f"{v!r}; solve again to write a current one")
        _C.fields("", d, _FIELDS)
        regions_raw = d.get("regions")
        if not isinstance(regions_raw, list) or not regions_raw:
            raise ScheduleError("regions: missing or empty")
        regions = []
        for i, r in enumerate(regions_raw):
            if not isinstance(r, dict) or not _names(r.get("nodes")) or not _names(
                    r.get("save", [])):
                raise ScheduleError(f"regions[{i}]: expected {{policy, nodes, save}} with "
                                    f"nodes and save lists of node names, got {r!r:.200}")
            _C.fields(f"regions[{i}]", r, {"policy", "nodes", "save"})
            regions.append(Region(r.get("policy"), tuple(r["nodes"]),
                                  frozenset(r.get("save", ()))))
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


def _names(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


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
