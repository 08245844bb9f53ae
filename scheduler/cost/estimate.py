"""`Estimate`: what `simulate` predicts for one training step under a schedule; `RegionCost`:
one region's share of it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Estimate", "RegionCost"]


@dataclass(frozen=True)
class Estimate:
    """Predicted cost of one training step under a schedule."""

    peak_bytes: int
    step_s: float
    recompute_s: float
    overhead: float  # recompute_s / unscheduled step time
    forward_peak_bytes: int
    # (label, live bytes) after each forward node, recompute and backward step, for plots
    timeline: tuple[tuple[str, int], ...] = field(default=(), repr=False, compare=False)

    def to_dict(self, *, timeline: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not timeline:
            d.pop("timeline")
        else:
            d["timeline"] = [list(x) for x in self.timeline]
        return d


@dataclass(frozen=True)
class RegionCost:
    """One region's share of a step, for solvers that compose regions (see `region_costs`).

    ``local_peak_bytes``: the most bytes alive during the region's forward, replay and
    backward, not counting what earlier regions hold (base bytes included).
    ``held_bytes``: bytes it holds while later regions run. ``separable``: that amount was
    the same at every moment of the later regions (true on chains), so that
    ``peak = max_j (sum(held of earlier regions) + local_peak_j)`` holds exactly.
    """

    local_peak_bytes: int
    held_bytes: int
    recompute_s: float
    separable: bool
