"""``compare``: the solved schedule beside the heuristics, predicted and measured, in one run.

The model is traced and profiled once; every strategy is solved on that one `CostGraph` for
every budget; each distinct schedule is rewritten and measured once (a schedule that does not
depend on the budget, such as ``every_block``, is measured once for all budgets), all in the
same process, in rounds of one timed step per schedule, so that the timings are comparable
(load from elsewhere slows every schedule alike). The unscheduled step (``none``) is always
measured too: it is the reference for measured overheads.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from .. import report
from ..budget import budget_spec, infeasible_error, parse_budget
from ..capture.calls import call_inputs
from ..capture.profile import check_profile_options
from ..cost.simulate import simulate
from ..files import check_destination, write_atomic
from ..ir.graph import CostGraph
from ..ir.schedule import Schedule
from ..measurement.step import (
    Measurement,
    OverBudgetWarning,
    check_measurable,
    measure_in_turns,
    warn_if_over_budget,
)
from ..plan import solve_graph
from ..solvers.auto import BASELINES
from ..solvers.base import INFEASIBLE, SolveResult, get_solver
from ..solvers.certify import solve_and_certify
from ..quantities import check_time_limit
from ..distributed import process_group
from ..parallel import parse_parallel
from ..units import profile_units
from ..units.step import planned_module

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure
    from rich.table import Table

__all__ = ["Comparison", "Row", "STRATEGIES", "compare"]

#: the default strategies: the solved one and every baseline
STRATEGIES: tuple[str, ...] = ("auto", "none", *BASELINES)


@dataclass(frozen=True)
class Row:
    """One strategy at one budget.

    Attributes:
        strategy: the solver name asked for (``"auto"``, ``"greedy"``, ``"uniform:4"``).
        budget: the budget as given (``"50%"``, ``"6GiB"``, ``"0.5"``).
        budget_bytes: the budget in bytes.
        solver: the solver that produced the schedule (``auto`` names its pick, e.g. ``"dp"``).
        status: ``OPTIMAL``, ``FEASIBLE`` or ``INFEASIBLE`` (predicted peak over the budget, or
            no schedule at all).
        fits_predicted: the predicted peak is within the budget.
        fits_measured: the measured peak is within the budget (None: not measured).
        predicted_peak_bytes, predicted_step_s, predicted_overhead: `simulate`'s estimate
            (None when the solver returned no schedule); the overhead is recompute time over
            the profiled unscheduled step.
        measured_peak_bytes, measured_step_s, measured_overhead: `measure` of the rewritten
            module; the overhead is its step time over the unscheduled step measured in the
            same run, minus one.
        recomputed_regions: recompute regions in the schedule.
        gap: the solver's proven gap to the full schedule space's lower bound, where it has one.
        solve_s: seconds the solver ran.
        schedule: the `Schedule` (not exported to JSON/CSV).
    """

    strategy: str
    budget: str
    budget_bytes: int
    solver: str
    status: str
    fits_predicted: bool
    fits_measured: bool | None
    predicted_peak_bytes: int | None
    measured_peak_bytes: int | None
    predicted_step_s: float | None
    measured_step_s: float | None
    predicted_overhead: float | None
    measured_overhead: float | None
    recomputed_regions: int | None
    gap: float | None
    solve_s: float
    schedule: Schedule | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The row's fields except the schedule."""
        d = asdict(self)
        d.pop("schedule")
        return d


#: exported columns, in order
FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Row) if f.name != "schedule")


@dataclass(eq=False)
class Comparison:
    """What `compare` returns: a `Row` per (budget, strategy), budgets in the order given.

    Attributes:
        rows: the rows.
        model: the model's class name.
        device: where it was profiled and measured.
        unconstrained_peak_bytes: the predicted unscheduled peak, which fractions refer to.
        reference: the unscheduled step measured in this run (None when not measuring).
        graph: the profiled `CostGraph`.
    """

    rows: list[Row]
    model: str
    device: str
    unconstrained_peak_bytes: int
    reference: Measurement | None
    graph: CostGraph = field(repr=False)

    def row(self, strategy: str, budget: Any) -> Row:
        """The row of ``strategy`` at ``budget`` (as given, or its ``str``).

        Raises:
            KeyError: naming the strategies and budgets there are.
        """
        for r in self.rows:
            if r.strategy == strategy and r.budget == str(budget):
                return r
        raise KeyError(f"no row for strategy {strategy!r} at budget {budget!r}; strategies: "
                       f"{sorted({r.strategy for r in self.rows})}, budgets: "
                       f"{list(dict.fromkeys(r.budget for r in self.rows))}")

    def table(self) -> "Table":
        """A rich ``Table`` of the rows (print it with ``rich.print`` or ``str(comparison)``)."""
        return report.comparison_table(self)

    def __str__(self) -> str:
        return report.render(self.table())

    def to_markdown(self) -> str:
        """The table as GitHub markdown."""
        return report.comparison_markdown(self)

    def to_dict(self) -> dict[str, Any]:
        """Everything but the graph and schedules, as JSON-ready values."""
        ref = self.reference
        return {"model": self.model, "device": self.device,
                "unconstrained_peak_bytes": self.unconstrained_peak_bytes,
                "reference": None if ref is None else {
                    "measured_peak_bytes": ref.peak_bytes, "measured_step_s": ref.step_s},
                "rows": [r.to_dict() for r in self.rows]}

    def to_json(self, path: str | Path | None = None) -> str:
        """The comparison as JSON text (`to_dict`); also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if path is not None:
            write_atomic(check_destination(path, "json"), text)
        return text

    def to_csv(self, path: str | Path | None = None) -> str:
        """The rows as CSV text (columns `FIELDS`, empty cells for None); also written to
        ``path`` when given."""
        text = report.rows_to_csv([r.to_dict() for r in self.rows], FIELDS)
        if path is not None:
            write_atomic(check_destination(path, "csv"), text)
        return text

    def plot(self, path: str | Path | None = None) -> "Figure":
        """Overhead against peak memory per strategy, see `report.plot_comparison`; writes a
        PNG to ``path`` when given and returns the matplotlib ``Figure``."""
        return report.plot_comparison(self, path)


def compare(model: nn.Module, example_inputs: Sequence[Any] | Mapping[str, Any], *,
            budgets: Sequence[int | float | str] | int | float | str,
            strategies: Sequence[str] | None = None, measure: bool = True,
            loss_fn: Callable[[Any], torch.Tensor] | None = None,
            time_limit_s: float | None = 30.0, repeats: int = 3,
            progress: bool = True, units: Any = "default", mode: str = "auto",
            times: str | None = None, device: Any = None,
            device_spec: Any = None, parallel: Any = None) -> Comparison:
    """Solve, rewrite and measure every strategy at every budget, in one run.

    Args:
        model: the model (not modified; the rewritten modules share its parameters).
        example_inputs: positional inputs with the shapes to plan for, or a mapping of
            keyword inputs (a Hugging Face-style batch), bound to the model's ``forward``.
        budgets: one budget or several, each as `parse_budget` reads it (``"50%"``, ``0.3``,
            ``"6GiB"``); fractions refer to the unscheduled predicted peak.
        strategies: solver names; default `STRATEGIES` (``auto`` and every baseline).
        measure: run and measure each schedule (False: predictions only, much faster).
        loss_fn: ``loss_fn(output) -> scalar``; default `trace.default_loss_recipe`.
        time_limit_s: each solver's time limit.
        repeats: timed steps when profiling, and rounds of measurement (one timed step of
            every schedule per round; the median is kept).
        progress: show a progress bar on stderr.
        units: the units the plans take over, as `scheduler.solve` takes them (default: a
            Hugging Face model's layers, else one graph of the whole step); every strategy is
            solved on that step, its regions inside the units' calls.
        mode, times, device, device_spec: how the step is profiled, as `scheduler.solve`
            does: ``mode="fake"`` (or ``"auto"`` for a step that does not fit the device)
            ranks the strategies of a model that cannot run, with ``measure=False``.
        parallel: rank the strategies for one rank of DDP or FSDP2 (``"ddp"``,
            ``"fsdp2:8"``: see `scheduler.solve`), by prediction (``measure=False``: a rank's
            step runs under its wrapper, not here).

    Returns:
        A `Comparison`. A strategy whose schedule misses a budget is a row with
        ``fits_predicted=False`` (measured all the same when it has a schedule), not an error.

    Warns:
        OverBudgetWarning: a row whose schedule was predicted to fit measured over its
            budget (a bug: the warning names budget, predicted and measured peaks).

    Raises:
        InfeasibleBudgetError: no schedule at all fits a budget (``auto`` proves it); the
            message names the smallest feasible budget.
        UnknownSolverError: an unknown strategy (the message lists the valid names).
        ValueError: a bad budget (checked before profiling), no budgets, or no strategies;
            ``measure=True`` for a step profiled under fake tensors (it cannot run).

    Example:
        >>> c = scheduler.compare(model, (x,), budgets=["50%", "30%"])  # doctest: +SKIP
        >>> print(c); c.plot("compare.png"); c.to_json("compare.json")  # doctest: +SKIP
    """
    budgets = [budgets] if isinstance(budgets, (str, int, float)) else list(budgets)
    if not budgets:
        raise ValueError("compare needs at least one budget, e.g. budgets=['50%']")
    for b in budgets:
        budget_spec(b)  # fail now, not after profiling
    check_time_limit(time_limit_s)
    strategies = list(dict.fromkeys(STRATEGIES if strategies is None else strategies))
    if not strategies:
        raise ValueError(f"compare needs at least one strategy, e.g. {list(STRATEGIES)}")
    for s in strategies:
        get_solver(s)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    check_profile_options(mode, times, device_spec)
    if parse_parallel(parallel, *process_group()) is not None and measure:
        raise ValueError(f"compare(parallel={parallel!r}) predicts one rank's step, which runs "
                         "under DDP or fully_shard across processes, not here: pass "
                         "measure=False (the CLI: --no-measure)")
    if measure:
        check_measurable(model, call_inputs(model, example_inputs))
    if measure and mode == "fake":
        raise ValueError("compare(measure=True) runs every schedule, but mode='fake' profiles "
                         "a step that is not run: pass measure=False (--no-measure) to rank "
                         "the strategies by prediction, or mode='real'")
    n_solves = len(budgets) * len(strategies)

    with report.progress_bar(enabled=progress, total=1 + n_solves,
                             description="tracing") as step:
        gm, graph, inputs, choice = profile_units(
            model, example_inputs, units, loss_fn=loss_fn, repeats=repeats,
            name=type(model).__name__, progress=lambda msg: step(f"profiling: {msg}"),
            mode=mode, times=times, device=device, device_spec=device_spec,
            parallel=parallel)
        how = graph.meta.get("profile", {})
        if measure and how.get("mode") == "fake":
            raise ValueError(f"compare(measure=True) runs every schedule, but the step was "
                             f"profiled under fake tensors ({how.get('why', '')}): pass "
                             "measure=False (--no-measure) to rank the strategies by "
                             "prediction")
        step(advance=1)
        unconstrained = simulate(graph, Schedule.none(graph)).peak_bytes
        solved: list[tuple[str, int, str, SolveResult]] = []
        for budget in budgets:
            budget_bytes = parse_budget(budget, unconstrained)
            results = {}
            for s in strategies:
                step(f"solving {s} at {budget}")
                results[s] = solve_and_certify(graph, budget_bytes, s,
                                               time_limit_s=time_limit_s)
                step(advance=1)
            _check_feasible(graph, budget, budget_bytes, results, time_limit_s)
            solved += [(str(budget), budget_bytes, s, r) for s, r in results.items()]

        measured: dict[Any, Measurement] = {}
        reference = None
        if measure:
            distinct = {_key(r.schedule): r.schedule for *_, r in solved if r.schedule}
            none = Schedule.none(graph)
            todo = {_key(none): none, **distinct}  # the reference first
            step(total=1 + n_solves + repeats * len(todo))
            with warnings.catch_warnings():  # (said below, once per row that claimed to fit)
                warnings.simplefilter("ignore", OverBudgetWarning)
                measured = measure_in_turns(
                    {key: (planned_module(gm, graph, schedule, model, inputs, why=choice.why), inputs)
                     for key, schedule in todo.items()}, repeats=repeats, step=step)
            reference = measured[_key(none)]

    rows = [_row(s, budget, budget_bytes, r,
                 measured.get(_key(r.schedule)) if r.schedule else None, reference)
            for budget, budget_bytes, s, r in solved]
    for row in rows:  # a plan that claimed to fit and measured over: a bug, said loudly
        if row.schedule is not None and row.measured_peak_bytes is not None:
            m = measured.get(_key(row.schedule))
            warn_if_over_budget(row.schedule, row.measured_peak_bytes, row.budget_bytes,
                                stacklevel=2,
                                allocator_peak_bytes=m.allocator_peak_bytes if m else None)
    return Comparison(rows=rows, model=type(model).__name__,
                      device=str(graph.meta.get("device", "cpu")),
                      unconstrained_peak_bytes=unconstrained, reference=reference, graph=graph)


def _key(schedule: Schedule | None) -> Any:
    """What makes two schedules run the same (not who made them or for which budget)."""
    return None if schedule is None else tuple((r.policy, r.nodes, r.save, r.inner)
                                               for r in schedule.regions)


def _check_feasible(graph: CostGraph, budget: Any, budget_bytes: int,
                    results: dict[str, SolveResult], time_limit_s: float | None) -> None:
    """Raise `InfeasibleBudgetError` when no schedule at all fits the budget: then there is
    nothing to compare. A budget that only the asked-for strategies miss is kept (rows with
    fits False)."""
    if any(r.status != INFEASIBLE for r in results.values()):
        return
    if "auto" in results:
        raise infeasible_error(graph, "auto", results["auto"], budget_bytes, 0.0, budget)
    solve_graph(graph, budget, solver="auto", time_limit_s=time_limit_s)  # raises if so


def _row(strategy: str, budget: str, budget_bytes: int, r: SolveResult,
         m: Measurement | None, reference: Measurement | None) -> Row:
    e = r.estimate
    return Row(
        strategy=strategy, budget=budget, budget_bytes=budget_bytes, solver=r.solver,
        status=r.status, fits_predicted=r.status != INFEASIBLE,
        fits_measured=None if m is None else m.peak_bytes <= budget_bytes,
        predicted_peak_bytes=None if e is None else e.peak_bytes,
        measured_peak_bytes=None if m is None else m.peak_bytes,
        predicted_step_s=None if e is None else e.step_s,
        measured_step_s=None if m is None else m.step_s,
        predicted_overhead=None if e is None else e.overhead,
        measured_overhead=(None if m is None or reference is None
                           else m.step_s / reference.step_s - 1),
        recomputed_regions=None if r.schedule is None else len(r.schedule.recompute_regions),
        gap=r.gap, solve_s=r.solve_s, schedule=r.schedule)
