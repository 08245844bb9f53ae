"""``auto`` (the default): the exact methods, checked against every baseline.

It runs every baseline, then ``relax`` (schedules read off the full-space relaxation, with its
proven bound, for `SolverConfig.relax_share` of the time limit), and returns at once when that
is OPTIMAL (nothing in the full space does better). Otherwise it goes on with ``dp`` (exact
over chain schedules), ``cpsat`` (exact over region schedules of general graphs, within the
time limit) and, when something fits and there is a time limit, ``cpsat_fine`` (a finer space,
for `SolverConfig.fine_share` of the limit, warm-started from the best so far), and returns
the schedule with the least recompute time whose simulated peak fits.

That answer is certified (`certify.certify`) with what is left of the limit, against the best
of relax's bound and the one solved then: OPTIMAL only where the bound reaches the schedule's
recompute time, else FEASIBLE with the gap to it (``space_optimal`` when it is proven optimal
over the space in ``schedule.meta["space"]``). When nothing fits it takes `floor.floor` (the same
for every budget on the graph, time limit and config): its schedule where that fits, else
INFEASIBLE carrying it (``floor``, ``min_feasible_bytes``).
"""

from __future__ import annotations

import time
from dataclasses import replace

from ..ir.graph import CostGraph
from .base import INFEASIBLE, OPTIMAL, SolveResult, finish, get_solver, register
from .certify import certify
from .config import SolverConfig
from .floor import floor

__all__ = ["auto", "BASELINES"]

#: baselines auto also tries, by name
BASELINES = ("every_block", "sqrt", "uniform:2", "uniform:4", "greedy", "knapsack")


@register("auto")
def auto(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None,
         config: SolverConfig | None = None) -> SolveResult:
    """The best fitting schedule of the exact methods and the baselines, certified (see the
    module docstring)."""
    config = config or SolverConfig()
    started = time.perf_counter()

    def left() -> float:  # what the others leave of the limit
        assert time_limit_s is not None
        return time_limit_s - (time.perf_counter() - started)

    # the baselines run first (seconds at most, on thousands of nodes), so that the time
    # limit covers them; the list keeps dp first, so that dp wins a tie with a baseline
    baselines = [get_solver(name)(graph, budget_bytes, time_limit_s=time_limit_s)
                 for name in BASELINES]
    relaxed = get_solver("relax")(
        graph, budget_bytes, config=config,
        time_limit_s=None if time_limit_s is None else config.relax_share * time_limit_s)
    if relaxed.status == OPTIMAL:
        return replace(certify(graph, relaxed, config=config),
                       solve_s=time.perf_counter() - started)
    results = [get_solver("dp")(graph, budget_bytes, time_limit_s=time_limit_s, config=config),
               relaxed]
    reserve = 0.0 if time_limit_s is None else config.fine_share * time_limit_s
    fitting = [r for r in results + baselines if r.status != INFEASIBLE]
    if time_limit_s is None or left() >= config.min_solve_s or not fitting:
        # (with nothing that fits yet, it runs however little time is left: min_solve_s)
        results.append(get_solver("cpsat")(
            graph, budget_bytes, time_limit_s=None if time_limit_s is None
            else max(config.min_solve_s, left() - reserve),  # (it leaves cpsat_fine its share)
            config=config))
    fitting = [r for r in results + baselines if r.status != INFEASIBLE]
    if time_limit_s is not None and fitting and left() >= config.min_solve_s:
        # the finer space, for a share of the limit, from the best so far: seldom proven,
        # often faster schedules
        best = min(fitting, key=lambda r: r.estimate.recompute_s)  # type: ignore[union-attr]
        results.append(get_solver("cpsat_fine")(
            graph, budget_bytes, time_limit_s=min(left(), config.fine_share * time_limit_s),
            warm=best.schedule, config=config))
    results += baselines
    fitting = [r for r in results if r.status != INFEASIBLE]
    if fitting:
        # ties go to the earlier entry, so dp wins a tie with a baseline
        best = min(fitting, key=lambda r: r.estimate.recompute_s)  # type: ignore[union-attr]
        best = certify(graph, best, time_limit_s=None if time_limit_s is None else left(),
                       bound_s=relaxed.lower_bound_s, config=config)
        return replace(best, solve_s=time.perf_counter() - started)
    # nothing fits: the floor (the same for every budget on this graph and limit) decides
    least = floor(graph, time_limit_s=time_limit_s, config=config)
    if least.bytes <= budget_bytes:
        return finish(graph, budget_bytes, least.schedule, solver="auto", started=started)
    return replace(results[0], solve_s=time.perf_counter() - started,
                   min_feasible_bytes=least.bytes, floor=least)
