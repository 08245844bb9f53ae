"""``auto`` (the default): the exact methods, checked against every baseline.

On a graph with units (`CostGraph.units`) ``chain`` runs first (seconds at most, no clock)
and its schedule is a candidate like the others' (certified against the full-space bound
like them). With `SolverConfig.chain_first`, where chain proves its schedule OPTIMAL over its
space (``schedule.meta["space"]``) and no cheap baseline (``BASELINES`` less
`SLOW_BASELINES`) recomputes less within the budget, that is the answer at once.

The whole call keeps to one deadline, ``time_limit_s`` from its start (`deadline`): no step
starts past it and the ones under way stop there, so the answer is the best found by then.
Where everything kept fits the budget, that schedule is the answer at once, OPTIMAL: nothing is
recomputed, so nothing does better.
A budget below `floor.universal_bound` fits no schedule at all: the floor gets the whole
limit and the answer is INFEASIBLE. Otherwise it runs every baseline; where none fits, the
floor's deterministic offers (`floor_offers.offered`, cached per graph) next, from the start
of the limit, so that a budget an error named finds its schedule again; then, where blocks
repeat, ``blocks`` (exact over the chain of repeated blocks) and, where neither it, a
baseline nor the floor's offers fits, ``blocks_nested`` (two-level regions over the chain of
blocks: it needs no clock, and below the one-level floor it is what fits); then ``relax``
(schedules read off the full-space relaxation, with its proven bound, for
`SolverConfig.relax_share` of the time limit), and returns at once when that
is OPTIMAL (nothing in the full space does better). Otherwise it goes on with ``dp`` (exact
over chain schedules), ``cpsat`` (exact over region schedules of general graphs, within the
time limit) and, when something fits and there is a time limit, ``cpsat_fine`` (a finer space,
for `SolverConfig.fine_share` of the limit, warm-started from the best so far), and returns
the schedule with the least recompute time whose simulated peak fits, of all these.

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

from ..cost.simulate import simulate
from ..ir.graph import CostGraph
from ..ir.schedule import Schedule
from .base import INFEASIBLE, OPTIMAL, SolveResult, finish, get_solver, register
from .blockdp import blocks_of, table_built
from .certify import certify
from .chain import applies
from .config import SolverConfig
from .deadline import expired, within
from .deadline import left as time_left
from .floor import Floor, floor, universal_bound
from .floor_offers import offered
from .heuristics import BASELINES

__all__ = ["BASELINES", "auto"]

#: from this many compute nodes on, steps that would start past the time limit are skipped
#: (knapsack, relax and dp need seconds each there: about 12, 5 and 1 s at 3,275 nodes)
DEEP_NODES = 2000
#: baselines that take longer than the block DP on deep graphs (knapsack 12-20 s at 3,275
#: nodes, greedy 2.7 s at 4,272): not run there when blocks repeat and there is a time limit
SLOW_BASELINES = ("knapsack", "greedy")


@register("auto")
def auto(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None,
         config: SolverConfig | None = None) -> SolveResult:
    """The best fitting schedule of the exact methods and the baselines, certified (see the
    module docstring). Every step keeps to one deadline, ``time_limit_s`` from the call
    (`deadline`): a step that would start past it is skipped, one under way stops there."""
    config = config or SolverConfig()
    with within(time_limit_s):
        return _auto(graph, budget_bytes, time_limit_s, config)


def _auto(graph: CostGraph, budget_bytes: int, time_limit_s: float | None,
          config: SolverConfig) -> SolveResult:
    started = time.perf_counter()

    def left() -> float:  # what the others leave of the limit (the shared deadline's)
        rest = time_left()
        assert rest is not None
        return rest

    def short() -> bool:  # too little of the limit left for another step (a deep graph)
        return time_limit_s is not None and (expired() or len(graph.compute_nodes) >=
                                             DEEP_NODES and left() < config.min_solve_s)

    def infeasible(least: Floor) -> SolveResult:  # nothing fits: the floor says how far
        return replace(finish(graph, budget_bytes, None, solver="auto", started=started,
                              status=INFEASIBLE),
                       min_feasible_bytes=least.named_bytes, floor=least)

    if simulate(graph, Schedule.none(graph), timeline=False).peak_bytes <= budget_bytes:
        # everything kept fits: nothing recomputed, so no schedule does better
        return replace(finish(graph, budget_bytes, Schedule.none(graph), solver="auto",
                              started=started, status=OPTIMAL, lower_bound_s=0.0,
                              full_space=True), certified=True)
    chained = None
    if applies(graph):
        chained = get_solver("chain")(graph, budget_bytes, config=config)
        if chained.fits and short():
            # (the chain, which no clock stops, took what the limit left for the rest: its
            # schedule, as it is; on a deep graph the rest would start past the deadline)
            return replace(certify(graph, chained, time_limit_s=0.0, config=config),
                           solve_s=time.perf_counter() - started)
        if config.chain_first and chained.status == OPTIMAL:
            # (a baseline outside chain's space that recomputes less sends it to the rest)
            better = [r for name in BASELINES if name not in SLOW_BASELINES
                      for r in [get_solver(name)(graph, budget_bytes)]
                      if r.fits and r.estimate.recompute_s  # type: ignore[union-attr]
                      < chained.estimate.recompute_s]  # type: ignore[union-attr]
            if not better:
                return replace(chained,
                               solve_s=time.perf_counter() - started)
    if budget_bytes < universal_bound(graph):
        # proven: no schedule at all fits (`floor.universal_bound`); the floor gets the limit
        return infeasible(floor(graph, time_limit_s=time_limit_s, config=config))
    # the baselines first (a fraction of a second; on graphs of thousands of nodes a step
    # that would start past the limit is skipped, `DEEP_NODES`, and the answer's
    # ``meta["auto_skipped"]`` names it; ``every_block`` always runs)
    repeats = blocks_of(graph).repeats
    skipped: list[str] = []
    baselines = []
    deep = time_limit_s is not None and len(graph.compute_nodes) >= DEEP_NODES
    for name in BASELINES:
        if baselines and short() or deep and repeats and name in SLOW_BASELINES:
            skipped.append(name)
        else:
            baselines.append(get_solver(name)(graph, budget_bytes, time_limit_s=time_limit_s))
    early: list[SolveResult] = []
    if time_limit_s is not None and not any(r.status != INFEASIBLE for r in baselines):
        # near the floor: the floor's deterministic offers, from the start of the limit as
        # when a floor is named, so that asking for the budget an error named finds that
        # schedule again (`floor_offers.offered`); cached per graph, limit and config (without a
        # limit nothing stops early: the floor, if needed, finds them at the end as well)
        offer = offered(graph, time_limit_s=time_limit_s, config=config)
        if offer.bytes <= budget_bytes:
            early.append(finish(graph, budget_bytes, offer.schedule, solver="floor",
                                started=started))
    # exact over the chain of blocks where blocks repeat (seconds on thousands of nodes; past
    # the deadline only where its table is built already: then about a second at most);
    # the list keeps dp and blocks first, so that they win a tie with a baseline
    blocked = [get_solver("blocks")(graph, budget_bytes, config=config)] \
        if repeats and (not expired() or table_built(graph, config=config)) else []
    if repeats and not blocked:
        skipped.append("blocks")
    nested = []
    if repeats and (not expired() or table_built(graph, config=config, nested=True)) \
            and not any(r.status != INFEASIBLE for r in blocked + early + baselines):
        # below what the one-level block DP reaches: two-level regions over the chain of
        # blocks, before the searches that the clock stops take the rest of the limit (no
        # clock: a second or two where the table has a few thousand simulations; past the
        # deadline where the table is built, as by an earlier solve of the graph at a
        # smaller budget: `stash` solves with room for the RNG state first)
        nested = [get_solver("blocks_nested")(graph, budget_bytes, config=config)]
    relaxed = None
    if not (short() and (blocked or early or expired())):
        relaxed = get_solver("relax")(
            graph, budget_bytes, config=config, time_limit_s=None if time_limit_s is None
            else min(config.relax_share * time_limit_s, max(config.min_solve_s, left())))
        if relaxed.status == OPTIMAL:
            return replace(certify(graph, relaxed, config=config),
                           solve_s=time.perf_counter() - started)
    results = blocked + ([] if relaxed is None else [relaxed])
    if short() and (blocked or early or expired()):
        skipped += ["relax"] * (relaxed is None) + ["dp"]
    else:
        results.insert(0, get_solver("dp")(  # (first: dp wins a tie with blocks)
            graph, budget_bytes, config=config,
            time_limit_s=None if time_limit_s is None else max(config.min_solve_s, left())))
    reserve = 0.0 if time_limit_s is None else config.fine_share * time_limit_s
    fitting = [r for r in results + nested + early + baselines if r.status != INFEASIBLE]
    if time_limit_s is None or left() >= config.min_solve_s or not fitting:
        # (with nothing that fits yet, it runs with however little time is left: at least
        # its cheap warm starts, which may fit where the others did not)
        results.append(get_solver("cpsat")(
            graph, budget_bytes, time_limit_s=None if time_limit_s is None
            else max(config.min_solve_s, left() - reserve),  # (it leaves cpsat_fine its share)
            config=config))
    # (flat ones: cpsat_fine's space is flat, and the floor's offer may nest regions)
    fitting = [r for r in results + early + baselines if r.status != INFEASIBLE
               and r.schedule is not None and not r.schedule.nested]
    if time_limit_s is not None and fitting and left() >= config.min_solve_s:
        # the finer space, for a share of the limit, from the best so far: seldom proven,
        # often faster schedules
        best = min(fitting, key=lambda r: r.estimate.recompute_s)  # type: ignore[union-attr]
        results.append(get_solver("cpsat_fine")(
            graph, budget_bytes, time_limit_s=min(left(), config.fine_share * time_limit_s),
            warm=best.schedule, config=config))
    results += nested + early + baselines + (
        [chained] if chained is not None and chained.fits else [])
    fitting = [r for r in results if r.status != INFEASIBLE]
    if fitting:
        # ties go to the earlier entry, so dp wins a tie with a baseline
        best = min(fitting, key=lambda r: r.estimate.recompute_s)  # type: ignore[union-attr]
        best = certify(graph, best, time_limit_s=None if time_limit_s is None else left(),
                       bound_s=None if relaxed is None else relaxed.lower_bound_s,
                       config=config)
        if skipped and best.schedule is not None:
            best = replace(best, schedule=replace(
                best.schedule, meta={**best.schedule.meta, "auto_skipped": skipped}))
        return replace(best, solve_s=time.perf_counter() - started)
    # nothing fits: the floor (the same for every budget on this graph and limit) decides
    least = floor(graph, time_limit_s=time_limit_s, config=config)
    if least.bytes <= budget_bytes:
        return finish(graph, budget_bytes, least.schedule, solver="auto", started=started)
    return infeasible(least)
