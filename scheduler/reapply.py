"""Re-applying a saved schedule to its model without solving: `apply`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .capture.calls import call_inputs
from .capture.profile import trace_without_running
from .run_watch import watch_compiled_run, watch_eager_run
from .distributed import check_unwrapped
from .ir.schedule import Schedule, ScheduleError
from .rewrite import check_on_fallback, rewrite
from .step_checks import check_shapes, input_shapes
from .units.apply import UNITS, apply_units

__all__ = ["apply"]


def apply(model: nn.Module, schedule: Schedule | str | Path,
          example_inputs: Sequence[Any] | Mapping[str, Any], *,
          loss_fn: Callable[[Any], torch.Tensor] | None = None, on_fallback: str = "warn"
          ) -> nn.Module:
    """Return ``model`` with a saved schedule applied, without solving.

    A units plan's schedule (solved with ``units=``; its units are in ``schedule.meta``)
    gives a module that runs the model's own forward with those units planned
    (`units.apply`): the step is profiled again on fake tensors to check the fingerprint, so
    a schedule solved on the meta device applies to the real model.

    Args:
        model: the model the schedule was solved for (not modified; the result shares its
            parameters).
        schedule: a `Schedule` or the path of one saved with ``Schedule.save``/``plan.save``.
        example_inputs: inputs (positional, or a mapping of keywords) with the shapes the
            schedule was solved for.
        loss_fn: the loss used when solving, if any.
        on_fallback: what a training call that cannot run the plan does: ``"warn"``
            (default) or ``"raise"`` (see `rewrite.rewrite`).

    Raises:
        ScheduleError: the schedule's file is malformed, or it was made for a model whose
            structure or input shapes differ (the message says which).

    Warns:
        run_watch.EagerRunWarning: at the module's first call outside ``torch.compile``,
            where the schedule is for compiled execution and its saved estimate's peak is over
            its budget (it was fitted by the compiled step's measured peak).
        UserWarning: a schedule without a fingerprint is applied at other input shapes than
            the ones `solve` recorded for it (`INPUT_SHAPES`), naming both, or records none, so
            that its shapes cannot be checked: its predicted memory holds only for those.
    """
    check_on_fallback(on_fallback)
    check_unwrapped(model, "apply")
    if not isinstance(schedule, Schedule):
        schedule = Schedule.load(schedule)
    if schedule.meta.get(UNITS):  # (a units plan: the model's own forward runs it)
        module = apply_units(model, schedule, example_inputs, loss_fn=loss_fn,
                             on_fallback=on_fallback)
    else:
        module = _apply_flat(model, schedule, example_inputs, loss_fn, on_fallback)
    watch_eager_run(module, schedule)
    watch_compiled_run(module, schedule)
    return module


def _apply_flat(model: nn.Module, schedule: Schedule,
                example_inputs: Sequence[Any] | Mapping[str, Any],
                loss_fn: Callable[[Any], torch.Tensor] | None, on_fallback: str) -> nn.Module:
    """`apply` of a schedule of the traced step (no units)."""
    inputs = call_inputs(model, example_inputs)
    gm, fp = trace_without_running(model, inputs, loss_fn=loss_fn,
                                   fingerprint=bool(schedule.fingerprint))
    if schedule.fingerprint:
        if fp != schedule.fingerprint:
            raise ScheduleError(
                f"the schedule was made for a graph with fingerprint {schedule.fingerprint!r}, "
                f"but {type(model).__name__} with inputs "
                f"{[tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor)]} traces to "
                f"{fp!r}: the model's structure or input shapes differ; solve again for it")
    # (a schedule of another model fails here)
    module = rewrite(gm, schedule, model, on_fallback=on_fallback)
    if not schedule.fingerprint:
        check_shapes(schedule, input_shapes(gm), type(model).__name__)
    return module
