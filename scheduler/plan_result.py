"""`Plan`: what `scheduler.solve` returns, the checkpointed module and what explains it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch.nn as nn

from .cost.estimate import Estimate
from .ir.graph import CostGraph
from .ir.schedule import Schedule
from .measurement.step import measure
from .quantities import format_bytes, format_seconds
from .report import plot_timeline
from .solvers.base import SolveResult
from .units import UnitChoice

__all__ = ["Plan"]


@dataclass(eq=False, repr=False)
class Plan:
    """What `solve` returns: the checkpointed module and everything that explains it.

    Attributes:
        module: the drop-in checkpointed model (shares the original's parameters).
        schedule: the `Schedule` it runs (with solver, status, budget and estimate stamped).
        estimate: `simulate`'s prediction for the schedule.
        status: ``OPTIMAL`` (proven optimal over the full schedule space) or ``FEASIBLE``
            (``result.space_optimal`` says whether it is proven optimal over the solver's
            own space, ``schedule.meta["space"]``).
        gap: proven relative gap to the full space's lower bound, or None where the solver
            has no bound (the baselines).
        solve_s: seconds the solve phase took (``phases_s["solve"]``: what `solve`'s
            ``time_limit_s`` holds).
        graph: the profiled `CostGraph`.
        result: the solver's full `SolveResult`.
        budget_bytes: the budget asked for, in bytes (``result.budget_bytes`` is what the
            solver got, after any headroom).
        unconstrained_peak_bytes: the predicted peak without checkpointing.
        own_peak_bytes: for a model that calls ``torch.utils.checkpoint`` itself (which the
            plan replaces), the measured peak of its own step with that checkpointing; else
            None.
        units: the submodules the plan takes over and why (`units.UnitChoice`; no paths:
            the whole step is one traced graph).
        compiled_peak_bytes: for a plan solved for compiled execution and measured
            (``measure_compiled``), the peak of ``torch.compile(module)``'s step; else None.
        phases_s: seconds of each phase of `solve`: ``"profile"`` (tracing and profiling
            the step), ``"solve"`` (every solve to the schedule, within ``time_limit_s``),
            ``"variants"`` (with units: the step's call variants profiled and solved, each
            solve within ``time_limit_s``: `units.variants`) and ``"apply"`` (the rest:
            checking the model's own checkpointing, building ``module``, tracing its units,
            and with ``measure_compiled`` the compiled fit).
    """

    module: nn.Module
    schedule: Schedule
    estimate: Estimate
    status: str
    gap: float | None
    solve_s: float
    graph: CostGraph
    result: SolveResult
    budget_bytes: int
    unconstrained_peak_bytes: int = field(default=0)
    own_peak_bytes: int | None = None
    units: UnitChoice = field(default=UnitChoice((), ""))
    compiled_peak_bytes: int | None = None
    phases_s: dict[str, float] = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        """Write the schedule as JSON, to re-apply later with `scheduler.apply`."""
        self.schedule.save(path)

    def plot_timeline(self, path: str | Path | None = None, *, title: str = "",
                      inputs: Sequence[Any] | None = None) -> Any:
        """Plot the predicted live memory over one training step (forward, recompute bursts,
        backward) against the budget, see `report.plot_timeline`; with ``inputs``, also the
        memory measured over one real step of ``plan.module`` (CPU only: live-storage
        tracking; on CUDA only the prediction is drawn).

        Args:
            path: where to write the PNG; None to only build the figure.
            title: the axes title (default: the solver, status and overhead).
            inputs: example inputs to run one measured step with.

        Returns:
            The matplotlib ``Figure``.
        """
        e = self.estimate
        title = title or (f"{self.result.solver} ({self.status}): memory over one step, "
                          f"recompute {format_seconds(e.recompute_s)} (+{e.overhead:.1%})")
        measured: tuple[int, ...] = ()
        split = 0
        if inputs is not None:
            m = measure(self.module, inputs, repeats=1, warmup=0, timeline=True)
            measured, split = m.timeline, m.timeline_backward_at
        return plot_timeline(e, path, budget_bytes=self.budget_bytes, title=title,
                             measured=measured, measured_backward_at=split)

    def summary(self) -> str:
        """A few lines: status, budget, predicted peak, recompute time, regions."""
        e = self.estimate
        gap = "n/a" if self.gap is None else f"{self.gap:.1%}"
        unconstrained = (f" (unscheduled {format_bytes(self.unconstrained_peak_bytes)})"
                         if self.unconstrained_peak_bytes else "")
        rc = len(self.schedule.recompute_regions)
        space = self.schedule.meta.get("space")
        if self.status == "OPTIMAL":
            over = " over the full schedule space"
        elif space and self.schedule.meta.get("space_optimal"):
            over = f" (optimal over {space})"
        else:
            over = ""
        return "\n".join([
            f"{self.result.solver}: {self.status}{over}, gap {gap}, solved in "
            f"{format_seconds(self.solve_s)}",
            f"  budget          {format_bytes(self.budget_bytes)}",
            f"  predicted peak  {format_bytes(e.peak_bytes)}{unconstrained}",
            *([f"  your model      {format_bytes(self.own_peak_bytes)} measured, with its own "
               f"checkpointing"] if self.own_peak_bytes is not None else []),
            f"  recompute       {format_seconds(e.recompute_s)} "
            f"(+{e.overhead:.1%} of the step, {format_seconds(e.step_s)} in all)",
            f"  regions         {len(self.schedule.regions)} ({rc} recomputed)",
            "  runs            " + (f"inside the model's own forward, in its units: "
                                    f"{self.units.why}" if self.units.paths else
                                    "one traced graph of the whole step"
                                    + (f" ({self.units.why})" if self.units.why else "")),
            *([f"  time model      {self.schedule.meta['execution']} (what a replay costs "
               f"under torch.compile" + ("; the peak is the eager step's)"
                                         if self.compiled_peak_bytes is None else ")")]
              if self.schedule.meta.get("execution", "eager") != "eager" else []),
            *([f"  compiled peak   {format_bytes(self.compiled_peak_bytes)} measured "
               f"(torch.compile, inductor)"] if self.compiled_peak_bytes is not None else []),
        ])

    def __repr__(self) -> str:
        peak = (f"compiled peak {format_bytes(self.compiled_peak_bytes)}"
                if self.compiled_peak_bytes is not None
                else f"peak {format_bytes(self.estimate.peak_bytes)}")
        return (f"Plan({self.result.solver} {self.status}: {peak} <= budget "
                f"{format_bytes(self.budget_bytes)}, recompute "
                f"{format_seconds(self.estimate.recompute_s)} (+{self.estimate.overhead:.1%}), "
                f"{len(self.schedule.recompute_regions)}/{len(self.schedule.regions)} regions "
                "recomputed)")
