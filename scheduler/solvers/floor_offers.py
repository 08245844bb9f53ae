"""The floor's first phase: the least-peak offers, deterministic, so that the floor they
name is found again in a new process (`solvers.floor`'s module docstring says why).

Every registered least-peak offer (`base.offers_least_peak`) runs here with a fixed share of
the time limit, spent as work sized without the clock: the baselines' least-peak schedules,
`brute` on small graphs, `dp`'s least peak over a table of `dp_cuts` cuts, and `cpsat`'s over
its unit points (one worker, a fixed seed, CP-SAT's deterministic time). `offered` keeps the
least simulated peak of them all, once per graph, time limit and config in a process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ..cost.simulate import simulate
from ..ir.graph import CostGraph
from ..ir.schedule import Schedule
from ..quantities import check_time_limit
from .base import get_solver, graph_cache, least_peak_offers, offers_least_peak
from .brute import MAX_NODES, brute_force, count_schedules
from .config import SolverConfig
from .cpsat import unit_points
from .cpsat_model import CpsatModel
from .deadline import OutOfTime, expired, left, within
from .dp import affordable_cuts, dp, min_feasible_bytes, simulation_s, table_for
from .heuristics import BASELINES

__all__ = ["Offered", "dp_cuts", "offered", "once_per_limit"]

#: the least-peak choices of the baselines (`greedy` and `knapsack` at a one-byte budget
#: return their lowest-peak candidate)
_BASELINES = ("none", *BASELINES)
#: share of the time limit that the offers get together (each a fixed part of it); the
#: floor's bisection with the relaxation gets the rest
_OFFER_SHARE = 0.5
#: CP-SAT's random seed in the floor's offers (any fixed value: the same search every time)
_SEED = 7


@offers_least_peak("baselines")
def _baseline_offer(graph: CostGraph, *, time_limit_s: float | None,
                    config: SolverConfig) -> list[Schedule]:
    """Each baseline's least-peak schedule."""
    return [get_solver(name)(graph, 1).schedule for name in _BASELINES]


@offers_least_peak("brute")
def _brute_offer(graph: CostGraph, *, time_limit_s: float | None,
                 config: SolverConfig) -> Schedule | None:
    """On graphs of at most `brute.MAX_NODES` compute nodes whose enumeration fits the
    offer's share of the limit (estimated from the graph's size, `dp.simulation_s`, not timed:
    the same in every process): the least peak over every boundary, keep or recompute (no
    save sets), by enumeration. (Unsized, a 12-node MLP's 75,000 schedules took 36 s of a
    30 s limit.)"""
    n = len(graph.compute_nodes)
    if n > MAX_NODES:
        return None
    points = list(range(n + 1))
    if time_limit_s is not None and \
            count_schedules(graph, points) * simulation_s(graph) > time_limit_s:
        return None
    least = brute_force(graph, 0, points=points).min_feasible_bytes
    return None if least is None else brute_force(graph, least, points=points).schedule


def dp_cuts(graph: CostGraph, seconds: float | None, *, most: int = 40) -> int:
    """How many cuts `dp`'s table may have for its O(cuts^2) simulations to take about
    ``seconds``, estimated from the graph's size (events, storages, steps), not timed, so that
    the same graph and limit give the same table (None: ``most``)."""
    return most if seconds is None else affordable_cuts(graph, seconds, most=most)


@offers_least_peak("dp")
def _dp_offer(graph: CostGraph, *, time_limit_s: float | None,
              config: SolverConfig) -> Schedule | None:
    """The least peak over `dp`'s chain space (a table of `dp_cuts` cuts)."""
    cuts = dp_cuts(graph, time_limit_s)
    table, _ = table_for(graph, max_cuts=cuts, save_top=config.save_top)
    least = min_feasible_bytes(table)
    return dp(graph, least, max_cuts=cuts, config=config).schedule


@offers_least_peak("cpsat")
def _cpsat_offer(graph: CostGraph, *, time_limit_s: float | None,
                 config: SolverConfig) -> Schedule | None:
    """The least peak over `cpsat`'s unit points: CP-SAT minimizes the room above the base;
    each answer is simulated and cut off when the simulator disagrees (a replay the model had
    not probed), until CP-SAT proves the room or its work runs out. The best simulated wins.

    Deterministic, so that the floor it names is found again in a new process: one worker, a
    fixed seed, every replay probed up front, and ``time_limit_s`` of CP-SAT's *deterministic*
    time (a count of work, not seconds) over all its solves. The shared deadline
    (`deadline`) stops it only as a backstop: then it raises `OutOfTime` with the best found
    (``partial``), which the floor uses but does not promise."""
    from ortools.sat.python import cp_model

    rest = left()
    deadline = None if rest is None else time.perf_counter() + max(0.0, rest)
    points = unit_points(graph, config=config)
    try:
        model = CpsatModel(graph, points, None, deadline=deadline, probe_until=None)
    except TimeoutError:
        raise OutOfTime("the floor's cpsat offer: out of time building its model") from None
    best: tuple[int, Schedule] | None = None
    used = 0.0  # (deterministic time spent)
    while True:
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.random_seed = _SEED
        if time_limit_s is not None:
            if used >= time_limit_s:
                break
            solver.parameters.max_deterministic_time = time_limit_s - used
        rest = left()
        if rest is not None:
            solver.parameters.max_time_in_seconds = max(1e-3, rest)
        st = solver.Solve(model.m)
        used += solver.deterministic_time
        if expired():  # (stopped by the wall clock, perhaps: what it found is not repeatable)
            raise OutOfTime("the floor's cpsat offer: out of time",
                            partial=None if best is None else best[1])
        if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break
        sched = model.schedule(solver)
        peak = simulate(graph, sched, timeline=False).peak_bytes
        if best is None or peak < best[0]:
            best = (peak, sched)
        if st == cp_model.OPTIMAL and best[0] <= solver.Value(model.room) + graph.base_bytes:
            break  # the room bounds every schedule not cut off yet
        model.add_replays(sched)
        model.forbid(solver)
    return None if best is None else best[1]


@dataclass(frozen=True)
class Offered:
    """The least-peak schedule of the offers (`offered`): its simulated peak ``bytes``, the
    offer that found it (``by``), and whether every offer ran to its end (``complete``): then
    the same graph, time limit and config give the same schedule in any process."""

    bytes: int
    schedule: Schedule
    by: str
    complete: bool


def offered(graph: CostGraph, *, time_limit_s: float | None = 30.0,
            config: SolverConfig | None = None) -> Offered:
    """The least peak of every registered least-peak offer (`base.offers_least_peak`), each
    given a fixed share of ``time_limit_s`` that it spends as deterministic work (table sizes
    from the graph's size, CP-SAT's deterministic time), never what the clock says: so the
    answer is the same in every process, unless the shared deadline (`deadline`) cuts an
    offer short first (``complete`` False; what that offer found still counts). The floor's
    first phase; `auto` asks for it first where no baseline fits, so that it gets the limit
    from its start. Computed once per graph, time limit and config in a process.

    Raises:
        ValueError: ``time_limit_s`` is not None or a finite number > 0.
    """
    return once_per_limit(graph, "floor offers", time_limit_s, config, _offered)


def once_per_limit(graph: CostGraph, name: str, time_limit_s: float | None,
                   config: SolverConfig | None,
                   compute: Callable[[CostGraph, float | None, SolverConfig], Any]) -> Any:
    """``compute(graph, time_limit_s, config)`` under the shared deadline of ``time_limit_s``
    (inside the caller's: `auto`'s limit holds), once per graph, time limit and config in a
    process (`base.graph_cache` under ``name``).

    Raises:
        ValueError: ``time_limit_s`` is not None or a finite number > 0.
    """
    time_limit_s = check_time_limit(time_limit_s)
    config = config or SolverConfig()
    cache = graph_cache(graph, name)
    key = (time_limit_s, config)
    if key not in cache:
        with within(time_limit_s):
            cache[key] = compute(graph, time_limit_s, config)
    return cache[key]


def _offered(graph: CostGraph, time_limit_s: float | None, config: SolverConfig) -> Offered:
    offers = least_peak_offers()
    share = None if time_limit_s is None else _OFFER_SHARE * time_limit_s / max(1, len(offers))
    best: tuple[int, str, Schedule] | None = None
    complete = True
    for name, offer in offers.items():
        try:
            got = offer(graph, time_limit_s=share, config=config)
        except OutOfTime as e:
            complete, got = False, e.partial
        for sched in [got] if isinstance(got, Schedule) else list(got or ()):
            peak = simulate(graph, sched, timeline=False).peak_bytes
            if best is None or peak < best[0]:
                best = (peak, name, sched)
    assert best is not None, "the baselines always offer schedules"
    return Offered(bytes=best[0], schedule=best[2], by=best[1], complete=complete)
