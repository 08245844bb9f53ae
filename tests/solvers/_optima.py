"""Proven optima on the recorded graphs: a reference for the solvers that is not their output.

Each entry is ``graphs/<name>.json`` at ``budget_bytes(graph, fraction)`` (conftest: that
fraction of the unscheduled simulated peak, rounded down). `OPTIMA` holds the simulated
recompute seconds of the schedule `auto` (10 s limit) proved OPTIMAL there: its full-space
lower bound reached that schedule's recompute time, so no schedule of any kind that fits does
better, and a correct solver can neither beat it nor, when it says OPTIMAL, miss it. At the
budgets in `NOTHING_FITS` it found nothing that fits; there the full-space bound proves that
no schedule fits.
"""

from __future__ import annotations

__all__ = ["NOTHING_FITS", "OPTIMA", "REL"]

#: (graph, fraction) -> the proven least recompute seconds
OPTIMA: dict[tuple[str, float], float] = {
    ("gpt", 0.9): 0.001669210936374761,
    ("gpt", 0.7): 0.0056388369224490385,
    ("hf_gpt2", 0.9): 0.0006337621519531807,
    ("hf_gpt2_12l", 0.7): 0.006793065824785776,
    ("mlp", 0.9): 0.0028003431323394244,
    ("mlp", 0.7): 0.00989031937360858,
    ("unet", 0.9): 0.0017456131074890966,
    ("unet", 0.7): 0.007156745226187694,
    ("unet", 0.5): 0.01615618464739999,
}

#: (graph, fraction) at which no schedule fits
NOTHING_FITS: tuple[tuple[str, float], ...] = (
    ("hf_gpt2", 0.7), ("hf_gpt2", 0.5), ("hf_gpt2_12l", 0.5), ("mlp", 0.5))

#: relative tolerance of OPTIMAL (a millionth: the picosecond rounding of the bound's objective)
REL = 1e-6
