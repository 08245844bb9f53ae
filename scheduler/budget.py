"""Budgets: the forms users write them in, and the error for one that nothing fits."""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

from .ir.graph import CostGraph
from .solvers.base import SolveResult, get_solver
from .solvers.bound import full_space_bound
from .quantities import format_bytes, parse_bytes

__all__ = ["BUDGET_FORMS", "PERCENT_HINT_MAX", "InfeasibleBudgetError", "budget_spec",
           "infeasible_error", "parse_budget", "percent_hint"]

#: The budget forms `parse_budget` accepts, for error messages.
BUDGET_FORMS = (
    "a number of bytes (an integer such as 6442450944 or '6442450944', or a string with a "
    "unit: '6GiB', '512MB', '1.5e9'), or a fraction of the unconstrained predicted peak (a "
    "decimal in (0, 1] such as 0.6 or '0.6', or a percentage string such as '60%')"
)

#: A unitless integer budget up to this many bytes is surely meant as a percentage: the
#: infeasible error asks "did you mean N%?".
PERCENT_HINT_MAX = 100

_INTEGER = re.compile(r"\s*\+?[0-9]+\s*")

#: Baselines whose schedules bound the smallest feasible budget when a solver does not say it.
_BASELINES = ("none", "every_block", "sqrt", "greedy", "knapsack")


class InfeasibleBudgetError(ValueError):
    """No schedule the solver considers fits the budget.

    Attributes:
        budget_bytes: the budget asked for, in bytes.
        min_feasible_bytes: the smallest budget known to be feasible (in the caller's terms,
            before headroom): with ``auto``, the floor's (`solvers.floor.Floor.named_bytes`),
            which solves when asked for, in a new process too where the message says so
            (found by the floor's deterministic offers); with another exact solver, the
            least peak over its space; with a baseline, the least predicted peak of any
            baseline.
        floor: with ``auto``, the `Floor` (its schedule, proven lower bound, status, space);
            else None.
        lower_bound_bytes: with ``auto``, the floor's proven lower bound (before headroom):
            no schedule of ``floor.space`` fits below it; else None.
        status: with ``auto``, the floor's status: ``OPTIMAL`` (``min_feasible_bytes`` is
            the least that fits, proven) or ``FEASIBLE`` (between the two: unknown); else None.
    """

    def __init__(self, message: str, *, budget_bytes: int, min_feasible_bytes: int,
                 floor: Any = None, lower_bound_bytes: int | None = None,
                 status: str | None = None) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        self.floor = floor
        self.lower_bound_bytes = lower_bound_bytes
        self.status = status


def parse_budget(budget: int | float | str, unconstrained_peak_bytes: int) -> int:
    """A memory budget in bytes, from any of the forms users write.

    Args:
        budget: bytes or a fraction of ``unconstrained_peak_bytes``, the same in the API and
            on the CLI (whose ``--budget`` text is read as the string):

            * an integer is bytes: ``1024`` or ``"1024"``, so ``1`` and ``"1"`` are one byte
              (an infeasible budget of at most `PERCENT_HINT_MAX` bytes given so is answered
              with "did you mean 1%?");
            * a decimal in (0, 1] is a fraction: ``0.6``, ``"0.6"``, ``1.0``, ``"1.0"``
              (100%); a decimal above 1 is bytes, rounded (``1.5e9``, ``"1.5e9"``);
            * a percentage string is a fraction: ``"60%"``, in (0%, 100%];
            * a string with a unit is bytes: ``"6GiB"``, ``"512MB"``, see `units.parse_bytes`
              (a bare ``"6G"`` is refused as ambiguous between GB and GiB).
        unconstrained_peak_bytes: the predicted peak with no checkpointing, which fractions
            refer to.

    Returns:
        The budget in bytes (fractions rounded down), at least 1.

    Raises:
        ValueError: zero, negative, NaN or infinite values, fractions above 100%, garbage;
            the message names the value and the accepted forms.

    Example:
        >>> parse_budget("50%", 1000), parse_budget(0.25, 1000), parse_budget("1KiB", 1000)
        (500, 250, 1024)
    """
    kind, value = budget_spec(budget)
    if kind == "bytes":
        return int(value)
    n = int(value * unconstrained_peak_bytes)
    if n < 1:
        raise ValueError(f"bad budget {budget!r}: {value:g} of the unconstrained peak "
                         f"({unconstrained_peak_bytes} bytes) is less than one byte")
    return n


def budget_spec(budget: Any) -> tuple[str, float | int]:
    """``("bytes", n)`` or ``("fraction", f)``; checks the form without needing a graph, so
    callers can reject a bad budget before minutes of profiling."""
    def bad(why: str = "") -> ValueError:
        return ValueError(f"bad budget {budget!r}{': ' + why if why else ''}; expected "
                          f"{BUDGET_FORMS}")

    if isinstance(budget, bool):
        raise bad("a bool is not a budget")
    if isinstance(budget, numbers.Integral):
        if budget < 1:
            raise bad("it must be positive")
        return "bytes", int(budget)
    if isinstance(budget, numbers.Real):
        value = float(budget)
        if not math.isfinite(value) or value <= 0:
            raise bad("it must be a positive finite number")
        return ("fraction", value) if value <= 1 else ("bytes", round(value))
    if not isinstance(budget, str):
        raise bad(f"a {type(budget).__name__} is not a budget")
    text = budget.strip()
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            raise bad() from None
        if not (math.isfinite(pct) and 0 < pct <= 100):
            raise bad("a percentage must be in (0%, 100%]")
        return "fraction", pct / 100
    try:
        value = float(text)
    except ValueError:
        value = None  # a unit, or garbage: parse_bytes decides
    if value is not None:
        if not math.isfinite(value) or value <= 0:
            raise bad("it must be a positive finite number")
        if value <= 1 and not _INTEGER.fullmatch(text):  # "1" is a byte, like the int 1
            return "fraction", value
    try:
        return "bytes", parse_bytes(text)
    except ValueError as e:
        why = str(e)
        # parse_bytes's own reason (e.g. "'G' is ambiguous: write 'GB' ... or 'GiB'"), if any
        raise bad(why[why.index(": ") + 2:why.rindex("; expected")]
                  if "; expected" in why and ": " in why else "") from None


def percent_hint(budget: Any, budget_bytes: int) -> str:
    """``"; did you mean 50%? ..."`` where ``budget`` is a unitless integer (``50``,
    ``"50"``) of at most `PERCENT_HINT_MAX` bytes, which is surely meant as a percentage;
    else ``""``."""
    unitless = (isinstance(budget, numbers.Integral) and not isinstance(budget, bool)) or (
        isinstance(budget, str) and _INTEGER.fullmatch(budget) is not None)
    if not unitless or not 1 <= budget_bytes <= PERCENT_HINT_MAX:
        return ""
    return (f"; did you mean {budget_bytes}%? A bare integer is bytes: write "
            f"'{budget_bytes}%' for a percentage of the unconstrained peak")


def infeasible_error(graph: CostGraph, solver: str, result: SolveResult, budget_bytes: int,
                     headroom: float, budget: Any = None) -> InfeasibleBudgetError:
    """The error for an INFEASIBLE result, naming the smallest budget known to fit; with
    ``budget``, the budget as the user wrote it, it adds `percent_hint`'s question."""
    if result.floor is not None:
        return _floor_error(result.floor, solver, budget_bytes, headroom, budget,
                            _autocast_hint(graph))
    if result.min_feasible_bytes is not None:
        # the exact solvers (dp, cpsat) give the exact minimum over their schedule space
        min_peak, by, exact = result.min_feasible_bytes, solver, True
    else:
        # otherwise the least predicted peak of every schedule at hand bounds it from above
        peaks = {name: get_solver(name)(graph, result.budget_bytes).estimate.peak_bytes
                 for name in _BASELINES}
        if result.estimate is not None:
            peaks[solver] = result.estimate.peak_bytes
        by = min(peaks, key=lambda name: (peaks[name], name != solver))
        min_peak, exact = peaks[by], False
    # in the user's terms: the budget that leaves min_peak after the headroom
    need = _before_headroom(min_peak, headroom)
    asked = f"{format_bytes(budget_bytes)} ({budget_bytes} bytes)"
    smallest = f"{format_bytes(need)} ({need} bytes)"
    if need <= budget_bytes:
        message = (f"solver {solver!r} found no schedule within the budget {asked}, but the "
                   f"{by!r} baseline's fits it (predicted peak {format_bytes(min_peak)}); "
                   f"use solver={by!r} or an exact solver ('auto')")
    elif exact:
        if full_space_bound(graph, result.budget_bytes) == math.inf:
            why = "is infeasible: no schedule of the full space fits it (proven)"
        else:
            why = (f"is infeasible over the schedule space of solver {solver!r} (a schedule "
                   "outside it might fit a smaller budget)")
        message = (f"budget {asked} {why}; the smallest feasible budget over the space of "
                   f"solver {solver!r} is "
                   f"{smallest}; use budget={need} or more")
    else:
        message = (f"budget {asked} is infeasible for solver {solver!r}: the smallest budget "
                   f"any schedule tried fits is {smallest} ({by!r}); use budget={need} or more, "
                   "or an exact solver ('auto'), which finds the true minimum")
    message += _autocast_hint(graph)
    return InfeasibleBudgetError(_in_terms(message, headroom, budget, budget_bytes),
                                 budget_bytes=budget_bytes, min_feasible_bytes=need)


def _in_terms(message: str, headroom: float, budget: Any, budget_bytes: int) -> str:
    """``message`` with the headroom it was computed with and `percent_hint`'s question."""
    if headroom:
        message += f" (with headroom {headroom:.0%})"
    return message + percent_hint(budget, budget_bytes)


def _before_headroom(peak: int, headroom: float) -> int:
    """The least budget that leaves ``peak`` after ``headroom`` (as `solve_graph` applies
    it: ``int(budget * (1 - headroom))``)."""
    need = math.ceil(peak / (1 - headroom))
    while int(need * (1 - headroom)) < peak:  # float rounding
        need += 1
    while need > 1 and int((need - 1) * (1 - headroom)) >= peak:
        need -= 1
    return need


def _autocast_hint(graph: CostGraph) -> str:
    """Under autocast with its cache on, what the cache holds that no schedule frees (the
    casts the model's own code makes outside the plan's units: the plan's own code runs with
    the cache off), and the way out (`capture.autocast_cache`)."""
    cached = graph.meta.get("autocast_cache", {}).get("bytes", 0)
    if not cached:
        return ""
    return (f". Of every peak, {format_bytes(cached)} are the casts of parameters that "
            f"the model's own code between the units makes and torch.autocast's cache holds "
            f"all step, which no checkpoint frees: profile and "
            f"train under torch.autocast(..., cache_enabled=False) so that they live only "
            f"while they are used (each use of a weight then casts it anew)")


def _floor_error(floor: Any, solver: str, budget_bytes: int, headroom: float,
                 budget: Any, extra: str = "") -> InfeasibleBudgetError:
    """The error naming a `Floor`: proven (OPTIMAL), or a schedule that fits above a proven
    bound with the gap between them unknown."""
    need = _before_headroom(floor.named_bytes, headroom)
    low = _before_headroom(floor.lower_bound_bytes, headroom)
    found = _before_headroom(floor.bytes, headroom)
    message = (f"budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is infeasible for "
               f"solver {solver!r}: {floor.describe(need, low)}; use budget={need} or more "
               f"({floor.promise(need, found)})") + extra
    return InfeasibleBudgetError(_in_terms(message, headroom, budget, budget_bytes),
                                 budget_bytes=budget_bytes, min_feasible_bytes=need,
                                 floor=floor, lower_bound_bytes=low, status=floor.status)
