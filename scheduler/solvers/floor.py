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

**The named budget solves in a new process too.** The offers (`offered`, the first phase)
are deterministic: each gets a fixed share of the limit and spends it as work sized without
the clock (`dp`'s and the block DP's tables from the graph's size, the block DP skipped
where its table would not fit its share; CP-SAT with one worker, a fixed seed and a
*deterministic* time limit). So the same graph, time limit and config give the same least
peak, ``reproducible_bytes``, in any process, and `auto` asks for the offers first wherever
no baseline fits, so that they get the limit from its start as they did when the floor was
named. The error names that budget (`Floor.named_bytes`). The probes and the bisection after
them stop at the wall clock, so what they find below it (``bytes``, ``schedule``) is kept
and shown but not promised. Where the shared deadline cut an offer short, nothing is
reproducible (``reproducible_bytes`` None) and the error says so: the least peak found then
solves in this process (the floor is computed once per graph, time limit and config and kept
beside the graph, `base.graph_cache`, so every budget asked for names the same floor), not
surely in another.
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
from ..quantities import format_bytes
from .base import FEASIBLE, OPTIMAL, get_solver
from .config import SolverConfig
from .deadline import left
from .floor_offers import offered, once_per_limit
from .relax import relax_and_round

__all__ = ["Floor", "ONE_LEVEL", "UNIVERSAL", "floor", "universal_bound"]

#: the space `Floor.lower_bound_bytes` holds over
ONE_LEVEL = ("one-level region schedules (boundaries after any compute node, keep or "
             "recompute, any save set)")
#: the space `Floor.universal_bytes` holds over
UNIVERSAL = "any schedule at all, nested regions included"

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
    #: the least peak of the deterministic offers (`offered`), when none was cut short by the
    #: time limit: a new solve asking for it (same time limit and config) finds it again;
    #: None when one was cut short
    reproducible_bytes: int | None = None
    #: the schedule that peaks at ``reproducible_bytes``
    reproducible_schedule: Schedule | None = None

    @property
    def named_bytes(self) -> int:
        """The budget an infeasible-budget error names: ``reproducible_bytes`` where there is
        one (it solves when asked in a new process), else ``bytes`` (it solves in this
        process, which keeps this floor; a new one may not find it)."""
        return self.bytes if self.reproducible_bytes is None else self.reproducible_bytes

    def describe(self, need: int | None = None, low: int | None = None) -> str:
        """What is known, in the error's words: ``need`` and ``low`` are ``bytes`` and
        ``lower_bound_bytes`` in the caller's terms (before headroom), by default as they
        are."""
        need = self.named_bytes if need is None else need
        low = self.lower_bound_bytes if low is None else low
        if self.status == OPTIMAL and self.named_bytes == self.bytes:
            return (f"the smallest budget that fits is {format_bytes(need)} ({need} bytes) "
                    f"(proven over {self.space})")
        return (f"a schedule fits {format_bytes(need)} ({need} bytes); no schedule fits below "
                f"{format_bytes(low)} ({low} bytes) (proven over {self.space}); between them: "
                f"unknown, give more time (time limit {self.time_limit_s} s)")

    def promise(self, need: int | None = None, found: int | None = None) -> str:
        """What asking for the named budget does, in the error's words (``need`` and
        ``found``: `named_bytes` and ``bytes`` in the caller's terms)."""
        need = self.named_bytes if need is None else need
        found = self.bytes if found is None else found
        if self.reproducible_bytes is None:
            return (f"the smallest feasible budget over every schedule found (the error's "
                    f"floor.schedule); but the time limit ({self.time_limit_s} s) cut the "
                    "deterministic search short, so a new solve may not find it again: give a "
                    "longer time limit for a floor that reproduces")
        text = ("the smallest feasible budget over every schedule found by deterministic "
                "searches: asking for it solves, in a new process too, with the same time "
                "limit and solver config")
        if self.bytes < self.reproducible_bytes:
            text += (f"; a time-limited search also found a schedule that fits "
                     f"{format_bytes(found)} ({found} bytes) (the error's floor.schedule, "
                     "usable as it is), which a new solve may not find again")
        return text

    def to_dict(self) -> dict[str, Any]:
        """The floor as JSON-ready values (the schedule as its region count)."""
        return {"bytes": self.bytes, "lower_bound_bytes": self.lower_bound_bytes,
                "universal_bytes": self.universal_bytes, "status": self.status,
                "space": self.space, "by": self.by, "time_limit_s": self.time_limit_s,
                "solve_s": self.solve_s, "reproducible_bytes": self.reproducible_bytes,
                "regions": len(self.schedule.regions),
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


# -------------------------------------------------------------------------- the floor


def floor(graph: CostGraph, *, time_limit_s: float | None = 30.0,
          config: SolverConfig | None = None) -> Floor:
    """The least peak of any schedule found on ``graph`` within ``time_limit_s``, with its
    proven lower bound and status (see the module docstring). Computed once per graph, time
    limit and config in a process (kept beside the graph).

    Raises:
        ValueError: ``time_limit_s`` is not None or a finite number > 0.
    """
    return once_per_limit(graph, "floor", time_limit_s, config, _floor)


def _floor(graph: CostGraph, time_limit_s: float | None, config: SolverConfig) -> Floor:
    started = time.perf_counter()
    first = offered(graph, time_limit_s=time_limit_s, config=config)
    universal = universal_bound(graph)
    hi, by, sched = first.bytes, first.by, first.schedule
    lo, space = universal, UNIVERSAL
    deadline = None if left() is None else time.perf_counter() + left()  # (the shared one)

    def limit() -> float | None:  # (a probe's: a third of what is left, at least _MIN_PROBE_S)
        if deadline is None:
            return None
        rest = deadline - time.perf_counter()
        return None if rest < _MIN_PROBE_S else min(rest, max(_MIN_PROBE_S, rest / 3))

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
    status = OPTIMAL if hi == lo else FEASIBLE

    def stamped(found: Schedule, who: str) -> Schedule:  # (simulated again, named)
        meta = {"space": f"the floor: the least peak found (by {who})", **found.meta,
                "floor": who}
        return replace(found, meta=meta, estimate=simulate(graph, found).to_dict())

    same = first.schedule is sched
    sched = stamped(sched, by)
    return Floor(bytes=hi, schedule=sched, by=by, lower_bound_bytes=lo, space=space,
                 universal_bytes=universal, status=status, time_limit_s=time_limit_s,
                 solve_s=time.perf_counter() - started,
                 reproducible_bytes=first.bytes if first.complete else None,
                 reproducible_schedule=None if not first.complete else sched if same
                 else stamped(first.schedule, first.by))
