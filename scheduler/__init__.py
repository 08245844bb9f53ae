"""scheduler: optimal activation-checkpointing schedules for PyTorch models."""
from .api import InfeasibleBudgetError, Plan, apply, parse_budget, solve, solve_graph
from .compare import Comparison, compare
from .graph import CostGraph, CostGraphError
from .measure import Measurement, measure
from .profile import profile
from .schedule import Region, Schedule, ScheduleError
from .simulate import Estimate, simulate
from .trace import TraceError, trace

__all__ = ["Comparison", "CostGraph", "CostGraphError", "Estimate", "InfeasibleBudgetError", "Measurement",
           "Plan", "Region", "Schedule", "ScheduleError", "TraceError", "apply", "compare", "measure",
           "parse_budget", "profile", "simulate", "solve", "solve_graph", "trace"]
__version__ = "0.1.0"
