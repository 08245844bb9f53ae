"""The public `profile`: one step of a model profiled into a `CostGraph` as `solve` profiles
it (units included), to save and solve later without the model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .capture.profile import check_profile_options
from .distributed import process_group
from .ir.graph import CostGraph
from .parallel import parse_parallel
from .units import profile_units

__all__ = ["profile"]


def profile(model: nn.Module, example_inputs: Sequence[Any] | Mapping[str, Any], *,
            loss_fn: Callable[[Any], torch.Tensor] | None = None, repeats: int = 3,
            name: str | None = None, progress: Callable[[str], None] | None = None,
            mode: str = "auto", times: str | None = None,
            device: str | torch.device | None = None, device_spec: Any = None,
            small_inputs: Sequence[Any] | None = None, headroom: float = 0.1,
            units: Any = "default", parallel: Any = None) -> CostGraph:
    """Trace ``model`` and profile one forward + backward step into a `CostGraph`: the graph
    `solve` would plan for with the same arguments, to save (``graph.save``) and solve later
    (`solve_graph`, ``scheduler solve g.json``) without the model.

    With units, the graph records them (``graph.units``): a schedule solved on it records
    them too, and `apply` runs it inside the model's own ``forward``, in those units.

    Args:
        model: the model (not modified).
        example_inputs: positional inputs with the shapes to plan for, or a mapping of
            keyword inputs (a Hugging Face-style batch). Under ``mode="fake"`` an input may
            also be a tensor on the ``meta`` device or a ``(shape, dtype)`` spec.
        loss_fn: ``loss_fn(output) -> scalar``; default: `trace.default_loss_recipe`.
        repeats: timed steps per measurement (medians are kept), after one warm-up.
        name: the graph's name (default: the model's class name).
        progress: called with a short message as each phase starts.
        mode, times, device, device_spec, small_inputs, headroom: how the step is profiled
            (`capture.profile.profile`): ``mode="auto"`` (default) records it under fake
            tensors first and runs it for real only if its predicted peak fits the device's
            free memory less ``headroom``; ``graph.meta["profile"]`` says which ran.
        units: the submodules a plan takes over, as `solve`'s ``units``: ``"default"``
            (``"auto"`` for a model that declares ``_no_split_modules``, such as a Hugging
            Face model, whose step is then profiled as its own ``forward`` runs it, with
            ``use_cache=False``; None for the rest), ``"auto"``, a module class, a glob of
            module paths, a predicate ``(path, module) -> bool``, or None for one traced
            graph of the whole step.
        parallel: profile one rank of data-parallel training, as `solve`'s ``parallel``
            (``"ddp"``, ``"fsdp2"``, ``"fsdp2:8"``): the graph is that rank's.

    Returns:
        The `CostGraph`: nodes in execution order with bytes, saved tensors and times;
        ``units`` the units called once in the step (empty without units).

    Raises:
        TraceError: the model cannot be traced (see `trace`).
        FakeProfileError: ``mode="fake"`` on a step fake tensors cannot run.
        ValueError: a bad ``mode``, ``times``, ``device_spec``, ``headroom``, ``units`` or
            ``parallel`` (the message names it).
    """
    check_profile_options(mode, times, device_spec, headroom)
    parse_parallel(parallel, *process_group())  # (fail now, not after tracing)
    say = progress or (lambda _msg: None)
    _, graph, _, choice = profile_units(
        model, example_inputs, units, loss_fn=loss_fn, repeats=repeats, name=name,
        progress=say, mode=mode, times=times, device=device, device_spec=device_spec,
        small_inputs=small_inputs, headroom=headroom, parallel=parallel)
    if choice.paths:
        say(f"units: {choice.why}")
    return graph
