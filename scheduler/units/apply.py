"""A saved units schedule applied to a model (`scheduler.apply`), without solving.

`solve` records the units in the schedule (``meta[UNITS]``: their paths and why), so that
the schedule can be applied to another object of the same model: one built for real after
planning on the meta device, or in another process. `apply_units` profiles the eager step as
`solve` did, on fake tensors (nothing of activation size is allocated; times are not needed),
checks its fingerprint against the schedule's, and builds the planned copy
(`runtime.rewrite_units`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..ir.region import ScheduleError
from ..ir.schedule import Schedule
from ..step_checks import INPUT_SHAPES, input_shapes
from .find import UnitChoice
from .runtime import rewrite_units
from .step import profile_units

__all__ = ["UNITS", "apply_units", "stamped", "units_meta"]

#: the schedule's ``meta`` key of its units: ``{"paths": [...], "why": "..."}``
UNITS = "units"


def units_meta(paths: tuple[str, ...], why: str) -> dict[str, Any]:
    """What `solve` records of a plan's units in its schedule."""
    return {UNITS: {"paths": list(paths), "why": why}}


def stamped(schedule: Schedule, gm: fx.GraphModule, choice: UnitChoice) -> Schedule:
    """``schedule`` with what `solve` records beside it: the input shapes of the step ``gm``
    solved for (which `apply` checks if the fingerprint is ever removed) and the units."""
    return dataclasses.replace(schedule, meta={
        **schedule.meta, INPUT_SHAPES: input_shapes(gm),
        **(units_meta(choice.paths, choice.why) if choice.paths else {})})


def apply_units(model: nn.Module, schedule: Schedule, example_inputs: Any, *,
                loss_fn: Callable[[Any], torch.Tensor] | None, on_fallback: str
                ) -> nn.Module:
    """``model`` running ``schedule``'s units plan (module docstring); the model is not
    modified.

    Raises:
        ScheduleError: the schedule was made for another model or input shapes (fingerprint),
            or its units are not modules of ``model``.
    """
    saved = schedule.meta[UNITS]
    paths = tuple(saved.get("paths", ())) if isinstance(saved, dict) else ()
    if not paths:
        raise ScheduleError(f"the schedule's units record ({saved!r}) names no unit; solve "
                            "again with units='auto'")
    try:
        gm, graph, inputs, choice = profile_units(
            model, example_inputs, list(paths), loss_fn=loss_fn, repeats=1, mode="fake",
            times="roofline", device_spec="cpu")
    except ValueError as e:
        if not str(e).startswith("units="):
            raise
        raise ScheduleError(f"the schedule's units are not {type(model).__name__}'s "
                            f"modules: {e}") from None
    if choice.paths != paths:
        raise ScheduleError(f"the schedule's units {list(paths)} are not all called once in "
                            f"{type(model).__name__}'s step ({choice.why}); solve again for it")
    if schedule.fingerprint and graph.fingerprint != schedule.fingerprint:
        raise ScheduleError(
            f"the schedule was made for a graph with fingerprint {schedule.fingerprint!r}, "
            f"but {type(model).__name__}'s step with these inputs, profiled with its units, "
            f"has {graph.fingerprint!r}: the model's structure or input shapes differ; solve "
            "again for it")
    info = gm.meta["scheduler"]
    return rewrite_units(model, graph, schedule,
                         tracer=info.tracer, why=str(saved.get("why", "")),
                         on_fallback=on_fallback, loss_fn=info.loss_fn, inputs=inputs)
