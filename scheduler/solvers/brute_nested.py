"""Brute force over nested schedules (`Region.inner`): every schedule of a small space,
simulated; the reference the nested dynamic program is checked against.

**Space** (`nested_schedules`), for sorted ``points`` over ``graph.compute_nodes`` that include
0 and n, and a ``depth`` >= 1:

* A *level* over ``[a, b)`` is a cut of it into contiguous regions at any subset of the points
  strictly inside ``(a, b)``, each region ``keep`` or ``recompute``, with no two adjacent keep
  regions (two adjacent keep regions behave as one; `brute` counts the same way).
* The schedule is a level over ``[0, n)``. Each of its recompute regions is either flat, or,
  when ``depth`` > 1 and at least one point lies strictly inside it, holds as ``inner`` a
  level over its own span that has at least two regions, each of whose recompute regions is
  chosen the same way with ``depth - 1``. (A region whose inner regions are one region over
  all its nodes is left out: it runs as that region does.)
* No save sets. ``depth=1`` is exactly `brute.schedules`' space without save sets.

Enumeration order: levels as `brute.schedules` orders them (fewer regions first, then
boundaries, then policies, ``keep`` before ``recompute``), and for each, its recompute
regions' choices in product order, flat first.

**Answers** (`NestedBrute`): among the schedules whose simulated peak fits the budget, the
least simulated recompute time (ties: the first in enumeration order); over all of them, the
least simulated peak (ties: the least recompute time, then the first).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import combinations, product

from ..cost.simulate import simulate
from ..ir.graph import CostGraph
from ..ir.replays import check
from ..ir.schedule import KEEP, RECOMPUTE, Region, Schedule, ScheduleError
from .base import INFEASIBLE, OPTIMAL, SolveResult, finish

__all__ = ["NestedBrute", "brute_force_nested", "count_nested", "nested_schedules"]


def _points(graph: CostGraph, points: Sequence[int]) -> list[int]:
    n = len(graph.compute_nodes)
    pts = sorted(set(int(p) for p in points))
    if not pts or pts[0] != 0 or pts[-1] != n or any(p < 0 or p > n for p in pts):
        raise ValueError(f"points must lie in [0, {n}] and include 0 and n = {n} (the number "
                         f"of compute nodes), got {list(points)}")
    return pts


def _levels(names: Sequence[str], pts: Sequence[int], a: int, b: int, depth: int,
            min_regions: int) -> Iterator[tuple[Region, ...]]:
    """Every level over ``[a, b)`` (module docstring) with at least ``min_regions`` regions."""
    inside = [p for p in pts if a < p < b]
    for k in range(max(min_regions - 1, 0), len(inside) + 1):
        for cuts in combinations(inside, k):
            bounds = (a, *cuts, b)
            spans = list(zip(bounds, bounds[1:]))
            for seq in product((KEEP, RECOMPUTE), repeat=len(spans)):
                if any(x == KEEP == y for x, y in zip(seq, seq[1:])):
                    continue
                choices = [_choices(names, pts, lo, hi, depth) if pol == RECOMPUTE
                           else [Region(KEEP, tuple(names[lo:hi]))]
                           for (lo, hi), pol in zip(spans, seq)]
                yield from product(*choices)


def _choices(names: Sequence[str], pts: Sequence[int], a: int, b: int, depth: int
             ) -> list[Region]:
    """A recompute region over ``[a, b)``: flat, then with each inner level (``depth`` > 1)."""
    nodes = tuple(names[a:b])
    out = [Region(RECOMPUTE, nodes)]
    if depth > 1:
        out += [Region(RECOMPUTE, nodes, inner=inner)
                for inner in _levels(names, pts, a, b, depth - 1, 2)]
    return out


def nested_schedules(graph: CostGraph, points: Sequence[int], depth: int
                     ) -> Iterator[Schedule]:
    """Every schedule of the space (module docstring), in enumeration order, unvalidated and
    without a fingerprint (`simulate` validates), less those with a recompute region the
    rewriter would refuse (`ir.replays`)."""
    if depth < 1:
        raise ValueError(f"depth must be at least 1 (flat schedules), got {depth!r}")
    pts = _points(graph, points)
    names = graph.compute_nodes
    if not names:
        return
    for regions in _levels(names, pts, 0, len(names), depth, 1):
        schedule = Schedule(list(regions))
        try:
            check(graph, schedule)
        except ScheduleError:
            continue  # the rewriter would refuse it (`ir.replays`)
        yield schedule


def count_nested(graph: CostGraph, points: Sequence[int], depth: int) -> int:
    """How many schedules `nested_schedules` enumerates."""
    return sum(1 for _ in nested_schedules(graph, points, depth))


@dataclass(frozen=True)
class NestedBrute:
    """What `brute_force_nested` found: ``result`` is the least-recompute schedule that fits
    (a `SolveResult`, INFEASIBLE when none does); ``least_peak`` the schedule of least
    simulated peak over the space and ``least_peak_bytes`` that peak; ``count`` how many
    schedules were simulated."""

    result: SolveResult
    least_peak: Schedule
    least_peak_bytes: int
    count: int


def brute_force_nested(graph: CostGraph, budget_bytes: int, *, points: Sequence[int],
                       depth: int = 2, max_schedules: int = 200_000) -> NestedBrute:
    """Simulate every nested schedule over ``points`` up to ``depth`` levels (module
    docstring) and return the least-recompute one within ``budget_bytes`` and the least-peak
    one. The result's status is OPTIMAL over this space (``space_optimal``), never over the
    full space: `certify` does not bound nested schedules.

    Raises:
        ValueError: malformed points or depth, or more than ``max_schedules`` schedules.
    """
    started = time.perf_counter()
    count = count_nested(graph, points, depth)
    if count > max_schedules:
        raise ValueError(f"nested brute force over points {list(points)} at depth {depth} "
                         f"would simulate {count} schedules, more than max_schedules="
                         f"{max_schedules}; give fewer points, a smaller depth, or raise "
                         f"max_schedules")
    best = least = None
    for s in nested_schedules(graph, points, depth):
        est = simulate(graph, s, timeline=False)
        key = (est.peak_bytes, est.recompute_s)
        if least is None or key < least[0]:
            least = (key, s)
        if est.peak_bytes <= budget_bytes and (best is None or est.recompute_s < best[0]):
            best = (est.recompute_s, s)
    assert least is not None, "a graph with compute nodes has at least one schedule"
    space = f"nested brute force: boundaries at subsets of {sorted(set(points))}, depth <= {depth}"
    if best is None:
        result = finish(graph, budget_bytes, None, solver="brute_nested", started=started,
                        status=INFEASIBLE, min_feasible_bytes=least[0][0])
    else:
        schedule = Schedule(best[1].regions, fingerprint=graph.fingerprint,
                            meta={"space": space})
        result = finish(graph, budget_bytes, schedule, solver="brute_nested",
                        started=started, status=OPTIMAL, lower_bound_s=best[0])
    top = Schedule(least[1].regions, fingerprint=graph.fingerprint, meta={"space": space})
    return NestedBrute(result, top, least[0][0], count)
