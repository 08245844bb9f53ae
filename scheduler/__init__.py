"""scheduler: optimal activation-checkpointing schedules for PyTorch models."""
from .graph import CostGraph, CostGraphError
from .measure import Measurement, measure
from .profile import profile
from .schedule import Region, Schedule, ScheduleError
from .trace import TraceError, trace

__all__ = ["CostGraph", "CostGraphError", "Measurement", "Region", "Schedule", "ScheduleError",
           "TraceError", "measure", "profile", "trace"]
__version__ = "0.1.0"
