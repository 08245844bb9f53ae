"""The public entry points that tie the pipeline together: `apply` (and, later, `solve`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .profile import traced_fingerprint
from .rewrite import CheckpointedModule, rewrite
from .schedule import Schedule, ScheduleError
from .trace import _as_tuple, trace

__all__ = ["apply"]


def apply(model: nn.Module, schedule: Schedule | str | Path, example_inputs: Sequence[Any], *,
          loss_fn: Callable[[Any], torch.Tensor] | None = None) -> CheckpointedModule:
    """Return ``model`` with a saved schedule applied, without solving.

    Args:
        model: the model the schedule was solved for (not modified; the result shares its
            parameters).
        schedule: a `Schedule` or the path of one saved with ``Schedule.save``/``plan.save``.
        example_inputs: inputs with the shapes the schedule was solved for.
        loss_fn: the loss used when solving, if any.

    Raises:
        ScheduleError: the schedule's file is malformed, or it was made for a model whose
            structure or input shapes differ (the message says which).
    """
    if not isinstance(schedule, Schedule):
        schedule = Schedule.load(schedule)
    inputs = _as_tuple(example_inputs)
    gm = trace(model, inputs, loss_fn=loss_fn)
    if schedule.fingerprint:
        fp = traced_fingerprint(gm, model, inputs)
        if fp != schedule.fingerprint:
            raise ScheduleError(
                f"the schedule was made for a graph with fingerprint {schedule.fingerprint!r}, "
                f"but {type(model).__name__} with inputs "
                f"{[tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor)]} traces to "
                f"{fp!r}: the model's structure or input shapes differ; solve again for it")
    return rewrite(gm, schedule, model)
