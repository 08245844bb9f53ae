"""The floor: the least peak of any schedule found, and what is proven about it.

`floor` answers "what is the smallest budget that fits?" as a result with its own status,
rather than as a by-product of a solve that failed:

* ``bytes``: the least simulated peak of any schedule found, with that schedule (simulated
  again here). Its candidates come from every registered least-peak offer
  (`base.offers_least_peak`): the baselines' least-peak schedules, `brute` on small graphs,
  `dp`'s least peak over its chain space, `cpsat`'s over its unit points (CP-SAT minimizing
  the room above the base), and any solver family registered later. Then, with the rest of
  the time limit, probes: at a byte below the best, `cpsat` and `relax.relax_and_round` (the
  full-space relaxation, its schedules repaired by the simulator) look for a schedule that
  fits, again and again while they find one; the relaxation may prove that none of the
  one-level space does. Then a bisection between the lower bound and the best, with the
  relaxation, raises the bound where it proves a budget infeasible.
* ``lower_bound_bytes``: proven: no schedule of ``space`` peaks below it. The space is the
  one-level region space (`ONE_LEVEL`: region boundaries after any compute node, keep or
  recompute, any save set), where the bisection proves the relaxation infeasible; it starts
  at `universal_bound`.
* ``universal_bytes``: `universal_bound`, which holds for *any* schedule at all, nested
  regions included (see there for the argument).
* ``status``: ``OPTIMAL`` when ``bytes`` reaches ``lower_bound_bytes`` (no schedule of the
  space fits a byte less), else ``FEASIBLE`` (between them: unknown; more time may close it).

**Asking for the floor solves**: `auto`, when nothing it ran fits, takes the floor for the
same graph, time limit and config, and answers its schedule where it fits the budget; where it
does not, its INFEASIBLE result carries the floor, which `budget.infeasible_error` names.

**Same answer every time.** A floor depends on the graph, the time limit and the config only:
each offer gets a fixed share of the limit (not what the others left), `dp`'s table size is
chosen from the graph's size (not from a timed simulation), and nothing the solvers cached for
other budgets is read. Its CP-SAT parts stop at wall-clock limits, so two processes may get
further or less far in them; within one process the floor is computed once per graph, time
limit and config and kept beside the graph (`base.graph_cache`): every budget asked for on
that graph names the same floor.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

from ..cost.simulate import simulate
from ..cost.static import Static
from ..ir.graph import CostGraph
from ..ir.schedule import Schedule
from ..units import check_time_limit, format_bytes
from .base import (
    FEASIBLE,
    OPTIMAL,
    get_solver,
    graph_cache,
    least_peak_offers,
    offers_least_peak,
)
from .brute import MAX_NODES, brute_force
from .config import SolverConfig
from .cpsat import unit_points
from .cpsat_model import CpsatModel
from .dp import dp, min_feasible_bytes, table_for
from .heuristics import BASELINES
from .relax import relax_and_round

__all__ = ["Floor", "ONE_LEVEL", "UNIVERSAL", "floor", "universal_bound"]

#: the space `Floor.lower_bound_bytes` holds over
ONE_LEVEL = ("one-level region schedules (boundaries after any compute node, keep or "
             "recompute, any save set)")
#: the space `Floor.universal_bytes` holds over
UNIVERSAL = "any schedule at all, nested regions included"

#: the least-peak choices of the baselines (`greedy` and `knapsack` at a one-byte budget
#: return their lowest-peak candidate)
_BASELINES = ("none", *BASELINES)
#: share of the time limit that the offers get together (each a fixed part of it); the
#: bisection with the relaxation gets the rest
_OFFER_SHARE = 0.5
#: seconds a bisection probe gets at least
_MIN_PROBE_S = 0.3
#: bisection probes at most (enough to bisect a 2**30-byte gap to the byte)
_MAX_PROBES = 32


@dataclass(frozen=True)
class Floor:
    """The least peak of any schedule found on a graph, with what is proven about it (see the
    module docstring).

    Attributes:
        bytes: the least simulated peak of any schedule found.
        schedule: that schedule (its estimate stamped, simulated again).
        by: the offer (or ``"relax"``, the bisection) that found it.
        lower_bound_bytes: proven: no schedule of ``space`` peaks below it.
        space: the space the lower bound holds over: `ONE_LEVEL` where the bisection proved
            the relaxation infeasible above `universal_bound`, else `UNIVERSAL` (the bound is
            `universal_bound` then).
        universal_bytes: `universal_bound`: no schedule at all peaks below it.
        status: ``OPTIMAL`` when ``bytes == lower_bound_bytes``, else ``FEASIBLE``.
        time_limit_s: the time limit it was computed with.
        solve_s: seconds it took.
    """

    bytes: int
    schedule: Schedule
    by: str
    lower_bound_bytes: int
    space: str
    universal_bytes: int
    status: str
    time_limit_s: float | None
    solve_s: float

    def describe(self, need: int | None = None, low: int | None = None) -> str:
        """What is known, in the error's words: ``need`` and ``low`` are ``bytes`` and
        ``lower_bound_bytes`` in the caller's terms (before headroom), by default as they
        are."""
        need = self.bytes if need is None else need
        low = self.lower_bound_bytes if low is None else low
        if self.status == OPTIMAL:
            return (f"the smallest budget that fits is {format_bytes(need)} ({need} bytes) "
                    f"(proven over {self.space})")
        return (f"a schedule fits {format_bytes(need)} ({need} bytes); no schedule fits below "
                f"{format_bytes(low)} ({low} bytes) (proven over {self.space}); between them: "
                f"unknown, give more time (time limit {self.time_limit_s} s)")

    def to_dict(self) -> dict[str, Any]:
        """The floor as JSON-ready values (the schedule as its region count)."""
        return {"bytes": self.bytes, "lower_bound_bytes": self.lower_bound_bytes,
                "universal_bytes": self.universal_bytes, "status": self.status,
                "space": self.space, "by": self.by, "time_limit_s": self.time_limit_s,
                "solve_s": self.solve_s, "regions": len(self.schedule.regions),
                "recomputed": len(self.schedule.recompute_regions)}


def universal_bound(graph: CostGraph) -> int:
    """A lower bound on the simulated peak of every schedule, nested ones included.

    Whatever the schedule, the step runs every forward node once, in order, with its recorded
    allocations and frees, and a storage is freed no earlier than its recorded free or the end
    of its last forward reader (holding it for backward only delays that): so the forward with
    every such free applied is, event by event, at or below the forward of any schedule.
    Backward runs the recorded steps in order, with gradients no schedule changes; at step k
    the gradients live are the net of the steps before it plus the step's own high point, and
    the tensors step k's node saved must be there (kept from forward or replayed for it), as
    must the loss, which is held until backward ends. A replay only adds to that. The bound is
    the base plus the highest of these totals."""
    static = Static.of(graph)
    live = top = 0
    for _sid, b, _alloc in static.fwd_flat:
        live += b
        top = max(top, live)
    loss_node = graph.meta.get("loss_node")
    held = sum(st.bytes for st in graph.storages.values()
               if st.producer == loss_node and st.output)
    saved_by: dict[str, int] = {}
    for st in graph.storages.values():
        if not (st.producer == loss_node and st.output):
            for m in set(st.savers):
                saved_by[m] = saved_by.get(m, 0) + st.bytes
    grads = 0
    for node, high, net in static.bwd:
        at = grads + (high if high is not None else 0)
        top = max(top, held + saved_by.get(node or "", 0) + max(at, grads))
        grads += net
    return graph.base_bytes + top


# -------------------------------------------------------------------------- the offers


@offers_least_peak("baselines")
def _baseline_offer(graph: CostGraph, *, time_limit_s: float | None,
                    config: SolverConfig) -> list[Schedule]:
    """Each baseline's least-peak schedule."""
    return [get_solver(name)(graph, 1).schedule for name in _BASELINES]


@offers_least_peak("brute")
def _brute_offer(graph: CostGraph, *, time_limit_s: float | None,
                 config: SolverConfig) -> Schedule | None:
    """On graphs of at most `brute.MAX_NODES` compute nodes: the least peak over every
    boundary, keep or recompute (no save sets), by enumeration."""
    n = len(graph.compute_nodes)
    if n > MAX_NODES:
        return None
    points = list(range(n + 1))
    least = brute_force(graph, 0, points=points).min_feasible_bytes
    return None if least is None else brute_force(graph, least, points=points).schedule


def dp_cuts(graph: CostGraph, seconds: float | None, *, most: int = 40) -> int:
    """How many cuts `dp`'s table may have for its O(cuts^2) simulations to take about
    ``seconds``, estimated from the graph's size (events, storages, steps), not timed, so that
    the same graph and limit give the same table (None: ``most``)."""
    if seconds is None:
        return most
    static = Static.of(graph)
    per_sim = 8e-7 * (len(static.fwd_flat) + len(static.stor) + 4 * static.n_steps) + 1e-4
    per_pair = 4 * 3 * per_sim  # (region options, entry states)
    return max(2, min(most, int((2 * seconds / per_pair) ** 0.5)))


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
    not probed), until CP-SAT proves the room or time runs out. The best simulated wins."""
    from ortools.sat.python import cp_model

    deadline = None if time_limit_s is None else time.perf_counter() + time_limit_s
    points = unit_points(graph, config=config)
    try:
        probe_until = None if deadline is None else time.perf_counter() + 0.3 * time_limit_s
        model = CpsatModel(graph, points, None, deadline=deadline, probe_until=probe_until)
    except TimeoutError:
        return None
    best: tuple[int, Schedule] | None = None
    while True:
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = config.cpsat_workers
        if deadline is not None:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            solver.parameters.max_time_in_seconds = left
        st = solver.Solve(model.m)
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


# -------------------------------------------------------------------------- the floor


def floor(graph: CostGraph, *, time_limit_s: float | None = 30.0,
          config: SolverConfig | None = None) -> Floor:
    """The least peak of any schedule found on ``graph`` within ``time_limit_s``, with its
    proven lower bound and status (see the module docstring). Computed once per graph, time
    limit and config in a process (kept beside the graph).

    Raises:
        ValueError: ``time_limit_s`` is not None or a finite number > 0.
    """
    time_limit_s = check_time_limit(time_limit_s)
    config = config or SolverConfig()
    cache = graph_cache(graph, "floor")
    key = (time_limit_s, config)
    if key not in cache:
        cache[key] = _floor(graph, time_limit_s, config)
    return cache[key]


def _floor(graph: CostGraph, time_limit_s: float | None, config: SolverConfig) -> Floor:
    started = time.perf_counter()
    offers = least_peak_offers()
    share = None if time_limit_s is None else _OFFER_SHARE * time_limit_s / max(1, len(offers))
    best: tuple[int, str, Schedule] | None = None
    for name, offer in offers.items():
        got = offer(graph, time_limit_s=share, config=config)
        for sched in [got] if isinstance(got, Schedule) else list(got or ()):
            peak = simulate(graph, sched, timeline=False).peak_bytes
            if best is None or peak < best[0]:
                best = (peak, name, sched)
    assert best is not None, "the baselines always offer schedules"
    universal = universal_bound(graph)
    hi, by, sched = best
    lo, space = universal, UNIVERSAL
    deadline = None if time_limit_s is None else started + time_limit_s

    def limit() -> float | None:  # (a probe's: a third of what is left, at least _MIN_PROBE_S)
        if deadline is None:
            return None
        left = deadline - time.perf_counter()
        return None if left < _MIN_PROBE_S else min(left, max(_MIN_PROBE_S, left / 3))

    # down from the best: does anything fit a byte less? (cpsat, then the relaxation, which
    # may also prove that nothing of the one-level space does)
    for _ in range(_MAX_PROBES):
        if hi - 1 < lo or (deadline is not None and limit() is None):
            break
        found = get_solver("cpsat")(graph, hi - 1, time_limit_s=limit(), config=config)
        if found.fits:
            hi, by, sched = found.estimate.peak_bytes, "cpsat", found.schedule
            continue
        t = limit()
        if deadline is not None and t is None:
            break
        got = relax_and_round(graph, hi - 1, t, config=config)
        if got.bound == math.inf:
            lo, space = hi, ONE_LEVEL  # proven: no one-level schedule fits a byte less
            break
        if got.schedule is None:
            break  # unknown
        hi, by, sched = simulate(graph, got.schedule, timeline=False).peak_bytes, "relax", \
            got.schedule
    # up from the bound: bisect what the relaxation proves infeasible
    top = hi - 1  # probes go below this: an unknown answer moves it down
    for _ in range(_MAX_PROBES):
        t = limit()
        if lo >= top or (deadline is not None and t is None):
            break
        mid = (lo + top) // 2
        got = relax_and_round(graph, mid, t, config=config)
        if got.bound == math.inf:  # proven: no one-level schedule fits mid
            lo, space = mid + 1, ONE_LEVEL
        else:
            if got.schedule is not None:
                peak = simulate(graph, got.schedule, timeline=False).peak_bytes
                if peak < hi:
                    hi, by, sched = peak, "relax", got.schedule
            top = min(mid, hi - 1)  # unknown (or found): prove a smaller budget infeasible
    if lo > hi:  # (a bound above a schedule that fits would be a bug in it)
        raise AssertionError(f"the floor's lower bound {lo} exceeds the peak {hi} of a "
                             f"schedule found by {by!r} on graph {graph.name!r}: a bug in the "
                             "relaxation or in universal_bound; please report it with the "
                             "graph's JSON")
    if sched.depth > 1 and space == ONE_LEVEL:
        # the relaxation bounds one-level schedules only, and the least peak found nests:
        # only the universal bound holds over every schedule it competes with
        lo = universal
    if lo == universal:
        space = UNIVERSAL
    est = simulate(graph, sched)
    status = OPTIMAL if hi == lo else FEASIBLE
    meta = {"space": f"the floor: the least peak found (by {by})", **sched.meta, "floor": by}
    sched = replace(sched, meta=meta, estimate=est.to_dict())
    return Floor(bytes=hi, schedule=sched, by=by, lower_bound_bytes=lo, space=space,
                 universal_bytes=universal, status=status, time_limit_s=time_limit_s,
                 solve_s=time.perf_counter() - started)
