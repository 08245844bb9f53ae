"""scheduler: optimal activation-checkpointing schedules for PyTorch models."""
from .advise import Advice, advise
from .api import InfeasibleBudgetError, Plan, apply, parse_budget, solve, solve_graph
from .compare import Comparison, compare
from .graph import CostGraph, CostGraphError
from .max_batch import MaxBatch, max_batch
from .measure import Measurement, StepBreakdown, measure, measure_training_step
from .profile import profile
from .schedule import Region, Schedule, ScheduleError
from .simulate import Estimate, simulate
from .trace import TraceError, trace

__all__ = ["Advice", "Comparison", "CostGraph", "CostGraphError", "Estimate",
           "InfeasibleBudgetError", "MaxBatch", "Measurement", "Plan", "Region", "Schedule",
           "ScheduleError", "StepBreakdown", "TraceError", "advise", "apply", "compare",
           "max_batch", "measure", "measure_training_step", "parse_budget", "profile",
           "simulate", "solve", "solve_graph", "trace"]
__version__ = "0.1.0"
