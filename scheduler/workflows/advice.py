"""The advice `advise` gives: its options (each way to run the step, priced), the
recommendation among them, and how it reads as text, JSON and rich tables. Pure: nothing here
runs a model."""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from ..measurement.breakdown import PARTS, StepBreakdown
from ..quantities import format_bytes, format_seconds

if TYPE_CHECKING:  # annotations only
    import torch.nn as nn

    from ..ir.schedule import Schedule

__all__ = ["ACCUMULATE", "ACCUMULATE_CHECKPOINT", "Advice", "BEYOND", "CHECKPOINT", "FITS",
           "Option", "REMEDIES", "beyond_summary", "dominant_parts", "recommend", "remedies",
           "shares"]

#: Recommendation kinds, in the order `recommend` considers them.
FITS, CHECKPOINT, ACCUMULATE, ACCUMULATE_CHECKPOINT, BEYOND = (
    "fits", "checkpoint", "accumulate", "accumulate+checkpoint", "beyond_checkpointing")

#: What to do when parameters, gradients or optimizer state keep the step from fitting.
REMEDIES: dict[str, tuple[str, ...]] = {
    "optimizer_state": (
        "shard the optimizer state across devices (ZeRO-1, FSDP)",
        "keep the optimizer state in lower precision (8-bit or bf16 Adam, e.g. bitsandbytes "
        "AdamW8bit) or use an optimizer with less state (SGD with momentum, Adafactor)",
        "offload the optimizer state to CPU memory"),
    "gradients": (
        "shard the gradients across devices (ZeRO-2, FSDP)",
        "keep gradients in lower precision (bf16 mixed precision)",
        "apply the optimizer in backward so each gradient is freed once used"),
    "parameters": (
        "shard the parameters across devices (FSDP, ZeRO-3)",
        "keep the parameters in lower precision (bf16)"),
    "activations": (
        "shorten the sequences or shrink the images: one example's activations do not fit",
        "offload saved activations to CPU memory"),
}


@dataclass(frozen=True)
class Option:
    """One way to train the same logical batch, as predicted.

    ``predicted_peak_bytes`` is the option's peak (optimizer state included); where no schedule
    fits it is the smallest peak any schedule reaches. ``predicted_time_s`` is the time per
    logical batch: ``micro_batches`` forward+backward steps plus one optimizer step.
    """

    name: str
    micro_batches: int
    micro_batch_size: int | None  # None: the inputs have no common batch dimension
    checkpoint: bool
    predicted_peak_bytes: int
    predicted_time_s: float
    fits: bool
    overhead: float = 0.0  # recompute time over the unscheduled micro-step, when checkpointed
    note: str = ""


@dataclass(eq=False)
class Advice:
    """What `advise` found; ``str(advice)`` is a readable report, `to_json` the data.

    Attributes:
        device_memory_bytes / headroom / usable_bytes: the device and the share of it a step
            may use, ``usable_bytes = device_memory_bytes * (1 - headroom)``.
        breakdown: the measured step (`StepBreakdown`: parts add up to its peak).
        fits: whether the measured step fits ``usable_bytes``.
        recommendation: one of ``fits``, ``checkpoint``, ``accumulate``,
            ``accumulate+checkpoint``, ``beyond_checkpointing``.
        summary: the recommendation in a few sentences, with the numbers behind it.
        remedies: what to do instead, where checkpointing and accumulation cannot help.
        shortfall_bytes: how far the best option is over ``usable_bytes`` (0 when one fits).
        options: every option priced (empty when the step fits as it is).
        chosen: the recommended option, if any.
        measured: for a recommended checkpointed option, its plan measured:
            ``predicted_overhead``, ``measured_overhead``, ``predicted_peak_bytes``,
            ``measured_peak_bytes`` (optimizer state included, and for accumulation the
            gradients held from earlier micro-batches).
        plan_module: the recommended option's checkpointed module (not exported to JSON).
        schedules: each checkpointed option's `Schedule` that fits, by option name (not
            exported to JSON; ``scheduler.apply`` runs one on the model at that micro-batch).
    """

    device_memory_bytes: int
    headroom: float
    usable_bytes: int
    breakdown: StepBreakdown
    fits: bool
    recommendation: str
    summary: str
    remedies: list[str] = field(default_factory=list)
    shortfall_bytes: int = 0
    options: list[Option] = field(default_factory=list)
    chosen: Option | None = None
    measured: dict[str, Any] | None = None
    plan_module: nn.Module | None = field(default=None, repr=False)
    schedules: dict[str, Schedule] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (bytes as ints, times in seconds), for JSON."""
        peak = self.breakdown.peak_bytes
        return {
            "device_memory_bytes": self.device_memory_bytes, "headroom": self.headroom,
            "usable_bytes": self.usable_bytes, "fits": self.fits,
            "breakdown": {**self.breakdown.to_dict(),
                          "percent": {k: 100 * v / peak if peak else 0.0
                                      for k, v in self.breakdown.parts.items()}},
            "recommendation": self.recommendation, "summary": self.summary,
            "remedies": list(self.remedies), "shortfall_bytes": self.shortfall_bytes,
            "options": [asdict(o) for o in self.options],
            "chosen": None if self.chosen is None else self.chosen.name,
            "measured": self.measured,
        }

    def to_json(self, **kwargs: Any) -> str:
        """`to_dict` as JSON (``json.dumps`` keyword arguments pass through)."""
        return json.dumps(self.to_dict(), **{"indent": 2, **kwargs})

    def renderables(self) -> list[Any]:
        """rich tables and text: the breakdown, the options, the recommendation."""
        from rich.table import Table
        from rich.text import Text

        b = self.breakdown
        t = Table(title=f"Peak of one training step ({b.optimizer}, {b.device}): "
                        f"{format_bytes(b.peak_bytes)}, in {b.phase}", title_justify="left")
        t.add_column("part")
        t.add_column("bytes", justify="right")
        t.add_column("share", justify="right")
        for k in PARTS:
            v = b.parts[k]
            t.add_row(k.replace("_", " "), format_bytes(v),
                      f"{v / b.peak_bytes:.1%}" if b.peak_bytes else "n/a")
        t.add_row("usable", format_bytes(self.usable_bytes),
                  f"{format_bytes(self.device_memory_bytes)} less {self.headroom:.0%}",
                  style="bold")
        out: list[Any] = [t]
        if self.options:
            o = Table(title="Options for the same logical batch (predicted)",
                      title_justify="left")
            for col in ("option", "micro-batch", "peak", "time per batch", "fits"):
                o.add_column(col, justify="left" if col == "option" else "right")
            for opt in self.options:
                mark = "<- fastest that fits" if opt is self.chosen else ""
                o.add_row(opt.name, "n/a" if opt.micro_batch_size is None else
                          f"{opt.micro_batches} x {opt.micro_batch_size}",
                          format_bytes(opt.predicted_peak_bytes),
                          format_seconds(opt.predicted_time_s),
                          ("yes " if opt.fits else "no ") + mark)
            out.append(o)
        out.append(Text(f"Recommendation ({self.recommendation}): {self.summary}"))
        out += [Text(f"  - {r}") for r in self.remedies]
        return out

    def to_text(self, width: int = 100) -> str:
        """The report as plain text."""
        from rich.console import Console

        buf = io.StringIO()
        console = Console(file=buf, width=width, no_color=True, highlight=False)
        for r in self.renderables():
            console.print(r)
        return buf.getvalue()

    def __str__(self) -> str:
        return self.to_text()


def recommend(options: Sequence[Option]) -> tuple[str, Option | None]:
    """The recommendation kind and the option it picks: the fastest option that fits; the
    first option is the step as it is. Pure: a table of literal options decides it."""
    if options and options[0].fits:
        return FITS, options[0]
    fitting = [o for o in options if o.fits]
    if not fitting:
        return BEYOND, None
    best = min(fitting, key=lambda o: (o.predicted_time_s, o.micro_batches))
    if best.micro_batches == 1:
        return CHECKPOINT, best
    return (ACCUMULATE_CHECKPOINT if best.checkpoint else ACCUMULATE), best


def shares(bd: StepBreakdown) -> dict[str, float]:
    return {k: v / bd.peak_bytes if bd.peak_bytes else 0.0 for k, v in bd.parts.items()}


def dominant_parts(bd: StepBreakdown) -> list[str]:
    """Parameters, gradients and optimizer state, largest first."""
    return sorted(("optimizer_state", "gradients", "parameters"), key=lambda k: -bd.parts[k])


def remedies(bd: StepBreakdown) -> list[str]:
    model_state = sum(bd.parts[k] for k in ("parameters", "gradients", "optimizer_state"))
    first = ["activations"] if bd.parts["activations"] > model_state else []
    # the parts worth acting on: a tenth of the peak or more, largest first
    big = [k for k in dominant_parts(bd) if bd.parts[k] >= 0.1 * bd.peak_bytes] or dominant_parts(bd)[:1]
    return [r for k in first + big for r in REMEDIES[k]] + ["train a smaller model"]


def beyond_summary(bd: StepBreakdown, share: dict[str, float], best: Option,
                    usable: int) -> str:
    fixed = sum(share[k] for k in ("parameters", "gradients", "optimizer_state"))
    parts = ", ".join(f"{k.replace('_', ' ')} {share[k]:.0%}" for k in dominant_parts(bd))
    why = ("checkpointing and accumulation only shrink activations, so they are not the "
           "remedy" if fixed >= share["activations"] else
           "even the fewest activations a schedule keeps for the smallest micro-batch do not "
           "fit")
    return (f"no schedule fits: the least peak of any option ({best.name}) is "
            f"{format_bytes(best.predicted_peak_bytes)}, "
            f"{format_bytes(best.predicted_peak_bytes - usable)} over the usable "
            f"{format_bytes(usable)}. Parameters, gradients and optimizer state are "
            f"{fixed:.0%} of the peak ({parts}), saved activations "
            f"{share['activations']:.0%}; {why}. Instead:")
