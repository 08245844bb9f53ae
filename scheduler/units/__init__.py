"""Units: the submodules whose calls a plan takes over, the rest of the step being the user's
own ``forward`` (`find` chooses them, `runtime` runs them, `step` fits a profiled step to
them)."""

from .find import UnitChoice, find_units
from .plans import UnitsPlan, units_plan
from .runtime import UnitForward, rewrite_units
from .step import called_once, gives_positions, profile_units, warm_up, without_cache

__all__ = ["UnitChoice", "UnitForward", "UnitsPlan", "called_once", "find_units", "gives_positions",
           "profile_units", "rewrite_units", "units_plan", "warm_up", "without_cache"]
