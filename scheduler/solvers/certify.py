"""Certifying a result: its status and gap against the full-space lower bound.

A solver's result says what the solver proved over its own space (``space_optimal``,
``space_bound_s``); whether it is OPTIMAL over the *full* schedule space is decided here, in an
explicit step that `plan.solve_graph`, `auto` and the workflows take: `certify` solves
`bound.full_space_bound` within the time it is given and judges the result against the best
bound it knows, that one or one the caller or the solver already proved (`relax`'s). Nothing
is remembered between calls, so the same result, graph and time give the same answer whatever
ran before.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace

from ..ir.graph import CostGraph
from ..quantities import check_time_limit
from .base import (
    FEASIBLE,
    INFEASIBLE,
    OPTIMAL,
    SolveResult,
    above,
    get_solver,
    reaches,
    relative_gap,
)
from .bound import BoundWarning, full_space_bound
from .config import SolverConfig
from .deadline import clamp, within

__all__ = ["certify", "solve_and_certify"]


def certify(graph: CostGraph, result: SolveResult, *, time_limit_s: float | None = None,
            bound_s: float | None = None, config: SolverConfig | None = None) -> SolveResult:
    """``result`` with its full-space ``lower_bound_s``, ``gap`` and ``status``: OPTIMAL when
    the schedule's simulated recompute time reaches the bound (within a millionth, the
    picosecond rounding of the bound's objective), else FEASIBLE; restamped in its schedule,
    and ``certified``. Its ``solve_s`` counts the time spent here.

    Args:
        graph: the graph the result was solved for.
        result: a solver's result. One that claims nothing (a baseline's, which is not
            ``certifiable``), one that does not fit, one certified already, or one whose
            schedule nests regions (the full-space bound is over flat schedules: it neither
            bounds nor certifies a nested one) is returned as it is (certified).
        time_limit_s: seconds for the bound's solve: at most `SolverConfig.bound_s`; with less
            than `SolverConfig.min_bound_s`, none is solved. None: `SolverConfig.bound_s`.
        bound_s: a full-space bound proven already for this graph and budget (``relax``'s,
            say). The best of it, the result's own ``lower_bound_s`` (from a solver whose
            space is the full one) and the one solved here stands; when the known ones reach
            the recompute time already, none is solved.
        config: the tunables (None: the defaults).

    Warns:
        BoundWarning: a bound above the recompute time of the result's fitting schedule (a bug
            in the relaxation); that bound is dropped.
    """
    if result.certified or not result.certifiable or result.status == INFEASIBLE \
            or result.schedule is None or result.estimate is None:
        return replace(result, certified=True)
    if result.schedule.nested:
        # the full-space bound is over flat schedules (with save sets); a nested schedule can
        # fit where none of those does, so that bound neither bounds nor certifies it: the
        # result keeps what its solver proved over its own space (``space_optimal``)
        return replace(result, certified=True)
    config = config or SolverConfig()
    started = time.perf_counter()
    t = result.estimate.recompute_s
    known = [b for b in (result.lower_bound_s, bound_s) if b is not None]
    if not any(reaches(t, b) for b in known):
        limit = config.bound_s if time_limit_s is None else min(config.bound_s, time_limit_s)
        limit = clamp(limit)  # (never past a solve's shared deadline: `deadline`)
        if limit >= config.min_bound_s:
            known.append(full_space_bound(graph, result.budget_bytes, time_limit_s=limit,
                                          config=config))
    valid = []
    for b in known:
        if above(b, t):
            warnings.warn(
                f"the full-space bound {b} s exceeds the recompute time {t} s of "
                f"{result.solver!r}'s schedule, which fits the budget {result.budget_bytes}: "
                f"the bound's relaxation is wrong for graph {graph.name!r}; the result carries "
                "no bound. Please report it with the graph's JSON", BoundWarning, stacklevel=2)
        else:
            valid.append(b)
    bound = max(valid, default=None)
    status = OPTIMAL if bound is not None and reaches(t, bound) else FEASIBLE
    gap = None if bound is None else relative_gap(t, bound, status)
    solve_s = result.solve_s + (time.perf_counter() - started)
    return replace(result, status=status, lower_bound_s=bound, gap=gap, solve_s=solve_s,
                   certified=True,
                   schedule=replace(result.schedule, status=status, gap=gap, solve_s=solve_s))


def solve_and_certify(graph: CostGraph, budget_bytes: int, solver: str, *,
                      time_limit_s: float | None = None) -> SolveResult:
    """The registered solver ``solver`` on ``graph`` and ``budget_bytes`` within
    ``time_limit_s``, its result certified with what it leaves of the limit (`certify`; a
    certified result, `auto`'s, comes back as it is).

    Raises:
        UnknownSolverError: ``solver`` is not registered (the message lists valid names).
        ValueError: ``time_limit_s`` is not None or a finite number > 0 (`check_time_limit`).
    """
    time_limit_s = check_time_limit(time_limit_s)
    solve = get_solver(solver)
    started = time.perf_counter()
    with within(time_limit_s):  # (one deadline for every phase: `deadline`)
        result = solve(graph, budget_bytes, time_limit_s=time_limit_s)
        left = None if time_limit_s is None else time_limit_s - (time.perf_counter() - started)
        return certify(graph, result, time_limit_s=left)
