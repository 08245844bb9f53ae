"""The solver contract: one signature, one result type, a registry by name.

Every solver is a function ``(graph, budget_bytes, *, time_limit_s=None, **options) ->
SolveResult``. Its result carries the `Schedule`, the `Estimate` that `simulate` gives for it
(never the solver's own arithmetic), and a status:

* ``OPTIMAL``: the least recompute time over the *full* schedule space (any region
  boundaries, keep or recompute, any save sets), proven: by the solver itself when its space
  is the full one (`relax`), else by `certify.certify`, when the full-space bound reaches it;
* ``FEASIBLE``: fits the budget, optimality over the full space not proven (``gap`` says how
  far it may be, once certified; ``space_optimal`` says whether it is proven optimal over the
  solver's own space, named in ``schedule.meta["space"]``);
* ``INFEASIBLE``: nothing the solver considers fits. A baseline still returns its schedule and
  estimate so the caller sees by how much it misses; an optimizing solver returns
  ``schedule=None`` and, when it proved infeasibility, ``min_feasible_bytes``
  (``None`` there means it ran out of time before finding anything).

A solver's result depends only on the graph, the budget and its arguments (and, where it
searches within a time limit, on how far it got): nothing is remembered between calls but
what is computed from the graph alone (`graph_cache`).
This module imports no other solver module; `scheduler.solvers` imports every solver family,
which registers its solvers here.
"""

from __future__ import annotations

import re
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

from ..cost.simulate import Estimate, simulate
from ..cost.static import Static
from ..ir.graph import CostGraph
from ..ir.replays import legalize
from ..ir.schedule import Schedule

__all__ = ["OPTIMAL", "FEASIBLE", "INFEASIBLE", "SolveResult", "Solver", "register",
           "get_solver", "available", "UnknownSolverError", "finish", "reaches", "above",
           "relative_gap", "graph_cache", "offers_least_peak", "least_peak_offers"]

OPTIMAL = "OPTIMAL"
FEASIBLE = "FEASIBLE"
INFEASIBLE = "INFEASIBLE"


@dataclass(frozen=True)
class SolveResult:
    """What a solver returns. ``estimate == simulate(graph, schedule)`` whenever there is a
    schedule. ``lower_bound_s`` is a proven lower bound on the optimal recompute time over the
    full schedule space, where the result has one (from a solver whose space is the full one,
    or from `certify.certify`); ``gap`` is ``(recompute_s - lower_bound_s) /
    max(recompute_s, tiny)``. ``space_optimal``: proven optimal over the solver's own space
    (``schedule.meta["space"]``); ``space_bound_s``: the solver's lower bound over that space
    (not a bound over the full space). ``certifiable``: an optimizing solver's result that
    fits (a baseline's claims nothing, and `certify` leaves it as it is); ``certified``:
    `certify` has judged it."""

    solver: str
    status: str
    budget_bytes: int
    schedule: Schedule | None
    estimate: Estimate | None
    solve_s: float
    lower_bound_s: float | None = None
    gap: float | None = None
    # with INFEASIBLE: the smallest budget at which this solver's space has a schedule
    min_feasible_bytes: int | None = None
    space_optimal: bool = False
    space_bound_s: float | None = None
    certifiable: bool = False
    certified: bool = False
    # with INFEASIBLE from `auto`: the `floor.Floor` (least peak found, its proven bound)
    floor: Any = None

    @property
    def fits(self) -> bool:
        return self.estimate is not None and self.estimate.peak_bytes <= self.budget_bytes


class Solver(Protocol):
    def __call__(self, graph: CostGraph, budget_bytes: int, *,
                 time_limit_s: float | None = None, **options: Any) -> SolveResult: ...


class UnknownSolverError(ValueError):
    """An unknown solver name; the message lists the valid ones."""


_REGISTRY: dict[str, Callable[..., SolveResult]] = {}
_PARAMETRIC: dict[str, Callable[[str], Callable[..., SolveResult]]] = {}


def register(name: str, *, parametric: bool = False) -> Callable:
    """Decorator: register a solver under ``name``. A parametric entry (``uniform``) is a
    factory taking the text after the colon (``uniform:4``) and returning the solver."""

    def deco(fn: Callable) -> Callable:
        (_PARAMETRIC if parametric else _REGISTRY)[name] = fn
        return fn

    return deco


_LEAST_PEAK: dict[str, Callable[..., Any]] = {}


def offers_least_peak(name: str) -> Callable:
    """Decorator: register ``fn(graph, *, time_limit_s, config) -> Schedule | list[Schedule] |
    None``, the least-peak schedule(s) a solver family can find on a graph, under ``name``.
    `floor.floor` takes its candidates from every one registered (in registration order)."""

    def deco(fn: Callable) -> Callable:
        _LEAST_PEAK[name] = fn
        return fn

    return deco


def least_peak_offers() -> dict[str, Callable[..., Any]]:
    """The registered least-peak offers (`offers_least_peak`), by name, in registration
    order."""
    return dict(_LEAST_PEAK)


def available() -> list[str]:
    """Registered solver names (parametric ones shown as ``name:K``)."""
    return sorted(_REGISTRY) + sorted(f"{k}:K" for k in _PARAMETRIC)


def get_solver(name: str) -> Callable[..., SolveResult]:
    """The solver called ``name`` (``"dp"``, ``"cpsat"``, ``"uniform:4"``, ...).

    Raises:
        UnknownSolverError: listing the valid names.
    """
    if name in _REGISTRY:
        return _REGISTRY[name]
    m = re.fullmatch(r"([a-z_]+):(.+)", name)
    if m and m.group(1) in _PARAMETRIC:
        return _PARAMETRIC[m.group(1)](m.group(2))
    raise UnknownSolverError(
        f"unknown solver {name!r}; valid solvers: {', '.join(available())}")


def finish(graph: CostGraph, budget_bytes: int, schedule: Schedule | None, *, solver: str,
           started: float, status: str | None = None, lower_bound_s: float | None = None,
           min_feasible_bytes: int | None = None, full_space: bool = False) -> SolveResult:
    """Build a `SolveResult`: simulate the schedule, decide FEASIBLE/INFEASIBLE from the
    simulated peak unless ``status`` is given, and stamp the schedule with the solver's name,
    status, gap and budget. Nothing here bounds the result: that is `certify.certify`'s.

    An optimizing solver passes ``status`` (OPTIMAL when it proved the schedule optimal over
    its own space) and ``lower_bound_s`` (its bound over that space); its result is
    ``certifiable``. Unless ``full_space`` says that its space is the full one, both are kept
    as ``space_optimal`` and ``space_bound_s`` only, and the result is FEASIBLE (a schedule
    that fits) until `certify` judges it against the full-space bound. With ``full_space``,
    ``lower_bound_s`` is a bound over the full space and the status stands as given.

    A schedule with a recompute region the rewriter would refuse (`ir.replays`) is returned
    with its cuts moved (`replays.legalize`, listed in ``meta["moved_cuts"]``): the baselines
    rely on that; for a solver that claimed anything of it, the claims are dropped.
    """
    if schedule is not None:
        # a region the rewriter would refuse is never returned: its cuts move (`replays`),
        # and whatever the solver claimed for the schedule it found no longer holds
        schedule, moved = legalize(graph, schedule)
        if moved:
            schedule = replace(schedule, meta={**schedule.meta, "moved_cuts": moved})
        if moved and status != INFEASIBLE:
            status = lower_bound_s = None
    est = simulate(graph, schedule) if schedule is not None else None
    claimed = status
    if status is None:
        status = FEASIBLE if est is not None and est.peak_bytes <= budget_bytes else INFEASIBLE
    if status != INFEASIBLE and (est is None or est.peak_bytes > budget_bytes):
        raise AssertionError(
            f"solver {solver!r} claimed {status} but its schedule's simulated peak "
            f"{None if est is None else est.peak_bytes} exceeds the budget {budget_bytes}")
    space_optimal = claimed == OPTIMAL and status != INFEASIBLE
    space_bound = lower_bound_s
    if not full_space:
        lower_bound_s = None
        if claimed is not None and status != INFEASIBLE:
            status = FEASIBLE
    gap = None
    if est is not None and lower_bound_s is not None and status != INFEASIBLE:
        gap = relative_gap(est.recompute_s, lower_bound_s, status)
    solve_s = time.perf_counter() - started
    if schedule is not None:
        meta = schedule.meta
        if claimed is not None and status != INFEASIBLE:
            meta = {**meta, "space_optimal": space_optimal}
        schedule = replace(schedule, solver=solver, status=status, budget_bytes=budget_bytes,
                           gap=gap, solve_s=solve_s, meta=meta,
                           estimate=est.to_dict() if est is not None else None)
    return SolveResult(solver=solver, status=status, budget_bytes=budget_bytes,
                       schedule=schedule, estimate=est, solve_s=solve_s,
                       lower_bound_s=lower_bound_s, gap=gap,
                       min_feasible_bytes=min_feasible_bytes if status == INFEASIBLE else None,
                       space_optimal=space_optimal, space_bound_s=space_bound,
                       certifiable=claimed is not None and status != INFEASIBLE)


def reaches(recompute_s: float, bound_s: float) -> bool:
    """Whether a recompute time reaches a proven lower bound, so that it is optimal: within
    a millionth (the picosecond rounding of the bound's objective)."""
    return recompute_s - bound_s <= 1e-6 * recompute_s


def above(bound_s: float, recompute_s: float) -> bool:
    """Whether a bound lies above the recompute time of a schedule that fits (beyond float
    rounding): a bug in the bound."""
    return bound_s > recompute_s * (1 + 1e-9) + 1e-12


def relative_gap(recompute_s: float, bound_s: float, status: str) -> float:
    """The relative gap of a result to its bound (0 when OPTIMAL)."""
    if status == OPTIMAL:
        return 0.0
    return max(0.0, recompute_s - bound_s) / max(recompute_s, 1e-12)


#: `Static` of a graph -> cache name -> that cache (see `graph_cache`)
_CACHES: weakref.WeakKeyDictionary[Static, dict[str, dict[Any, Any]]] = \
    weakref.WeakKeyDictionary()


def graph_cache(graph: CostGraph, name: str) -> dict[Any, Any]:
    """A dict, called ``name``, for values computed from ``graph`` alone (`dp`'s region
    tables, `brute`'s simulated spaces). It lives beside the graph, not on it: keyed by the
    graph's `Static`, it goes when the graph goes, and starts empty when the graph's nodes,
    storages or events change (`Static.of` builds a new one then). Values must not hold the
    graph itself, which would keep it alive."""
    return _CACHES.setdefault(Static.of(graph), {}).setdefault(name, {})
