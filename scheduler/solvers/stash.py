"""Solving with room for the RNG state a plan's checkpoints stash.

The stash (`cost.rng.rng_stash_bytes`) is memory of the step that the simulated peak leaves
out, and how much of it there is depends on the schedule: which recompute regions hold a node
that may draw random numbers. `solve_with_rng_stash` therefore solves with room held back for
a first guess of it, prices the stash of what it got, and solves again with that much more
held back until the peak and the stash together fit.
"""

from __future__ import annotations

import dataclasses
import time
import warnings

from ..cost.rng import rng_stash_bytes, rng_stash_guess
from ..ir.graph import CostGraph
from ..quantities import format_bytes
from .base import INFEASIBLE, SolveResult
from .certify import solve_and_certify
from .deadline import within

__all__ = ["STASH_TRIES", "solve_with_rng_stash"]

#: solves `solve_with_rng_stash` tries before it accepts a plan without room for the stash
STASH_TRIES = 4
#: seconds of the time limit a further solve needs at least to be tried
_LEAST_S = 0.2


def solve_with_rng_stash(costs: CostGraph, target: int, solver: str,
                         time_limit_s: float | None, *, unscheduled_bytes: int) -> SolveResult:
    """`solve_and_certify` at ``target`` less a first guess of the RNG state the plan's
    checkpoints stash (`cost.rng.rng_stash_guess`), then, while the plan's peak and its stash
    (`cost.rng.rng_stash_bytes`: an upper bound, outside the simulated peak) together exceed
    ``target``, again with that much more held back. The schedule's
    ``meta["rng_stash_bytes"]`` records the stash, ``meta["rng_reserve_bytes"]`` the room held
    back (its status and gap are over the budget less that room); its budget is ``target``.

    The solves share ``time_limit_s``: one deadline (`deadline.within`) from the call holds
    them all. Where no schedule leaves the guessed room and none is proven not to fit
    ``target`` either (a budget within the guess of the least feasible one), it solves once
    more without the room, with what the first solve left (the floor's offers, cached per
    graph and time limit, answer it at once where they fit). When no schedule leaves room for
    the stash (within `STASH_TRIES` solves and the time limit), the plan that fits without it
    is returned, with a RuntimeWarning (attributed two frames up: to the code that called
    `plan.solve_graph`) naming how far over the two go.

    Guessing first keeps the common case to one solve: solving first without room left a
    solve that used its whole time limit (a slow machine) none for the second, and so warned
    of a stash the guess would have held."""
    # (where the unscheduled step fits (``unscheduled_bytes``, its simulated peak, which the
    # caller has), keeping everything stashes nothing: no room to guess)
    with within(time_limit_s):  # (one deadline for every solve below: a promise for the call)
        return _solve_with_rng_stash(costs, target, solver, time_limit_s, unscheduled_bytes)


def _solve_with_rng_stash(costs: CostGraph, target: int, solver: str,
                          time_limit_s: float | None, unscheduled_bytes: int) -> SolveResult:
    reserve, fits = rng_stash_guess(costs) if unscheduled_bytes > target else 0, None
    started = time.perf_counter()
    for _ in range(STASH_TRIES):
        # (the solves share the one time limit: `time_limit_s` is a promise for the call)
        limit = time_limit_s
        if fits is not None and time_limit_s is not None:
            limit = time_limit_s - (time.perf_counter() - started)
            if limit < _LEAST_S:
                result = fits
                break
        result = solve_and_certify(costs, target - reserve, solver, time_limit_s=limit)
        if result.status == INFEASIBLE or result.schedule is None or result.estimate is None:
            if fits is None and reserve and not _beyond(result, target):
                reserve = 0  # (the guess left no room: the plan without it, then its stash)
                continue
            if fits is None:
                return result
            result = fits  # (room for the stash cannot be had: the plan that fits without it)
            break
        stash = rng_stash_bytes(costs, result.schedule)
        over = result.estimate.peak_bytes + stash - target
        # (stamped with the caller's budget, which the peak and the stash together are held
        # to, not the smaller one solved at)
        meta = {**result.schedule.meta, "rng_stash_bytes": stash, "rng_reserve_bytes": reserve}
        result = dataclasses.replace(result, budget_bytes=target, schedule=dataclasses.replace(
            result.schedule, meta=meta, budget_bytes=target))
        if over <= 0 or not stash:
            return result
        fits = fits or result
        reserve += over
    stash = result.schedule.meta["rng_stash_bytes"]
    over = result.estimate.peak_bytes + stash - target
    warnings.warn(
        f"the plan's predicted peak {format_bytes(result.estimate.peak_bytes)} plus the RNG state "
        f"its checkpoints keep ({format_bytes(stash)}) exceeds the budget "
        f"{format_bytes(target)} by {format_bytes(over)}: no schedule with room for both was "
        f"found; give a budget {format_bytes(over)} higher to be sure it holds by the "
        f"allocator's count", RuntimeWarning, stacklevel=4)
    return result


def _beyond(result: SolveResult, target: int) -> bool:
    """Whether an INFEASIBLE ``result`` proves that nothing fits ``target`` either: its floor's
    proven lower bound, or the exact minimum its solver found, lies above it."""
    if result.floor is not None:
        return result.floor.lower_bound_bytes > target
    return result.min_feasible_bytes is not None and result.min_feasible_bytes > target
