"""``auto`` (the default): the exact methods, checked against every baseline.

It runs every baseline, then ``relax`` (schedules read off the full-space relaxation, with its
proven bound, for `RELAX_SHARE` of the time limit), and returns at once when that is OPTIMAL
(nothing in the full space does better). Otherwise it goes on with ``dp`` (exact over chain
schedules), ``cpsat`` (exact over region schedules of general graphs, within the time limit)
and, when something fits and there is a time limit, ``cpsat_fine`` (a finer space, for
`FINE_SHARE` of the limit, warm-started from the best so far), and returns the schedule with
the least recompute time whose simulated peak fits. On graphs whose tensors reach far
(`bound.far_reads` above `FAR_READS`: more reads than that span over `bound.LINK_SPAN`
nodes, which make the relaxation slow to solve) ``relax`` runs last instead: with what the
others leave of the limit, or, with a limit of `LATE_SPLIT_S` or more, with all but the
`LATE_CPSAT_SHARE` that ``cpsat`` gets first.

Its ``space_optimal`` is the chosen solver's; its status and gap are against the best
full-space bound found for the graph and budget (`base.rebound`): OPTIMAL only where that
bound reaches the schedule's recompute time, else FEASIBLE with the gap to it
(``space_optimal`` when it is proven optimal over the space in ``schedule.meta["space"]``).
When nothing fits it reports INFEASIBLE with the least peak any of them reaches.
"""

from __future__ import annotations

import time
from dataclasses import replace

from ..ir.graph import CostGraph
from .base import INFEASIBLE, OPTIMAL, SolveResult, get_solver, rebound, register
from .bound import far_reads

__all__ = ["auto", "BASELINES", "FAR_READS", "FINE_SHARE", "LATE_CPSAT_SHARE", "LATE_RELAX_S",
           "LATE_SPLIT_S", "MIN_SOLVE_S", "RELAX_SHARE"]

#: the share of ``time_limit_s`` auto gives `relax` first (it returns early when it proves its
#: schedule optimal: on the recorded graphs of up to 140 nodes, mostly in 0.5 to 7 s). On the
#: 600-node 12-layer HF GPT-2 at 90% it needs about 5 s to prove its (lean) relaxation and
#: more to round a schedule that fits: at 10 s, half the limit gave 2.70 ms (cpsat_fine's),
#: three quarters 2.37 and 2.40 ms (relax's, gaps of 2.5 and 3.8%)
RELAX_SHARE = 0.75

#: above this share of far reads (`bound.far_reads`), `relax` runs after `cpsat`: below
#: `LATE_SPLIT_S`, last, with what the others leave (when that is more than `LATE_RELAX_S`),
#: for its bound. The 2,000-node synthetic DAG has 21% (its skip connections start anywhere
#: earlier): CP-SAT needs 5 to 10 s to solve its relaxation at 90% (33.0 ms), its rounded
#: schedules break the budget and `repair` makes them fit. With relax first, at 10 s auto
#: answered 34.03, 168.0 and 947.6 ms at 90, 70 and 50% in 10.6 to 11.2 s (`cpsat`, after it,
#: had its minimum of 1 s: nothing better than a baseline at 50%). The recorded graphs have 0
#: to 1.8%
FAR_READS = 0.05
LATE_RELAX_S = 2.0

#: there, with a time limit of at least `LATE_SPLIT_S`, `cpsat` gets `LATE_CPSAT_SHARE` of it,
#: `cpsat_fine` nothing and `relax` the rest. At 10 s (on 2 cores, four runs) that gave 33.96
#: to 34.03, 167.9 to 169.5 and 829 to 938 ms at 90, 70 and 50%, where `cpsat` first and `relax`
#: with what was left (nothing) gave 126 to 147, 438 to 443 and 826 to 918 ms, and `cpsat` alone
#: with the whole 10 s 123 to 137, 421 to 444 and 790 to 851 ms. (Before `bound.SUBSOLVERS` had
#: ``lb_tree_search``, `relax` with three quarters of 10 s did not fit at 70%: the split then
#: began at 20 s.) At 30 s it gave 33.85, 168.0 and 513 to 516 ms (two runs of three at 50%,
#: where `relax` now repairs schedules far over the budget without their save sets,
#: `repair.STRIP_OVER`; the third 918 ms), the last build 33.97, 168.1 and 850.7 ms
LATE_SPLIT_S = 10.0
LATE_CPSAT_SHARE = 0.25

#: the share of ``time_limit_s`` auto gives `cpsat_fine` after the others (none without a
#: limit: it rarely proves optimality, so it would not stop)
FINE_SHARE = 0.2

#: with a time limit, `cpsat` and `cpsat_fine` run only with this much of it left (`cpsat`
#: with less when nothing fits yet: for this long), so that auto keeps to the limit
MIN_SOLVE_S = 0.5

#: baselines auto also tries, by name
BASELINES = ("every_block", "sqrt", "uniform:2", "uniform:4", "greedy", "knapsack")


@register("auto")
def auto(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
         ) -> SolveResult:
    """The best fitting schedule of the exact methods and the baselines (see the module
    docstring)."""
    started = time.perf_counter()

    def left() -> float:  # what the others leave of the limit
        assert time_limit_s is not None
        return time_limit_s - (time.perf_counter() - started)

    # the baselines run first (seconds at most, on thousands of nodes), so that the time
    # limit covers them; the list keeps dp first, so that dp wins a tie with a baseline
    baselines = [get_solver(name)(graph, budget_bytes, time_limit_s=time_limit_s)
                 for name in BASELINES]
    late = far_reads(graph) > FAR_READS  # (relax runs last there)
    # (with time enough, relax gets most of it there, after a short cpsat)
    split = late and time_limit_s is not None and time_limit_s >= LATE_SPLIT_S
    relaxed = None if late else get_solver("relax")(
        graph, budget_bytes,
        time_limit_s=None if time_limit_s is None else RELAX_SHARE * time_limit_s)
    if relaxed is not None and relaxed.status == OPTIMAL:
        return replace(relaxed, solve_s=time.perf_counter() - started)
    # (the others' gaps are against the bound relax found, which full_space_bound remembers)
    results = [get_solver("dp")(graph, budget_bytes, time_limit_s=time_limit_s)]
    if relaxed is not None:
        results.append(relaxed)
    reserve = 0.0 if time_limit_s is None else FINE_SHARE * time_limit_s
    fitting = [r for r in results + baselines if r.status != INFEASIBLE]
    if time_limit_s is None or split or left() >= MIN_SOLVE_S or not fitting:
        # (with nothing that fits yet, it runs however little time is left: MIN_SOLVE_S)
        results.append(get_solver("cpsat")(
            graph, budget_bytes, time_limit_s=None if time_limit_s is None
            else LATE_CPSAT_SHARE * time_limit_s if split
            else max(MIN_SOLVE_S, left() - reserve)))  # (it leaves cpsat_fine its share)
    fitting = [r for r in results + baselines if r.status != INFEASIBLE]
    if time_limit_s is not None and fitting and not split and left() >= MIN_SOLVE_S:
        # the finer space, for a share of the limit, from the best so far: seldom proven,
        # often faster schedules
        best = min(fitting, key=lambda r: r.estimate.recompute_s)  # type: ignore[union-attr]
        results.append(get_solver("cpsat_fine")(
            graph, budget_bytes, time_limit_s=min(left(), FINE_SHARE * time_limit_s),
            warm=best.schedule))
    rest = None if time_limit_s is None else time_limit_s - (time.perf_counter() - started)
    if late and rest is not None and rest > LATE_RELAX_S:
        # what the others leave of the limit goes to relax, for its bound (and, now and
        # then, a better schedule)
        results.append(get_solver("relax")(graph, budget_bytes, time_limit_s=rest))
    results += baselines
    fitting = [r for r in results if r.status != INFEASIBLE]
    if fitting:
        # ties go to the earlier entry, so dp wins a tie with a baseline
        best = min(fitting, key=lambda r: r.estimate.recompute_s)  # type: ignore[union-attr]
        return replace(rebound(graph, best), solve_s=time.perf_counter() - started)
    peaks = [r.min_feasible_bytes for r in results if r.min_feasible_bytes is not None]
    peaks += [r.estimate.peak_bytes for r in results if r.estimate is not None]
    return replace(results[0], solve_s=time.perf_counter() - started,
                   min_feasible_bytes=min(peaks) if peaks else None)
