"""scheduler: optimal activation-checkpointing schedules for PyTorch models."""
from .budget import InfeasibleBudgetError, parse_budget
from .capture.profile import profile
from .capture.trace import TraceError, trace
from .cost.simulate import Estimate, simulate
from .ir.graph import CostGraph, CostGraphError
from .ir.schedule import Region, Schedule, ScheduleError
from .measurement.breakdown import StepBreakdown, measure_training_step
from .measurement.step import Measurement, measure
from .plan import Plan, apply, solve, solve_graph
from .workflows.advice import Advice
from .workflows.advise import advise
from .workflows.compare import Comparison, compare
from .workflows.max_batch import MaxBatch, max_batch

__all__ = ["Advice", "Comparison", "CostGraph", "CostGraphError", "Estimate",
           "InfeasibleBudgetError", "MaxBatch", "Measurement", "Plan", "Region", "Schedule",
           "ScheduleError", "StepBreakdown", "TraceError", "advise", "apply", "compare",
           "max_batch", "measure", "measure_training_step", "parse_budget", "profile",
           "simulate", "solve", "solve_graph", "trace"]
__version__ = "0.1.0"
