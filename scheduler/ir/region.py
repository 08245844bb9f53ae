"""`Region`: a contiguous run of compute nodes with one policy, the unit a `Schedule` is made
of, and its JSON object.

A ``keep`` region runs as usual; a ``recompute`` region runs under a checkpoint, keeping only
its inputs and the outputs of its ``save`` set, and may hold ``inner`` regions that cover its
nodes exactly, in order (nested checkpoints; see `schedule`). A region checks itself when it is
built, and `region_from_dict` checks every field of a region object read from a file; each
failure is a `ScheduleError` naming the region or the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from .checks import Checks

__all__ = ["KEEP", "RECOMPUTE", "Region", "ScheduleError", "region_from_dict"]

KEEP = "keep"
RECOMPUTE = "recompute"


class ScheduleError(ValueError):
    """A schedule is malformed or does not match the graph: the message names the node/field."""


_C = Checks(ScheduleError)


@dataclass(frozen=True)
class Region:
    """A contiguous run of compute nodes with one policy. ``save`` is only for ``recompute``;
    so is ``inner``: regions that cover ``nodes`` exactly, in order (see the module
    docstring)."""

    policy: str
    nodes: tuple[str, ...]
    save: frozenset[str] = frozenset()
    inner: tuple[Region, ...] = ()

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
        if not isinstance(self.inner, tuple):
            object.__setattr__(self, "inner", tuple(self.inner))
        if self.inner:
            if self.policy != RECOMPUTE:
                raise ScheduleError(
                    f"region starting at {self.nodes[0]!r} is {self.policy!r} but has inner "
                    "regions; only recompute regions nest")
            if not all(isinstance(r, Region) for r in self.inner):
                raise ScheduleError(
                    f"inner regions of the region starting at {self.nodes[0]!r} must be "
                    "Region objects")
            got = tuple(n for r in self.inner for n in r.nodes)
            if got != self.nodes:
                raise ScheduleError(
                    f"inner regions of the region {self.nodes[0]!r} .. {self.nodes[-1]!r} "
                    f"must cover its {len(self.nodes)} nodes exactly, in order; they cover "
                    f"{len(got)} ({_first_difference(self.nodes, got)})")
            if _any_save(self):
                raise ScheduleError(
                    f"region {self.nodes[0]!r} .. {self.nodes[-1]!r} nests regions and has a "
                    "save set in it: save sets (selective checkpointing) are not supported in "
                    "nested regions; drop the save sets there, or solve without nesting")

    @property
    def recompute(self) -> bool:
        return self.policy == RECOMPUTE

    @property
    def depth(self) -> int:
        """1 for a region without ``inner``, else 1 + the deepest inner region's depth."""
        return 1 + max((r.depth for r in self.inner), default=0)

    def to_dict(self) -> dict[str, Any]:
        """The region's JSON object (``inner`` only when it has inner regions)."""
        d = {"policy": self.policy, "nodes": list(self.nodes), "save": sorted(self.save)}
        return {**d, "inner": [r.to_dict() for r in self.inner]} if self.inner else d


def _names(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


#: how deep inner regions may nest in a file (deeper ones are not schedules anyone solved)
_MAX_FILE_DEPTH = 32


def region_from_dict(where: str, r: Any, *, nested: bool, depth: int = 1) -> Region:
    """The `Region` of one JSON region object at ``where`` (e.g. ``regions[3].inner[1]``),
    every field checked; ``inner`` only in a version-2 file."""
    known = {"policy", "nodes", "save", "inner"} if nested else {"policy", "nodes", "save"}
    if not isinstance(r, dict):
        raise ScheduleError(f"{where}: expected {{policy, nodes, save}}, got {r!r:.200}")
    _C.fields(where, r, known)
    policy = r.get("policy")
    if policy not in (KEEP, RECOMPUTE):
        raise ScheduleError(f"{where}.policy: expected {KEEP!r} or {RECOMPUTE!r}, got "
                            f"{policy!r:.40}")
    nodes = r.get("nodes")
    if not _names(nodes) or not nodes:
        raise ScheduleError(f"{where}.nodes: expected a non-empty list of node names, got "
                            f"{nodes!r:.200}")
    save = r.get("save", [])
    if not _names(save):
        raise ScheduleError(f"{where}.save: expected a list of node names, got {save!r:.200}")
    inner_raw = r.get("inner", [])
    if not isinstance(inner_raw, list):
        raise ScheduleError(f"{where}.inner: expected a list of region objects, got "
                            f"{inner_raw!r:.200}")
    if inner_raw and depth >= _MAX_FILE_DEPTH:
        raise ScheduleError(f"{where}.inner: regions nest more than {_MAX_FILE_DEPTH} deep")
    inner = tuple(region_from_dict(f"{where}.inner[{j}]", x, nested=nested, depth=depth + 1)
                  for j, x in enumerate(inner_raw))
    got = [n for x in inner for n in x.nodes]
    if inner and got != nodes:
        i = next((i for i, (a, b) in enumerate(zip(got, nodes)) if a != b),
                 min(len(got), len(nodes)))
        j = next((j for j, x in enumerate(accumulate(len(x.nodes) for x in inner)) if x > i),
                 len(inner) - 1)
        raise ScheduleError(
            f"{where}.inner[{j}].nodes: the inner regions must cover {where}.nodes exactly, in "
            f"order; at position {i} they have {got[i] if i < len(got) else None!r} and the "
            f"region {nodes[i] if i < len(nodes) else None!r}")
    try:
        return Region(policy, tuple(nodes), frozenset(save), inner)
    except ScheduleError as e:
        raise ScheduleError(f"{where}: {e}") from e


def _any_save(r: Region) -> bool:
    return bool(r.save) or any(_any_save(x) for x in r.inner)


def _first_difference(a: Sequence[str], b: Sequence[str]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    x, y = (v[i] if i < len(v) else None for v in (a, b))
    return f"at position {i} the region has {x!r} and the inner regions {y!r}"
