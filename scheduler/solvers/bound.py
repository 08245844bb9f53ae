"""A proven lower bound on recompute time over the *full* schedule space.

The full space is every schedule `Schedule` can express on one level: region boundaries after
any compute node, each region ``keep`` or ``recompute``, and any save set. The exact solvers
search smaller spaces (`dp`: chain cuts and a few save sets; `cpsat`: unit points and no save
sets), so their own optimality proofs say nothing about schedules outside them.
`full_space_bound` bounds every schedule of the full space at once (one solve of
`relaxation.Relaxation`), so that `certify` calls a result OPTIMAL only when it is proven so
over the full space, and its gap is honest otherwise.

It is checked against brute force over the full space on small graphs, and against random
schedules with save sets and local changes of `relax`'s schedules on the recorded graphs;
`certify` checks it against every result it judges (`BoundWarning`). Stopped early, the best
bound CP-SAT found by then stands. Nothing is remembered between calls.
"""

from __future__ import annotations

from ..ir.graph import CostGraph
from .config import SolverConfig
from .relax import relax_and_round

__all__ = ["BoundWarning", "full_space_bound"]


class BoundWarning(RuntimeWarning):
    """The bound came out above the recompute time of a schedule that fits: a bug in the
    relaxation for this graph. The result then carries no bound (and is not OPTIMAL)."""


def full_space_bound(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None,
                     config: SolverConfig | None = None) -> float:
    """A proven lower bound, in seconds, on the recompute time of every schedule of the full
    space whose simulated peak fits ``budget_bytes``; ``math.inf`` when it proves that none
    fits; 0.0 when CP-SAT finds no bound in ``time_limit_s`` (None:
    `SolverConfig.bound_s`)."""
    config = config or SolverConfig()
    limit = config.bound_s if time_limit_s is None else time_limit_s
    return relax_and_round(graph, budget_bytes, limit, rounds=1, config=config).bound
