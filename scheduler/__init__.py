"""scheduler: optimal activation-checkpointing schedules for PyTorch models.

The names below are imported on first use (PEP 562 ``__getattr__``): every submodule
imports this package first, and the command line (``scheduler --help``) must not pay for
importing torch.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .budget import InfeasibleBudgetError, parse_budget
    from .capture.fake import FakeProfileError, RejectedInputsError
    from .capture.roofline import DeviceSpec
    from .capture.trace import TraceError, trace
    from .cost.estimate import Estimate
    from .cost.simulate import simulate
    from .ir.graph import CostGraph, CostGraphError
    from .ir.schedule import Region, Schedule, ScheduleError
    from .measurement.breakdown import StepBreakdown, measure_training_step
    from .measurement.step import Measurement, measure
    from .plan import Plan, apply, profile, solve, solve_graph
    from .rewrite import PlanFallbackError, PlanForward, planned
    from .workflows.advice import Advice
    from .workflows.advise import advise
    from .workflows.compare import Comparison, compare
    from .workflows.floor import Floor, floor
    from .workflows.max_batch import MaxBatch, max_batch

# The module each exported name comes from (the same as the imports above).
_SOURCES = {
    ".budget": ("InfeasibleBudgetError", "parse_budget"),
    ".capture.fake": ("FakeProfileError", "RejectedInputsError"),
    ".capture.roofline": ("DeviceSpec",),
    ".capture.trace": ("TraceError", "trace"),
    ".cost.estimate": ("Estimate",),
    ".cost.simulate": ("simulate",),
    ".ir.graph": ("CostGraph", "CostGraphError"),
    ".ir.region": ("Region", "ScheduleError"),
    ".ir.schedule": ("Schedule",),
    ".measurement.breakdown": ("StepBreakdown", "measure_training_step"),
    ".measurement.step": ("Measurement", "measure"),
    ".plan": ("Plan", "apply", "profile", "solve", "solve_graph"),
    ".rewrite": ("PlanFallbackError", "PlanForward", "planned"),
    ".workflows.advice": ("Advice",),
    ".workflows.advise": ("advise",),
    ".workflows.compare": ("Comparison", "compare"),
    ".workflows.floor": ("Floor", "floor"),
    ".workflows.max_batch": ("MaxBatch", "max_batch"),
}
_SOURCE_OF = {name: module for module, names in _SOURCES.items() for name in names}

__all__ = ["Advice", "Comparison", "CostGraph", "CostGraphError", "DeviceSpec", "Estimate",
           "FakeProfileError", "Floor", "InfeasibleBudgetError", "MaxBatch", "Measurement",
           "Plan", "PlanFallbackError", "PlanForward", "Region", "RejectedInputsError",
           "Schedule", "ScheduleError", "StepBreakdown", "TraceError", "advise", "apply",
           "compare", "floor", "max_batch", "measure", "measure_training_step", "parse_budget",
           "planned", "profile", "simulate", "solve", "solve_graph", "trace"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """An exported name, imported from its module on first use and kept."""
    module = _SOURCE_OF.get(name)
    if module is None:
        if importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f".{name}", __name__)  # a submodule: scheduler.quantities
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
