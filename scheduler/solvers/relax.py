"""``relax``: schedules read off the full-space relaxation, with its proven bound.

`bound.Relaxation` is a CP-SAT relaxation of the full schedule space (any region boundaries,
keep or recompute, any save sets): every schedule maps to one of its solutions at no more
cost, so its optimum bounds every schedule from below. Its solutions also read as schedules
(`Relaxation.schedule`: runs of linked nodes become recompute regions, cached nodes their
save sets). `bound.relax_and_round` solves it at the budget and simulates the schedule of
every improving solution, keeping the best that fits. When the last one breaks the budget,
`repair.repair` changes it a step at a time (a node out of a save set, a region grown by a
node), by the simulator, until it fits; one far over the budget (`repair.STRIP_OVER`) is
repaired without its save sets, whose nodes then go back where they keep it fitting (of
the solutions found, the last whose schedule is within `repair.STRIP_REACH` that way). The
model starts with some of its memory constraints (`bound.MAX_STEPS` of each kind); when the
last rounded schedule breaks the budget at forward nodes or backward steps whose
constraints were left out, those go in and CP-SAT solves again. When it breaks it where the
model has them already (what the relaxation leaves out: transient replay peaks, what a
region holds after its last saver), the model is tightened there by the overshoot
(schedules, not bounds), up to `bound.ROUNDS` solves in all. Out of time with nothing that
fits, or with something worse than the best fitting cheap baseline (`cpsat.WARM_STARTS`),
it answers that baseline.

The bound holds over the full space (`finish` gets ``full_space=True``): the answer is
OPTIMAL when its simulated recompute time reaches it (within a millionth, the picosecond
rounding of the objective), else FEASIBLE with the gap to it. A better bound than the one
`full_space_bound` remembered replaces it, so other solvers' results on the same graph and
budget are judged against it too.

Running time: that of CP-SAT on the relaxation (O(reads * log nodes) Booleans and clauses,
memory constraints of O(storages) terms each), up to `bound.ROUNDS` times, plus a simulation
per improving solution. On the recorded graphs of up to 140 nodes it proves most budgets
optimal within 10 s. On the 600-node 12-layer HF GPT-2 at 70% of its peak it proved its
schedule optimal in 2.3 to 3.4 s; at 90%, within 10 s, it proved 2.354 ms optimal in 10 of 10
runs (4.8 to 7.0 s; the first solve goes on while its schedules fit, `bound.FIRST_SHARE`;
`bound.SUBSOLVERS`). On the 2,000-node synthetic DAG, whose skip connections reach far, CP-SAT
needs 3 to 9 s to solve the lean relaxation at 90% (on 2 cores); within 10 s the repaired
schedule took 33.96 to 34.03 ms, and the second solve, with the whole constraint the rounded
schedule broke most (`bound.LEAN_ADD`), raised the bound from 33.02 to 33.55 ms in 11 runs of
12 (`cpsat`: 123 to 137 ms; now that the constraints added count forward's copies between
their savers, `bound.Relaxation._forward_copy`, to 33.71 ms in 2 runs of 4: gaps of 0.94%);
at 70%, 167.7 to 168.0 ms against 163.2 (`bound.LEAN_GAP` leaves `repair` its time). At
50% its schedules break the budget by 11 to 13% (those of the first 10 s by about 100%):
given 30 s, repaired without their save sets, 514 and 526 ms against 372 (`cpsat` given
10 s: 790 to 803 ms).
"""

from __future__ import annotations

import math
import time

from ..ir.graph import CostGraph
from .base import FEASIBLE, INFEASIBLE, OPTIMAL, SolveResult, finish, reaches, register
from .bound import relax_and_round, remember_bound

__all__ = ["relax"]


@register("relax")
def relax(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
          ) -> SolveResult:
    """The best fitting schedule read off the full-space relaxation (see the module
    docstring), with the relaxation's bound: OPTIMAL when it reaches it."""
    from .cpsat import warm_start

    started = time.perf_counter()
    got = relax_and_round(graph, budget_bytes, time_limit_s)
    bound = remember_bound(graph, budget_bytes, got.bound)
    if bound == math.inf:  # proven: no schedule of the full space fits
        return finish(graph, budget_bytes, None, solver="relax", started=started,
                      status=INFEASIBLE, full_space=True)
    schedule, t = got.schedule, got.recompute_s
    if schedule is None or not reaches(t, bound):  # (then the cheap baselines may do better)
        warm = warm_start(graph, budget_bytes)
        if warm is not None and warm.estimate.recompute_s < t:
            schedule, t = warm.schedule, warm.estimate.recompute_s
    if schedule is None:
        return finish(graph, budget_bytes, None, solver="relax", started=started,
                      status=INFEASIBLE, full_space=True)
    status = OPTIMAL if reaches(t, bound) else FEASIBLE
    return finish(graph, budget_bytes, schedule, solver="relax", started=started,
                  status=status, lower_bound_s=bound, full_space=True)
