"""``cpsat``: OR-Tools CP-SAT over region schedules of general graphs, with lazy checks.

**Space.** Region boundaries at `unit_points`, each region ``keep`` or ``recompute``, no save
sets; ``cpsat_fine`` searches `fine_points` instead, a boundary after any node that saves
tensors (`cpsat_space`).

**Search.** `cpsat_model.CpsatModel` is a relaxation of the simulator over that space: it
never rejects a schedule the simulator accepts, and its objective is exact. Each solution is
simulated; one that does not fit (a replay burst the model had not probed) gets that replay's
constraint and a no-good, and the model is solved again (`solve_lazy`). The first solution
that fits is therefore optimal over the space when CP-SAT proves it OPTIMAL
(``space_optimal``); with the time limit hit it is FEASIBLE, with its bound over the space as
``space_bound_s``. Every improving solution CP-SAT reports is simulated on the way
(`Incumbents`); out of time, the best that fits is the answer.

**Warm start.** The best fitting cheap baseline (`warm_start`) is CP-SAT's hint, and cpsat's
answer when it is better than what CP-SAT found in time, or when nothing on the unit points
fits (FEASIBLE, with CP-SAT's bound over the space when it got that far; on large graphs
building the model can take the whole time limit, and then there is no bound over the space).

**Large models.** A model with more than ``config.cpsat_large_model`` constraints is first
searched without CP-SAT's presolve (answers within a second, but no useful bound), then the
rest of the time goes to a *bound model*, hinted with the best answer so far: the same
variables and objective with only ``config.cpsat_bound_steps`` of the memory constraints and
none of the replay ones, a relaxation of the relaxation that presolves in a fraction of a
second. Its bound holds over the space; its answers are simulated and cut off like the full
model's, so its first answer that fits, proven optimal, is optimal over the space.

**Time.** With a limit, replays are probed up front for ``config.cpsat_probe_share`` of it,
and the search ends ``config.cpsat_bound_share`` of it early, so that the caller can certify
the answer within the limit. The tunables are `config.SolverConfig`'s ``cpsat_*`` fields.

Running time: exponential in the worst case (CP-SAT); building the model is O(units^2 *
nodes) with every replay probed (see `cpsat_model`).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from ..cost.simulate import simulate
from ..ir.graph import CostGraph
from ..ir.schedule import Schedule
from .base import (
    FEASIBLE,
    INFEASIBLE,
    OPTIMAL,
    SolveResult,
    finish,
    get_solver,
    register,
)
from .config import SolverConfig
from .deadline import clamp
from .cpsat_model import CpsatModel
from .cpsat_space import NS, fine_points, unit_points

__all__ = ["Incumbents", "cpsat", "cpsat_fine", "fine_points", "min_feasible", "solve_lazy",
           "unit_points", "warm_start"]


def _probe_until(deadline: float | None, config: SolverConfig) -> float | None:
    """When probing replays up front stops: ``config.cpsat_probe_share`` of the time left."""
    if deadline is None:
        return None
    return time.perf_counter() + (deadline - time.perf_counter()) * config.cpsat_probe_share


def _cp_solver(deadline: float | None, config: SolverConfig) -> Any:
    """A CP-SAT solver with the time left until ``deadline``; None when none is left."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = config.cpsat_workers
    if deadline is not None:
        left = deadline - time.perf_counter()
        if left <= 0:
            return None
        solver.parameters.max_time_in_seconds = left
    return solver


def solve_lazy(graph: CostGraph, points: list[int], budget: int, deadline: float | None,
               warm: Schedule | None = None, *, config: SolverConfig | None = None
               ) -> tuple[str, Schedule | None, float | None]:
    """(status, schedule, lower bound over the space in s) for the budget; the status is the
    master problem's (``"TIMEOUT"`` when time ran out first; the bound is then CP-SAT's, when
    it has one).

    Every improving solution CP-SAT reports on the way is simulated (`Incumbents`): when time
    runs out, or the last one breaks a replay the model had not probed yet, the best that fits
    is the answer (FEASIBLE)."""
    from ortools.sat.python import cp_model

    config = SolverConfig() if config is None else config
    try:
        model = CpsatModel(graph, points, budget, deadline=deadline,
                           probe_until=_probe_until(deadline, config))
    except TimeoutError:
        return "TIMEOUT", None, None
    if warm is not None:
        model.hint(warm)
    seen = Incumbents(model, graph, budget)
    if deadline is not None and len(model.m.Proto().constraints) > config.cpsat_large_model:
        # CP-SAT's presolve of a large model can take most of the limit before the first
        # solution: search without it first (good answers, no bound), then go on with a
        # bound model, hinted with the best answer that fits
        quick = _cp_solver(time.perf_counter() + (deadline - time.perf_counter())
                           * config.cpsat_quick_share, config)
        if quick is not None:
            quick.parameters.cp_model_presolve = False
            if quick.Solve(model.m, seen.callback()) == cp_model.INFEASIBLE:
                return INFEASIBLE, None, None
        try:
            model = CpsatModel(graph, points, budget, deadline=deadline,
                               probe_until=time.perf_counter(),
                               steps=config.cpsat_bound_steps)
        except TimeoutError:
            return ("TIMEOUT", None, None) if seen.best is None else (
                FEASIBLE, seen.best[1], None)
        if seen.best is not None:
            model.hint(seen.best[1])
        seen.model = model
    bound = None
    while (solver := _cp_solver(deadline, config)) is not None:
        st = solver.Solve(model.m, seen.callback())
        if st == cp_model.INFEASIBLE:
            return INFEASIBLE, None, None
        # the master is a relaxation: its bound holds over the space (no-goods only cut off
        # schedules that do not fit), less what rounding node times to ns may have added
        got = max(0.0, solver.BestObjectiveBound() - 2 * (len(points) - 1)) / NS
        bound = got if bound is None else max(bound, got)
        if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break
        sched = model.schedule(solver)
        est = simulate(graph, sched)
        if est.peak_bytes <= budget:
            if st == cp_model.OPTIMAL:
                return OPTIMAL, sched, est.recompute_s
            return FEASIBLE, sched, bound
        model.add_replays(sched)
        model.forbid(solver)
    if seen.best is not None:
        return FEASIBLE, seen.best[1], bound
    return "TIMEOUT", None, bound


class Incumbents:
    """The best schedule that fits (by the simulator) among the solutions CP-SAT reports for
    ``model`` (``best``: its recompute time and itself, or None)."""

    def __init__(self, model: CpsatModel, graph: CostGraph, budget: int):
        self.model, self.graph, self.budget = model, graph, budget
        self.best: tuple[float, Schedule] | None = None

    def callback(self) -> Any:
        """A CP-SAT solution callback that simulates each improving solution."""
        from ortools.sat.python import cp_model

        outer = self

        class _Callback(cp_model.CpSolverSolutionCallback):
            def on_solution_callback(self) -> None:
                if outer.best is not None and self.ObjectiveValue() / NS >= outer.best[0]:
                    return
                sched = outer.model.schedule(self)
                est = simulate(outer.graph, sched)
                if est.peak_bytes <= outer.budget and (
                        outer.best is None or est.recompute_s < outer.best[0]):
                    outer.best = (est.recompute_s, sched)

        return _Callback()


def min_feasible(graph: CostGraph, points: list[int], deadline: float | None,
                 *, config: SolverConfig | None = None) -> int | None:
    """The least peak of any schedule in the space (the master minimizes the room above the
    base; each answer is simulated and cut off if the simulator disagrees); None when time
    runs out first."""
    from ortools.sat.python import cp_model

    config = SolverConfig() if config is None else config
    try:
        model = CpsatModel(graph, points, None, deadline=deadline,
                           probe_until=_probe_until(deadline, config))
    except TimeoutError:
        return None
    best = None
    while (solver := _cp_solver(deadline, config)) is not None:
        st = solver.Solve(model.m)
        if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break
        peak = simulate(graph, model.schedule(solver)).peak_bytes
        best = peak if best is None else min(best, peak)
        if st == cp_model.OPTIMAL and best <= solver.Value(model.room) + graph.base_bytes:
            break  # the room is a lower bound on every schedule not yet seen
        model.add_replays(model.schedule(solver))
        model.forbid(solver)
    return best


def warm_start(graph: CostGraph, budget_bytes: int, given: Schedule | None = None,
               *, config: SolverConfig | None = None) -> SolveResult | None:
    """The fitting result with the least recompute time among ``config.cpsat_warm_starts``
    (and ``given``), or None; ties go to the first listed."""
    config = SolverConfig() if config is None else config
    results = [get_solver(name)(graph, budget_bytes) for name in config.cpsat_warm_starts]
    if given is not None:
        results.append(finish(graph, budget_bytes, given, solver=given.solver or "given",
                              started=time.perf_counter()))
    fitting = [r for r in results if r.status != INFEASIBLE]
    return min(fitting, key=lambda r: r.estimate.recompute_s,  # type: ignore[union-attr]
               default=None)


@register("cpsat")
def cpsat(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None,
          config: SolverConfig | None = None) -> SolveResult:
    """CP-SAT over region schedules at `unit_points` (see the module docstring), warm-started
    with the best fitting cheap baseline. Out of time, it returns the better of the best
    schedule found that fits and that baseline, as FEASIBLE with CP-SAT's proven bound over
    the space as ``space_bound_s`` (when there is one; no higher than the baseline's time,
    which may lie off the unit points)."""
    config = SolverConfig() if config is None else config
    return _cpsat(graph, budget_bytes, time_limit_s, unit_points(graph, config=config),
                  "cpsat", "cpsat unit points", config=config)


@register("cpsat_fine")
def cpsat_fine(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None,
               warm: Schedule | None = None, config: SolverConfig | None = None
               ) -> SolveResult:
    """`cpsat` over `fine_points`: a region boundary may fall after any node that saves
    tensors (up to ``config.cpsat_fine_units`` units), not only where few tensors cross. A
    space that holds `cpsat`'s, so its optimum is never worse, but CP-SAT searches it more
    slowly and rarely proves it optimal within seconds (FEASIBLE at ``time_limit_s``, often
    with no useful bound over the space). ``warm``: a schedule to start from besides the cheap
    baselines (`auto` gives its best so far); without one, `cpsat` runs first, for
    ``config.cpsat_fine_warm_share`` of the limit, and its answer is the start."""
    config = SolverConfig() if config is None else config
    started = time.perf_counter()
    time_limit_s = clamp(time_limit_s)  # (never past a solve's shared deadline)
    if warm is None:
        first = cpsat(graph, budget_bytes, time_limit_s=None if time_limit_s is None
                      else config.cpsat_fine_warm_share * time_limit_s, config=config)
        warm = first.schedule if first.status != INFEASIBLE else None
        if time_limit_s is not None:
            time_limit_s = max(0.0, time_limit_s - (time.perf_counter() - started))
    return _cpsat(graph, budget_bytes, time_limit_s, fine_points(graph, config=config),
                  "cpsat_fine", "a boundary after any node that saves tensors (cpsat_fine)",
                  warm, started=started, config=config)


def _cpsat(graph: CostGraph, budget_bytes: int, time_limit_s: float | None,
           points: list[int], name: str, space: str, given: Schedule | None = None,
           started: float | None = None, *, config: SolverConfig) -> SolveResult:
    """`solve_lazy` over ``points`` (named ``space`` in the schedule), against the warm start
    (and ``given``), as the result of solver ``name``; its solve time counts from
    ``started``."""
    time_limit_s = clamp(time_limit_s)  # (never past a solve's shared deadline)
    at = time.perf_counter()
    started = at if started is None else started
    deadline = search_until = None
    if time_limit_s is not None:
        deadline = at + time_limit_s
        search_until = deadline - min(config.bound_s,
                                      config.cpsat_bound_share * time_limit_s)
    warm_result = warm_start(graph, budget_bytes, given, config=config)
    warm = None if warm_result is None else warm_result.schedule
    status, sched, bound = solve_lazy(graph, points, budget_bytes, search_until, warm,
                                      config=config)
    if sched is not None:
        sched = replace(sched, meta={**sched.meta, "space": space})
    if status == INFEASIBLE:  # proven: nothing in the space fits
        if warm is not None:  # ... but a baseline off the points does
            return finish(graph, budget_bytes, warm, solver=name, started=started,
                          status=FEASIBLE)
        return finish(graph, budget_bytes, None, solver=name, started=started,
                      status=INFEASIBLE,
                      min_feasible_bytes=min_feasible(graph, points, deadline, config=config))
    warm_s = None if warm_result is None else warm_result.estimate.recompute_s
    if status != OPTIMAL and warm_s is not None and bound is not None:
        bound = min(bound, warm_s)  # a bound over the points and the warm start
    if status != OPTIMAL and warm_s is not None and (
            sched is None or warm_s < simulate(graph, sched).recompute_s):
        # out of time before finding a schedule that fits, or one that beats the warm start
        return finish(graph, budget_bytes, warm, solver=name, started=started,
                      status=FEASIBLE, lower_bound_s=bound)
    if sched is None:
        return finish(graph, budget_bytes, None, solver=name, started=started,
                      status=INFEASIBLE)
    return finish(graph, budget_bytes, sched, solver=name, started=started,
                  status=status, lower_bound_s=bound)
