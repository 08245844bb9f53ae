"""The solver contract: one signature, one result type, a registry by name.

Every solver is a function ``(graph, budget_bytes, *, time_limit_s=None) -> SolveResult``.
Its result carries the `Schedule`, the `Estimate` that `simulate` gives for it (never the
solver's own arithmetic), and a status:

* ``OPTIMAL``: the least recompute time over the *full* schedule space (any region
  boundaries, keep or recompute, any save sets), proven: the solver proved it optimal over
  its own space and `bound.full_space_bound` shows that nothing outside it does better;
* ``FEASIBLE``: fits the budget, optimality over the full space not proven (``gap`` says how
  far it may be; ``space_optimal`` says whether it is proven optimal over the solver's own
  space, named in ``schedule.meta["space"]``);
* ``INFEASIBLE``: nothing the solver considers fits. A baseline still returns its schedule and
  estimate so the caller sees by how much it misses; an optimizing solver returns
  ``schedule=None`` and, when it proved infeasibility, ``min_feasible_bytes``
  (``None`` there means it ran out of time before finding anything).
"""

from __future__ import annotations

import re
import time
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Protocol

from ..cost.simulate import Estimate, simulate
from ..ir.graph import CostGraph
from ..ir.schedule import Schedule

__all__ = ["OPTIMAL", "FEASIBLE", "INFEASIBLE", "SolveResult", "Solver", "register",
           "get_solver", "available", "UnknownSolverError", "finish", "rebound", "reaches",
           "above"]

OPTIMAL = "OPTIMAL"
FEASIBLE = "FEASIBLE"
INFEASIBLE = "INFEASIBLE"


@dataclass(frozen=True)
class SolveResult:
    """What a solver returns. ``estimate == simulate(graph, schedule)`` whenever there is a
    schedule. ``lower_bound_s`` is a proven lower bound on the optimal recompute time over the
    full schedule space, where the solver has one; ``gap`` is ``(recompute_s - lower_bound_s)
    / max(recompute_s, tiny)``. ``space_optimal``: proven optimal over the solver's own space
    (``schedule.meta["space"]``); ``space_bound_s``: the solver's lower bound over that space
    (not a bound over the full space)."""

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

    @property
    def fits(self) -> bool:
        return self.estimate is not None and self.estimate.peak_bytes <= self.budget_bytes


class Solver(Protocol):
    def __call__(self, graph: CostGraph, budget_bytes: int, *,
                 time_limit_s: float | None = None) -> SolveResult: ...


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


def available() -> list[str]:
    """Registered solver names (parametric ones shown as ``name:K``)."""
    _load_all()
    return sorted(_REGISTRY) + sorted(f"{k}:K" for k in _PARAMETRIC)


def get_solver(name: str) -> Callable[..., SolveResult]:
    """The solver called ``name`` (``"dp"``, ``"cpsat"``, ``"uniform:4"``, ...).

    Raises:
        UnknownSolverError: listing the valid names.
    """
    _load_all()
    if name in _REGISTRY:
        return _REGISTRY[name]
    m = re.fullmatch(r"([a-z_]+):(.+)", name)
    if m and m.group(1) in _PARAMETRIC:
        return _PARAMETRIC[m.group(1)](m.group(2))
    raise UnknownSolverError(
        f"unknown solver {name!r}; valid solvers: {', '.join(available())}")


def finish(graph: CostGraph, budget_bytes: int, schedule: Schedule | None, *, solver: str,
           started: float, status: str | None = None, lower_bound_s: float | None = None,
           min_feasible_bytes: int | None = None, full_space: bool = False,
           deadline: float | None = None) -> SolveResult:
    """Build a `SolveResult`: simulate the schedule, decide FEASIBLE/INFEASIBLE from the
    simulated peak unless ``status`` is given, and stamp the schedule with the solver's name,
    status, gap and budget.

    An optimizing solver passes ``status`` (OPTIMAL when it proved the schedule optimal over
    its own space) and ``lower_bound_s`` (its bound over that space). Unless ``full_space``
    says that its space is the full one, both are kept as ``space_optimal`` and
    ``space_bound_s``, and the result's status and gap are decided against
    `bound.full_space_bound`: OPTIMAL only when the schedule's recompute time reaches that
    bound (within a millionth, the picosecond rounding of the bound's objective).
    ``deadline`` (a `time.perf_counter` value): the solver's time limit, which that bound's
    solve keeps to (`full_space_bound` gets at most `bound.BOUND_S`, and what is left of the
    limit; with none left and none remembered, the result has no bound).
    """
    est = simulate(graph, schedule) if schedule is not None else None
    claimed = status
    if status is None:
        status = FEASIBLE if est is not None and est.peak_bytes <= budget_bytes else INFEASIBLE
    if status != INFEASIBLE and (est is None or est.peak_bytes > budget_bytes):
        raise AssertionError(
            f"solver {solver!r} claimed {status} but its schedule's simulated peak "
            f"{None if est is None else est.peak_bytes} exceeds the budget {budget_bytes}")
    space_optimal = claimed == OPTIMAL
    space_bound = lower_bound_s
    if claimed is not None and status != INFEASIBLE and not full_space:
        from .bound import BoundWarning

        assert est is not None
        lower_bound_s = _full_bound(graph, budget_bytes, deadline)
        status = FEASIBLE
        if lower_bound_s is not None and above(lower_bound_s, est.recompute_s):
            warnings.warn(
                f"the full-space bound {lower_bound_s} s exceeds the recompute time "
                f"{est.recompute_s} s of {solver!r}'s schedule, which fits the budget "
                f"{budget_bytes}: the bound's relaxation is wrong for graph {graph.name!r}; "
                "the result carries no bound. Please report it with the graph's JSON",
                BoundWarning, stacklevel=2)
            lower_bound_s = None
        elif lower_bound_s is not None and reaches(est.recompute_s, lower_bound_s):
            status = OPTIMAL
    gap = None
    if est is not None and lower_bound_s is not None and status != INFEASIBLE:
        gap = _gap(est.recompute_s, lower_bound_s, status)
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
                       space_optimal=space_optimal and status != INFEASIBLE,
                       space_bound_s=space_bound)


#: `finish` does not start a bound's solve with less time than this left before its deadline
MIN_BOUND_S = 0.05


def _full_bound(graph: CostGraph, budget_bytes: int, deadline: float | None) -> float | None:
    """`bound.full_space_bound`, within ``deadline`` when there is one (None: no time left and
    none remembered)."""
    from .bound import BOUND_S, full_space_bound, remembered_bound

    if deadline is None:
        return full_space_bound(graph, budget_bytes)
    left = min(BOUND_S, deadline - time.perf_counter())
    if left < MIN_BOUND_S:
        return remembered_bound(graph, budget_bytes)
    return full_space_bound(graph, budget_bytes, time_limit_s=left)


def reaches(recompute_s: float, bound_s: float) -> bool:
    """Whether a recompute time reaches a proven lower bound, so that it is optimal: within
    a millionth (the picosecond rounding of the bound's objective)."""
    return recompute_s - bound_s <= 1e-6 * recompute_s


def above(bound_s: float, recompute_s: float) -> bool:
    """Whether a bound lies above the recompute time of a schedule that fits (beyond float
    rounding): a bug in the bound."""
    return bound_s > recompute_s * (1 + 1e-9) + 1e-12


def _gap(recompute_s: float, bound_s: float, status: str) -> float:
    """The relative gap of a result to its bound (0 when OPTIMAL)."""
    if status == OPTIMAL:
        return 0.0
    return max(0.0, recompute_s - bound_s) / max(recompute_s, 1e-12)


def rebound(graph: CostGraph, result: SolveResult) -> SolveResult:
    """``result`` judged against the best full-space bound remembered for its graph and budget,
    when that is better than the one it was finished with (found later, by `relax`): its
    lower bound, gap and status (OPTIMAL when the bound reaches its recompute time), in the
    result and in its schedule's stamp. Results without a bound (baselines) are left as they
    are."""
    from .bound import remembered_bound

    if result.estimate is None or result.schedule is None or result.lower_bound_s is None:
        return result
    bound = remembered_bound(graph, result.budget_bytes)
    t = result.estimate.recompute_s
    if bound is None or bound <= result.lower_bound_s or above(bound, t):
        return result  # (one above it is `finish`'s to report, as a BoundWarning)
    status = OPTIMAL if reaches(t, bound) else FEASIBLE
    gap = _gap(t, bound, status)
    return replace(result, status=status, lower_bound_s=bound, gap=gap,
                   schedule=replace(result.schedule, status=status, gap=gap))


def _load_all() -> None:
    """Import every solver family: importing one registers its solvers."""
    import importlib

    for family in ("heuristics", "dp", "cpsat", "relax", "auto", "brute"):
        importlib.import_module(f"{__package__}.{family}")
