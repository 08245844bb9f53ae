"""Local repair of a schedule whose simulated peak breaks the budget by a little.

`relax` rounds solutions of the full-space relaxation to schedules; the relaxation leaves out
transient replay peaks and, until a rounded schedule breaks them, most of its memory
constraints, so the cheapest rounded schedules often go over the budget by a fraction of a
percent. Solving the relaxation again with what they broke takes CP-SAT as long as the first
solve on large graphs; `repair` instead changes the schedule a step at a time, by the
simulator:

* drop a node from a save set (it replays instead of being cached until the replay);
* grow a recompute region by the keep node just before or just after it.

Each step takes, among the changes that lower the peak, one that fits if any does (the one
with the least recompute time), else the one with the least recompute time added per byte
of peak removed. A step tries the changes no step had (those next to the last change), then
the `SolverConfig.repair_top` that did best in the steps before, so that a step costs tens of
simulations, not hundreds (the first tries `SolverConfig.repair_first` times as many, in the
order of a prior). It stops when the schedule fits, when no change lowers the peak, or at the
time limit.

A schedule over the budget by more than `SolverConfig.strip_over` (or one those steps do not
make fit) is over at many steps at once, where no single change lowers the peak: it is
repaired without its save sets (which replays what they cached, and frees it until then), and
then its save-set nodes go back in, the longest-running first, each that keeps it fitting and
lowers its recompute time. Nothing here is a bound: the schedule it returns is as good as its
simulated recompute time.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterator

from ..cost.simulate import Simulator
from ..cost.static import Static
from ..ir.graph import CostGraph
from ..ir.replays import recompute_limits
from ..ir.schedule import KEEP, RECOMPUTE, Region, Schedule
from .config import SolverConfig
from .deadline import clamp

__all__ = ["repair", "stripped"]

_Span = tuple[int, int, str, frozenset]  # (start, stop, policy, save set), node positions
_Key = tuple[str, str]  # a change: (kind, the node it names)


def repair(graph: CostGraph, schedule: Schedule, budget_bytes: int, time_limit_s: float, *,
           config: SolverConfig | None = None) -> Schedule | None:
    """A schedule near ``schedule`` whose simulated peak fits ``budget_bytes``, found within
    about ``time_limit_s`` (see the module docstring), or None. Flat schedules only."""
    if schedule.nested:
        raise ValueError(f"repair changes flat schedules; this one nests regions (depth "
                         f"{schedule.depth}): repair its flat form or solve again")
    config = config or SolverConfig()
    deadline = time.perf_counter() + clamp(time_limit_s)  # (within a solve's deadline)
    at = {x: i for i, x in enumerate(graph.compute_nodes)}
    spans: list[_Span] = [(at[r.nodes[0]], at[r.nodes[-1]] + 1, r.policy, frozenset(r.save))
                          for r in schedule.regions]
    peak, rec = _simulate(graph, spans)
    fixed = None
    if peak <= budget_bytes * (1 + config.strip_over):
        fixed = _steps(graph, spans, peak, rec, budget_bytes, deadline, config)
    if fixed is None and peak > budget_bytes and time.perf_counter() < deadline:
        fixed = _stripped(graph, spans, at, budget_bytes, deadline, config)
    if fixed is None:
        return None
    return Schedule.from_regions(graph, fixed[0], meta=dict(schedule.meta))


def stripped(schedule: Schedule) -> Schedule:
    """``schedule`` without save sets: each recompute region replays all of its nodes."""
    return replace(schedule, regions=[replace(r, save=frozenset()) for r in schedule.regions])


def _steps(graph: CostGraph, spans: list[_Span], peak: int, rec: float, budget_bytes: int,
           deadline: float, config: SolverConfig) -> tuple[list[_Span], float] | None:
    """The changes a step at a time (see the module docstring) from ``spans`` (simulated:
    ``peak`` bytes, ``rec`` seconds of recompute) until they fit: (spans, their recompute
    seconds), or None."""
    scores: dict[_Key, float] = {}  # the last score of each change tried (lower: better)
    seen: set[_Key] = set()  # the changes of the steps so far, tried or not
    # before any is tried: the time of the node a change replays per byte that node allocates
    # (what it may free)
    static = Static.of(graph)
    prior = {(kind, x): graph.node(x).time_s / (1 + sum(graph.storages[sid].bytes
                                                      for sid in static.allocs.get(x, ())))
             for x in graph.compute_nodes for kind in ("drop", "after", "before")}
    while peak > budget_bytes and time.perf_counter() < deadline:
        moves = dict(_moves(graph, spans))
        known = sorted((k for k in moves if k in scores), key=scores.__getitem__)
        fresh = sorted((k for k in moves if k not in seen), key=prior.__getitem__)
        top = config.repair_top
        tried = fresh[:config.repair_first * top] if not seen else fresh + known[:top]
        seen.update(moves)
        best: tuple[tuple[bool, float], list[_Span], int, float] | None = None
        for key in tried:
            if time.perf_counter() > deadline:
                break
            p, r = _simulate(graph, moves[key])
            if p >= peak:
                scores[key] = float("inf")
                continue
            score = (False, r) if p <= budget_bytes else (True, (r - rec) / (peak - p))
            scores[key] = score[1] if score[0] else -1.0
            if best is None or score < best[0]:
                best = (score, moves[key], p, r)
        if best is None:
            return None
        _, spans, peak, rec = best
    return (spans, rec) if peak <= budget_bytes else None


def _stripped(graph: CostGraph, spans: list[_Span], at: dict[str, int], budget_bytes: int,
              deadline: float, config: SolverConfig) -> tuple[list[_Span], float] | None:
    """``spans`` without save sets, repaired by `_steps`, and then their save-set nodes back
    in (``at``: node positions) where they keep it fitting and lower its recompute time (see
    the module docstring): (spans, their recompute seconds), or None."""
    bare = [(a, b, p, frozenset()) for a, b, p, _ in spans]
    got = _steps(graph, bare, *_simulate(graph, bare), budget_bytes, deadline, config)
    if got is None:
        return None
    fixed, rec = got
    # (`_steps` only grows regions: a save-set node is still in a recompute region)
    region = {j: i for i, (a, b, _, _) in enumerate(fixed) for j in range(a, b)}
    for x in sorted((x for _, _, _, save in spans for x in save),
                    key=lambda x: -graph.node(x).time_s):
        if time.perf_counter() > deadline:
            break
        i = region[at[x]]
        a, b, policy, save = fixed[i]
        if policy != RECOMPUTE:
            continue
        trial = [*fixed[:i], (a, b, policy, save | {x}), *fixed[i + 1:]]
        p, r = _simulate(graph, trial)
        if p <= budget_bytes and r < rec:
            fixed, rec = trial, r
    return fixed, rec


def _moves(graph: CostGraph, spans: list[_Span]) -> Iterator[tuple[_Key, list[_Span]]]:
    names = graph.compute_nodes
    limits = recompute_limits(graph)  # (no move makes a region the rewriter would refuse)
    for i, (a, b, policy, save) in enumerate(spans):
        if policy != RECOMPUTE:
            continue
        for x in sorted(save):
            yield ("drop", x), [*spans[:i], (a, b, policy, save - {x}), *spans[i + 1:]]
        if i + 1 < len(spans) and spans[i + 1][2] == KEEP and b + 1 <= limits[a]:
            c, d = spans[i + 1][:2]
            yield ("after", names[c]), [*spans[:i], (a, b + 1, policy, save),
                                        *([(c + 1, d, KEEP, frozenset())] if c + 1 < d else []),
                                        *spans[i + 2:]]
        if i and spans[i - 1][2] == KEEP and b <= limits[a - 1]:
            c, d = spans[i - 1][:2]
            yield ("before", names[d - 1]), [*spans[:i - 1],
                                             *([(c, d - 1, KEEP, frozenset())] if c < d - 1
                                               else []),
                                             (a - 1, b, policy, save), *spans[i + 1:]]


def _simulate(graph: CostGraph, spans: list[_Span]) -> tuple[int, float]:
    """(peak bytes, recompute seconds) of the schedule ``spans`` make (adjacent recompute
    regions stay apart: each has its own checkpoint)."""
    names = graph.compute_nodes
    s = Schedule([Region(p, tuple(names[a:b]), save) for a, b, p, save in spans],
                 fingerprint=graph.fingerprint)
    est = Simulator(graph, s, timeline=False).run()
    return est.peak_bytes, est.recompute_s
