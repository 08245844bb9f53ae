"""``brute``: every schedule of a small space, simulated; the reference the exact solvers are
checked against.

**Space.** Region boundaries are any subset of ``points`` (positions over
``graph.compute_nodes``; they must include 0 and n), each region ``keep`` or ``recompute`` (no
save sets). Two adjacent keep regions behave exactly like one keep region, so only the merged
form is enumerated: with m interior points and both policies that is F(2m+3) schedules (F the
Fibonacci numbers), e.g. 4181 for m = 8, 75025 for m = 11.

**Answer.** The least simulated recompute time among schedules whose simulated peak fits the
budget (ties: the first in enumeration order: fewer regions first, then boundaries and
policies in lexicographic order, ``policies`` order within a region), proven optimal over
that space (less the recompute regions the rewriter would refuse, `ir.replays`, which are
not enumerated) (`certify` calls it OPTIMAL when the full-space bound reaches it).
When nothing fits: INFEASIBLE with ``min_feasible_bytes``, the least peak over the space.

The simulated (peak, recompute time) of every schedule in a space is cached beside the graph
(`base.graph_cache`), so asking again with another budget costs a scan, not a simulation.
"""

from __future__ import annotations

import time
from itertools import combinations, product
from math import comb
from typing import Callable, Iterator, Sequence

from ..cost.simulate import simulate
from ..ir.graph import CostGraph
from ..ir.replays import recompute_limits
from ..ir.schedule import KEEP, RECOMPUTE, Region, Schedule
from .base import INFEASIBLE, OPTIMAL, SolveResult, finish, graph_cache, register

__all__ = ["brute_force", "count_schedules", "schedules", "MAX_NODES"]

#: the registered ``brute`` solver enumerates every position up to this many compute nodes
MAX_NODES = 12

Span = tuple[int, int, str]


def _check_points(graph: CostGraph, points: Sequence[int]) -> list[int]:
    n = len(graph.compute_nodes)
    pts = sorted(set(int(p) for p in points))
    if not pts or pts[0] != 0 or pts[-1] != n:
        raise ValueError(f"points must include 0 and n = {n} (the number of compute nodes), "
                         f"got {list(points)}")
    if any(p < 0 or p > n for p in pts):
        raise ValueError(f"points must lie in [0, {n}], got {list(points)}")
    return pts


def _check_policies(policies: Sequence[str]) -> tuple[str, ...]:
    pol = tuple(dict.fromkeys(policies))
    if not pol or any(p not in (KEEP, RECOMPUTE) for p in pol):
        raise ValueError(f"policies must be a non-empty subset of ({KEEP!r}, {RECOMPUTE!r}), "
                         f"got {tuple(policies)}")
    return pol


def _policy_sequences(k: int, policies: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    """Policy sequences of length k with no two adjacent keeps, in product order."""
    for seq in product(policies, repeat=k):
        if not any(a == KEEP and b == KEEP for a, b in zip(seq, seq[1:])):
            yield seq


def _n_sequences(k: int, policies: tuple[str, ...]) -> int:
    """How many `_policy_sequences` of length k there are."""
    has_keep = KEEP in policies
    others = len(policies) - has_keep
    end_keep, end_other = int(has_keep), others  # sequences of length 1
    for _ in range(k - 1):
        end_keep, end_other = end_other * has_keep, (end_keep + end_other) * others
    return end_keep + end_other


SaveOptions = Callable[[CostGraph, int, int], Sequence[frozenset]]


def count_schedules(graph: CostGraph, points: Sequence[int],
                    policies: Sequence[str] = (KEEP, RECOMPUTE),
                    save_options: SaveOptions | None = None) -> int:
    """How many schedules `schedules` enumerates for these points, policies and save sets
    (without save sets: at most that many, counting those the rewriter would refuse)."""
    pts = _check_points(graph, points)
    pol = _check_policies(policies)
    m = len(pts) - 2
    if m < 0:  # no compute nodes
        return 0
    if save_options is not None:
        return sum(1 for _ in schedules(graph, pts, pol, save_options))
    return sum(comb(m, k - 1) * _n_sequences(k, pol) for k in range(1, m + 2))


def schedules(graph: CostGraph, points: Sequence[int],
              policies: Sequence[str] = (KEEP, RECOMPUTE),
              save_options: SaveOptions | None = None) -> Iterator[list[tuple]]:
    """Every schedule of the space as ``(start, stop, policy)`` spans, in enumeration order
    (see the module docstring); with ``save_options(graph, start, stop)``, each recompute
    region takes each of the save sets it offers, as ``(start, stop, policy, save)``."""
    pts = _check_points(graph, points)
    pol = _check_policies(policies)
    limits = recompute_limits(graph)
    inner, n = pts[1:-1], pts[-1]
    if n == 0:
        return
    for k in range(len(inner) + 1):
        for cuts in combinations(inner, k):
            bounds = (0, *cuts, n)
            spans = list(zip(bounds, bounds[1:]))
            for seq in _policy_sequences(k + 1, pol):
                plain = [(a, b, p) for (a, b), p in zip(spans, seq)]
                if not all(p == KEEP or b <= limits[a] for a, b, p in plain):
                    continue  # the rewriter would refuse it (`ir.replays`)
                if save_options is None:
                    yield plain
                    continue
                choices = [save_options(graph, a, b) if p == RECOMPUTE else [frozenset()]
                           for a, b, p in plain]
                for saves in product(*choices):
                    yield [(a, b, p, sv) for (a, b, p), sv in zip(plain, saves)]


def _space(graph: CostGraph, points: list[int], policies: tuple[str, ...],
           max_schedules: int, save_options: SaveOptions | None = None
           ) -> list[tuple[int, float]]:
    """(peak bytes, recompute seconds) of every schedule, in enumeration order; cached."""
    cache = graph_cache(graph, "brute spaces")
    key = (tuple(points), policies, save_options)
    if key not in cache:
        count = count_schedules(graph, points, policies, save_options)
        if count > max_schedules:
            raise ValueError(
                f"brute force over {len(points)} points ({len(points) - 2} interior) and "
                f"policies {policies} would simulate {count} schedules, more than "
                f"max_schedules={max_schedules}; give fewer points or raise max_schedules")
        names = graph.compute_nodes
        out = []
        for spans in schedules(graph, points, policies, save_options):
            # built directly (no fingerprint: hashing the graph would cost more than
            # simulating it); `simulate` still validates the coverage
            regions = [Region(sp[2], tuple(names[sp[0]:sp[1]]),
                              frozenset(sp[3]) if len(sp) > 3 else frozenset())
                       for sp in spans]
            est = simulate(graph, Schedule(regions))
            out.append((est.peak_bytes, est.recompute_s))
        cache[key] = out
    return cache[key]


def brute_force(graph: CostGraph, budget_bytes: int, *, points: list[int],
                policies: Sequence[str] = (KEEP, RECOMPUTE),
                save_options: SaveOptions | None = None,
                max_schedules: int = 200_000, full_space: bool = False) -> SolveResult:
    """The least-recompute schedule under ``budget_bytes`` among all schedules with region
    boundaries at a subset of ``points`` (including 0 and ``len(graph.compute_nodes)``) and a
    policy from ``policies`` per region (and, with ``save_options``, each save set it offers a
    recompute region), by simulating each one.

    Returns the optimum over that space (``space_optimal``; OPTIMAL once `certify` finds the
    full-space bound reaches it, or at once with ``full_space=True``, which the caller passes
    when the points are every position and ``save_options`` offers every save set) or
    INFEASIBLE with ``min_feasible_bytes`` the least peak over the space.

    Raises:
        ValueError: points or policies are malformed, or the space holds more than
            ``max_schedules`` schedules (the message names the count).
    """
    started = time.perf_counter()
    pts = _check_points(graph, points)
    pol = _check_policies(policies)
    space = _space(graph, pts, pol, max_schedules, save_options)
    best = None
    for i, (peak, t) in enumerate(space):
        if peak <= budget_bytes and (best is None or t < space[best][1]):
            best = i
    if best is None:
        return finish(graph, budget_bytes, None, solver="brute", started=started,
                      status=INFEASIBLE,
                      min_feasible_bytes=min((p for p, _ in space), default=None))
    spans = next(s for i, s in enumerate(schedules(graph, pts, pol, save_options)) if i == best)
    schedule = Schedule.from_regions(
        graph, spans, meta={"space": f"brute force: boundaries at a subset of {pts}, "
                                     f"policies {list(pol)}"})
    return finish(graph, budget_bytes, schedule, solver="brute", started=started,
                  status=OPTIMAL, lower_bound_s=space[best][1], full_space=full_space)


@register("brute")
def brute(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
          ) -> SolveResult:
    """`brute_force` over every position (any region boundaries), keep or recompute, for
    graphs of at most `MAX_NODES` compute nodes. ``time_limit_s`` is ignored."""
    n = len(graph.compute_nodes)
    if n > MAX_NODES:
        raise ValueError(
            f"the brute solver enumerates every schedule and takes graphs of at most "
            f"{MAX_NODES} compute nodes; {graph.name!r} has {n}. Use 'dp', 'cpsat' or 'auto', "
            f"or call scheduler.solvers.brute.brute_force with fewer points")
    return brute_force(graph, budget_bytes, points=list(range(n + 1)))
