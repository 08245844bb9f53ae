"""``relax``: schedules read off the full-space relaxation, with its proven bound.

`relaxation.Relaxation` is a CP-SAT relaxation of the full schedule space (any region
boundaries, keep or recompute, any save sets): every schedule maps to one of its solutions at
no more cost, so its optimum bounds every schedule from below, and its solutions read as
schedules (`Relaxation.schedule`). `relax_and_round` solves it at the budget and simulates the
schedule of every improving solution, keeping the best that fits:

* the model starts with some of its memory constraints (`SolverConfig.max_steps` of each
  kind); when the last rounded schedule breaks the budget at forward nodes or backward steps
  whose constraints were left out, those go in and CP-SAT solves again, hinted with the last
  solution;
* when it breaks it where the model has them already (what the relaxation leaves out:
  transient replay peaks, what a region holds after its last saver), the model is tightened
  there by the overshoot (its solutions are then schedules, not bounds), up to
  `SolverConfig.rounds` solves in all;
* a last schedule over the budget goes to `repair.repair`, which changes it a step at a time,
  by the simulator, until it fits; one far over the budget (`SolverConfig.strip_over`) is
  repaired without its save sets, from the last solution whose schedule is within
  `SolverConfig.strip_reach` that way.

Out of time with nothing that fits, or with something worse than the best fitting cheap
baseline (`cpsat.warm_start`), it answers that baseline.

The bound holds over the full space (`finish` gets ``full_space=True``): the answer is OPTIMAL
when its simulated recompute time reaches it (within a millionth, the picosecond rounding of
the objective), else FEASIBLE with the gap to it; `certify` may raise it further.

Running time: that of CP-SAT on the relaxation (O(reads * log nodes) Booleans and clauses,
memory constraints of O(storages) terms each), up to `SolverConfig.rounds` times, plus a
simulation per improving solution and `repair`'s simulations.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ..cost.simulate import Estimate, simulate
from ..ir.graph import CostGraph
from ..ir.schedule import Schedule
from .base import FEASIBLE, INFEASIBLE, OPTIMAL, SolveResult, finish, reaches, register
from .config import SolverConfig
from .cpsat import warm_start
from .deadline import clamp
from .relaxation import Relaxation
from .repair import repair, stripped

__all__ = ["Relaxed", "relax", "relax_and_round"]


@dataclass(frozen=True)
class Relaxed:
    """What `relax_and_round` found: a proven ``bound`` (seconds; ``math.inf``: nothing
    fits), whether it is the relaxation's ``proven`` optimum (all memory constraints the
    rounded schedules broke included), and the best ``schedule`` that fits among those read
    off its solutions (None if none did), with its simulated recompute time."""

    bound: float
    proven: bool
    schedule: Schedule | None
    recompute_s: float = math.inf


def relax_and_round(graph: CostGraph, budget_bytes: int, time_limit_s: float | None,
                    *, rounds: int | None = None, config: SolverConfig | None = None
                    ) -> Relaxed:
    """Solve the relaxation at the budget, lazily: each solution is rounded to a schedule and
    simulated; the memory constraints it breaks that the model left out go in, and it is
    solved again (hinted with the last solution), up to ``rounds`` solves (None:
    `SolverConfig.rounds`) or ``time_limit_s`` (None: each solve may take
    `SolverConfig.solve_s`; the first one stops at `SolverConfig.first_share` of the limit
    when its last schedule breaks the budget, at `SolverConfig.strip_share` when that is far
    over and one it found is within `repair`'s reach without its save sets). A last schedule
    over the budget goes to `repair` (or, when far over, that one). Each solve's bound is
    valid, so the best is kept. When a rounded schedule breaks no constraint the model lacks
    (what the relaxation leaves out), the model is tightened by its overshoot where it broke
    the budget (`Relaxation.tighten`): the next solves give schedules, not bounds."""
    config = config or SolverConfig()
    rounds = config.rounds if rounds is None else rounds
    time_limit_s = clamp(time_limit_s)  # (never past a solve's shared deadline)
    started = time.perf_counter()
    best: tuple[float, Schedule] | None = None
    bound, proven = 0.0, False
    try:
        rel = Relaxation(graph, budget_bytes, deadline=None if time_limit_s is None
                         else started + time_limit_s, config=config)
    except TimeoutError:
        return Relaxed(0.0, False, None)  # (no bound, no schedule)
    build_s = time.perf_counter() - started
    bounds = True  # (whether the model still bounds the budget: `Relaxation.tighten`)
    added = False  # (whether constraints a rounded schedule broke went in: `lean_add`)

    # each solve leaves half the model's build time (which grows with the graph, as
    # simulating its schedules does) for what comes after it within the limit; another starts
    # only with as much again for itself
    margin = build_s / 2

    def no_time() -> bool:
        return time_limit_s is not None and (
            time.perf_counter() - started + max(0.1, 2 * margin) > time_limit_s)

    def time_left() -> float:  # (for a solve or `repair`: the limit's rest but the margin)
        return config.solve_s if time_limit_s is None else \
            time_limit_s - (time.perf_counter() - started) - margin

    for round_ in range(rounds):
        if no_time():
            break
        limit = time_left()
        found: list[Schedule] = []
        simulated: dict[int, Estimate] = {}  # (by position in found: each simulated once)

        def estimate(i: int) -> Estimate:
            if i not in simulated:
                simulated[i] = simulate(graph, found[i])
            return simulated[i]

        def stop(objective: float, lower: float) -> bool:  # (see `SolverConfig.lean_gap`)
            return rel.lean and objective - lower <= config.lean_gap * objective and \
                estimate(len(found) - 1).peak_bytes > budget_bytes

        def overshoots() -> bool:  # (see `SolverConfig.first_share`)
            return bool(found) and estimate(len(found) - 1).peak_bytes > budget_bytes

        stripped_peaks: dict[int, int] = {}  # (by position in found)

        def to_repair() -> int:
            """The solution to repair: the last one, but when its schedule breaks the budget
            by more than `SolverConfig.strip_over`, the last whose schedule without save sets
            breaks it by `SolverConfig.strip_reach` at most, if any (-1: the last one)."""
            if estimate(len(found) - 1).peak_bytes <= (1 + config.strip_over) * budget_bytes:
                return -1
            for i in range(len(found) - 1, -1, -1):
                if i not in stripped_peaks:
                    stripped_peaks[i] = simulate(graph, stripped(found[i]),
                                                 timeline=False).peak_bytes
                if stripped_peaks[i] <= (1 + config.strip_reach) * budget_bytes:
                    return i
            return -1

        def strippable() -> bool:  # (see `SolverConfig.strip_share`)
            return bool(found) and to_repair() >= 0

        first = time_limit_s is not None and not round_ and rounds > 1
        lb, optimum = rel.solve(limit, on_solution=lambda value: found.append(
            rel.schedule(value)), stop=stop,
            checks=[(config.strip_share * limit, strippable),
                    (config.first_share * limit, overshoots)]
            if first else ())
        if bounds:
            if lb == math.inf:
                return Relaxed(math.inf, True, None)
            bound, proven = max(bound, lb), optimum
        last = None
        for i, sched in enumerate(found):
            last = est = estimate(i)
            if est.peak_bytes <= budget_bytes and (best is None or est.recompute_s < best[0]):
                best = (est.recompute_s, sched)
        if last is None or (best is not None and reaches(best[0], bound)):
            break
        if last.peak_bytes <= budget_bytes:
            break  # it fits: another solve would start over (with less time), or is done
        if best is None or best[0] > last.recompute_s:  # repaired, it may do better
            left = time_left()
            fixed = repair(graph, found[to_repair()], budget_bytes, left,
                           config=config) if left > 0 else None
            if fixed is not None:
                est = simulate(graph, fixed)
                if best is None or est.recompute_s < best[0]:
                    best = (est.recompute_s, fixed)
                    if reaches(best[0], bound):
                        break
        if no_time():
            break
        over = rel.overshoots(last)
        broken = [x for _, x in over if x in rel.pending][:config.max_steps]
        if rel.lean and not added:  # (see `SolverConfig.lean_add`)
            broken = [x for x in broken if x[0] != "burst"][:config.lean_add]
        if bounds and rel.add(broken):
            added = True
            continue  # (the worst few: each costs a pass over the storages to build)
        # what breaks the budget is what the relaxation leaves out: cut it off at those steps
        bounds = False
        if not rel.tighten(over[:config.max_steps]):
            break
    if best is None:
        return Relaxed(bound, proven, None)
    return Relaxed(bound, proven, best[1], best[0])


@register("relax")
def relax(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None,
          config: SolverConfig | None = None) -> SolveResult:
    """The best fitting schedule read off the full-space relaxation (see the module
    docstring), with the relaxation's bound: OPTIMAL when it reaches it."""
    started = time.perf_counter()
    got = relax_and_round(graph, budget_bytes, time_limit_s, config=config)
    bound = got.bound
    if bound == math.inf:  # proven: no schedule of the full space fits
        return finish(graph, budget_bytes, None, solver="relax", started=started,
                      status=INFEASIBLE, full_space=True)
    schedule, t = got.schedule, got.recompute_s
    if schedule is None or not reaches(t, bound):  # (then the cheap baselines may do better)
        warm = warm_start(graph, budget_bytes)
        if warm is not None and warm.estimate is not None and warm.estimate.recompute_s < t:
            schedule, t = warm.schedule, warm.estimate.recompute_s
    if schedule is None:  # (out of time: its bound still holds, for `auto` to judge others by)
        return finish(graph, budget_bytes, None, solver="relax", started=started,
                      status=INFEASIBLE, lower_bound_s=bound, full_space=True)
    status = OPTIMAL if reaches(t, bound) else FEASIBLE
    return finish(graph, budget_bytes, schedule, solver="relax", started=started,
                  status=status, lower_bound_s=bound, full_space=True)
