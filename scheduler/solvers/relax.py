"""``relax``: schedules read off the full-space relaxation, with its proven bound.

`bound.Relaxation` is a CP-SAT relaxation of the full schedule space (any region boundaries,
keep or recompute, any save sets): every schedule maps to one of its solutions at no more
cost, so its optimum bounds every schedule from below. Its solutions also read as schedules
(`Relaxation.schedule`: runs of linked nodes become recompute regions, cached nodes their
save sets). This solver solves it at the budget, simulates the schedule of every improving
solution and keeps the best that fits. What the relaxation leaves out (transient replay
peaks, what a region holds after its last saver) can make the rounded schedule overshoot the
budget; then it solves the relaxation again at a budget lowered by the overshoot, up to
`ROUNDS` times, each time keeping what fits the real budget.

The first solve's bound holds over the full space (`finish` gets ``full_space=True``): the
answer is OPTIMAL when its simulated recompute time reaches that bound (within a millionth,
the picosecond rounding of the objective), else FEASIBLE with the gap to it. A better bound
than the one `full_space_bound` remembered replaces it, so other solvers' results on the same
graph and budget are judged against it too.

Running time: that of CP-SAT on the relaxation (O(nodes * `bound.LINK_SPAN`) Booleans and
clauses, O(`bound.MAX_STEPS`) memory constraints of O(storages) terms each), up to
`ROUNDS` times, plus one simulation per improving solution.
"""

from __future__ import annotations

import time

from ..graph import CostGraph
from .base import FEASIBLE, INFEASIBLE, OPTIMAL, SolveResult, finish, register
from .bound import relax_and_round, remember_bound

__all__ = ["relax"]


@register("relax")
def relax(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
          ) -> SolveResult:
    """The best fitting schedule read off the full-space relaxation (see the module
    docstring), with the relaxation's bound: OPTIMAL when it reaches it."""
    started = time.perf_counter()
    got = relax_and_round(graph, budget_bytes, time_limit_s)
    bound = remember_bound(graph, budget_bytes, got.bound)
    if got.schedule is None:  # proven infeasible (bound inf), or nothing rounded fits
        return finish(graph, budget_bytes, None, solver="relax", started=started,
                      status=INFEASIBLE, full_space=True)
    t = got.recompute_s
    status = OPTIMAL if t - bound <= 1e-6 * t else FEASIBLE
    return finish(graph, budget_bytes, got.schedule, solver="relax", started=started,
                  status=status, lower_bound_s=bound, full_space=True)
