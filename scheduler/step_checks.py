"""What `plan.solve` and `plan.apply` check about a step beside solving it: the input shapes a
schedule was solved for (`INPUT_SHAPES`), and a model's own checkpointing's measured peak."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch.nn as nn

from .cost.estimate import Estimate
from .capture.usercode import UserCodeWarning
from .ir.schedule import Schedule
from .measurement.step import measure
from .quantities import format_bytes

__all__ = ["INPUT_SHAPES", "check_shapes", "input_shapes", "own_peak"]

#: The key of ``schedule.meta`` where `solve` records the input shapes it solved for (one
#: entry per leaf of the inputs: a tensor's shape as a list, None for a non-tensor), which
#: `apply` checks where a schedule has no fingerprint.
INPUT_SHAPES = "input_shapes"


def input_shapes(gm: Any) -> list[list[int] | None]:
    """The input shapes a traced step was traced with, as `INPUT_SHAPES` records them."""
    return [None if spec is None else list(spec[0])
            for spec in gm.meta["scheduler"].input_specs]


def check_shapes(schedule: Schedule, shapes: list[list[int] | None], model: str) -> None:
    """Warn where a schedule without a fingerprint is applied at input shapes other than
    the ones it was solved for (`INPUT_SHAPES`), or where nothing says which those were: its
    memory was predicted for them, so at another batch size the budget no longer holds."""
    recorded = schedule.meta.get(INPUT_SHAPES)
    if recorded is None:
        warnings.warn(
            f"the schedule has no fingerprint and records no input shapes, so applying it to "
            f"{model} with input shapes {_shapes(shapes)} cannot be checked: its predicted "
            f"memory holds only for the shapes it was solved for; solve again for these "
            f"shapes, or keep the fingerprint that `plan.save` writes", UserWarning,
            stacklevel=3)
    elif recorded != shapes:
        budget = schedule.budget_bytes
        within = f" within {format_bytes(budget)}" if isinstance(budget, int) else ""
        warnings.warn(
            f"the schedule was solved for input shapes {_shapes(recorded)}, but {model} is "
            f"given {_shapes(shapes)}: its predicted memory{within} holds only for the shapes "
            f"it was solved for; solve again for these shapes", UserWarning, stacklevel=3)


def _shapes(shapes: Any) -> str:
    """Tensor shapes as people read them: ``(8, 3, 32, 32), (8,)``."""
    if not isinstance(shapes, list):
        return repr(shapes)
    return ", ".join(repr(tuple(s)) if isinstance(s, list) else repr(s) for s in shapes) or "()"


def own_peak(gm: Any, model: nn.Module, inputs: tuple[Any, ...], budget_bytes: int,
              estimate: Estimate, say: Callable[[str], None]) -> int | None:
    """For a model that checkpoints itself, measure its own step's peak (it runs: the user
    trains it) and warn with it beside the plan's budget, so that a fraction of the peak
    without checkpointing is not mistaken for one of the model's real peak."""
    info = gm.meta["scheduler"]
    if not info.user_checkpoints:
        return None
    say("measuring the model with its own checkpointing")
    own = measure(model, inputs, loss_fn=info.loss_fn, repeats=1).peak_bytes
    warnings.warn(
        f"{type(model).__name__} with its own checkpointing measured a peak of "
        f"{format_bytes(own)}; the plan replaces that checkpointing, with a budget of "
        f"{format_bytes(budget_bytes)} ({budget_bytes / own:.0%} of it) and a predicted peak of "
        f"{format_bytes(estimate.peak_bytes)} ({estimate.peak_bytes / own:.0%}). Give the budget "
        f"in bytes, or as a fraction of {format_bytes(own)}, to plan against what your model "
        f"uses now", UserCodeWarning, stacklevel=3)
    return own
