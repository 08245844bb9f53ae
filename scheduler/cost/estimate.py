"""`Estimate`: what `simulate` predicts for one training step under a schedule."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Estimate"]


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
