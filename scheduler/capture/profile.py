"""Profiling a model: `profile` traces it and records one training step into a `CostGraph`,
for real or under fake tensors.

``mode`` says how memory is recorded: ``"real"`` runs the step (`record.profile_traced`);
``"fake"`` runs it under fake tensors (`fake.FakeStep`), so that nothing of activation size is
allocated and a model that does not fit can still be planned; ``"auto"`` (the default) records
it fake first and runs it for real only when the predicted peak fits the device's free memory.
``times`` says where a fake profile's node times come from (`node_times`, `roofline`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from ..cost.simulate import simulate
from ..distributed import check_unwrapped
from ..ir.graph import CostGraph
from ..ir.schedule import Schedule
from ..quantities import format_bytes
from . import node_times
from .calls import call_inputs, check_differentiable
from ..measurement.storage import free_bytes
from .fake import (FakeStep, check_not_meta, fake_failure, needs_fake, parse_device,
                   rejected_inputs, specs_as_meta)
from .fingerprint import traced_fingerprint
from .program import Program
from .record import Rec, Recorder, build_graph, device_of, profile_traced
from .roofline import device_spec as device_spec_of
from .roofline import roofline_s
from .scratch import warn_fake_scratch
from .timing import checkpoint_costs
from .state import preserved_state
from .trace import TraceError, trace

__all__ = ["MODES", "TIMES", "check_profile_options", "profile", "profile_step",
           "profile_traced", "trace_without_running", "traced_fingerprint"]


#: how a profile's memory is recorded (`profile`'s ``mode``)
MODES = ("auto", "real", "fake")
#: where a profile's node times come from (`profile`'s ``times``)
TIMES = ("measured", "isolated", "scaled", "roofline")


def profile(model: nn.Module, example_inputs: Sequence[Any], *,
            loss_fn: Callable[[Any], torch.Tensor] | None = None, repeats: int = 3,
            name: str | None = None,
            progress: Callable[[str], None] | None = None, mode: str = "auto",
            times: str | None = None, device: str | torch.device | None = None,
            device_spec: Any = None, small_inputs: Sequence[Any] | None = None,
            headroom: float = 0.1) -> CostGraph:
    """Trace ``model`` and profile one forward + backward step into a `CostGraph`: one
    traced graph of the whole step. `scheduler.profile` (`profiling.profile`) is this with
    ``units=`` as `scheduler.solve` takes them (its default plans a Hugging Face model in
    its layers).

    Args:
        model: the model (not modified).
        example_inputs: positional inputs with the shapes to plan for, or a mapping of
            keyword inputs (`calls.call_inputs`). Under ``mode="fake"`` an input may also be
            a tensor on the ``meta`` device or a ``(shape, dtype)`` spec.
        loss_fn: ``loss_fn(output) -> scalar``; default: `trace.default_loss_recipe`.
        repeats: timed steps per measurement (medians are kept), after one warm-up.
        name: the graph's name (default: the model's class name).
        progress: called with a short message as each phase starts.
        mode: how memory is recorded. ``"real"`` runs the step (it must fit the device);
            ``"fake"`` runs it under fake tensors (`capture.fake`), allocating nothing of
            activation size; ``"auto"`` (default) records it fake first, then for real only
            if its predicted peak fits the device's free memory less ``headroom``. The graph's
            ``meta["profile"]`` says which ran and why.
        times: where node times come from: ``"measured"`` (the real step, timed; the only
            choice for ``mode="real"``), ``"isolated"`` (default for a fake profile: each node
            run alone at full size, `node_times.isolated_times`), ``"scaled"`` (a real
            profile at ``small_inputs``, scaled by each node's FLOPs and bytes) or
            ``"roofline"`` (no run: ``device_spec``'s peak rates). Recorded in
            ``meta["times"]``.
        device: the device planned for (default: the model's); under ``mode="fake"`` it may
            be one the model is not on (``"cuda"`` for a model on the CPU).
        device_spec: for ``times="roofline"``: a `roofline.DeviceSpec` or a name in
            `roofline.DEVICE_SPECS` (``"h100"``).
        small_inputs: for ``times="scaled"``: inputs of the same structure at a size that
            runs (default: the batch dimension shrunk until the step fits).
        headroom: ``mode="auto"``: fraction of free memory held back.

    Returns:
        The `CostGraph`: nodes in execution order with bytes, saved tensors and times.

    Raises:
        TraceError: the model cannot be traced (see `trace`).
        FakeProfileError: ``mode="fake"`` on a step fake tensors cannot run (an op with
            data-dependent output shapes), or for a device this build cannot fake.
        ValueError: a bad ``mode``, ``times``, ``device_spec`` or ``headroom``.
    """
    return profile_step(model, example_inputs, loss_fn=loss_fn, repeats=repeats, name=name,
                        progress=progress, mode=mode, times=times, device=device,
                        device_spec=device_spec, small_inputs=small_inputs,
                        headroom=headroom)[1]


def check_profile_options(mode: str, times: str | None, device_spec: Any = None,
                          headroom: float = 0.1) -> str | None:
    """Validate `profile`'s options before anything runs; returns ``times`` resolved for a
    fake profile (None for a real one)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if times is not None and times not in TIMES:
        raise ValueError(f"times must be one of {', '.join(map(repr, TIMES))}, got {times!r}")
    if mode == "real" and times not in (None, "measured"):
        raise ValueError(f"times={times!r} is for a fake profile (mode='fake' or 'auto'); a "
                         f"real profile measures its times (times='measured')")
    if mode == "fake" and times == "measured":
        raise ValueError("times='measured' needs the real step (mode='real'); a fake profile "
                         "takes times='isolated', 'scaled' or 'roofline'")
    if not (isinstance(headroom, (int, float)) and 0 <= headroom < 1):
        raise ValueError(f"headroom must be a fraction in [0, 1), got {headroom!r}")
    fake_times = times if times not in (None, "measured") else "isolated"
    if fake_times == "roofline":
        device_spec_of(device_spec)
    return fake_times


def profile_step(model: nn.Module, example_inputs: Any, *,
                 loss_fn: Callable[[Any], torch.Tensor] | None = None, repeats: int = 3,
                 name: str | None = None, progress: Callable[[str], None] | None = None,
                 mode: str = "auto", times: str | None = None,
                 device: str | torch.device | None = None, device_spec: Any = None,
                 small_inputs: Sequence[Any] | None = None, headroom: float = 0.1
                 ) -> tuple[fx.GraphModule, CostGraph, tuple[Any, ...]]:
    """`profile`, returning the traced graph, the `CostGraph` and the positional inputs
    (what `solve` rewrites with)."""
    fake_times = check_profile_options(mode, times, device_spec, headroom)
    check_not_meta(device)
    check_unwrapped(model, "profile")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    given = specs_as_meta(example_inputs)
    inputs = call_inputs(model, given)
    check_differentiable(model, inputs)
    say = progress or (lambda _msg: None)
    name = name or type(model).__name__
    why_fake = needs_fake(given, model)
    real_only = mode == "real" or (mode == "auto" and times == "measured")
    if real_only and why_fake:
        runs = f"mode={mode!r}" + (" with times='measured'" if mode == "auto" else "")
        raise ValueError(f"{runs} runs the step, but {why_fake}; give real tensors and a model "
                         f"with real parameters, or profile with mode='fake'")
    if real_only:
        _check_real_device(device, device_of(model, inputs), mode)
        say("tracing")
        gm = _trace(model, inputs, loss_fn)
        g = profile_traced(gm, model, inputs, repeats=repeats, name=name, progress=say)
        g.meta["profile"] = {"mode": "real", "why": f"mode={mode!r}"}
        return gm, g, inputs
    fake = FakeStep(model, device)
    say("tracing (fake tensors)")
    finputs = fake.inputs(inputs)
    try:
        gm = _trace(model, finputs, loss_fn, fake)
        say("recording memory and saved tensors (fake tensors)")
        prog = Program(gm)
        with preserved_state(model), fake.active(model, gm):
            rec = Recorder(prog, model, finputs, device=fake.device).run()
    except Exception as e:  # noqa: BLE001 - auto falls back to the real step
        failure = fake_failure(e)
        if mode == "fake" or why_fake:
            if failure is not None and failure is not e:
                raise failure from e
            raise
        if failure is None and isinstance(e, TraceError) and not e.needs_values:
            raise
        say("fake tensors cannot run this step: profiling it for real")
        gm = _trace(model, inputs, loss_fn)
        g = profile_traced(gm, model, inputs, repeats=repeats, name=name, progress=say)
        g.meta["profile"] = {"mode": "real", "why": f"fake tensors failed: "
                             f"{(failure or e).args[0] if (failure or e).args else e!r}"[:300]}
        return gm, g, inputs
    own_device = device_of(model, inputs)
    if mode == "auto" and not why_fake and fake.device == own_device:
        memory = build_graph(prog, rec, {}, [], None, name, finputs)
        predicted = simulate(memory, Schedule.none(memory)).peak_bytes
        free = free_bytes(fake.device)
        usable = None if free is None else int(free * (1 - headroom))
        if usable is not None and predicted <= usable:
            g = profile_traced(gm, model, inputs, repeats=repeats, name=name, progress=say)
            g.meta["profile"] = {
                "mode": "real", "why": f"the predicted unscheduled peak "
                f"{format_bytes(predicted)} fits {format_bytes(usable)} free on {fake.device} "
                f"(less {headroom:.0%} headroom)"}
            return gm, g, inputs
        why = (f"the predicted unscheduled peak {format_bytes(predicted)} does not fit "
               f"{format_bytes(usable)} free on {fake.device} (less {headroom:.0%} headroom)"
               if usable is not None else f"the free memory of {fake.device} is not known")
    elif mode == "auto":
        why = why_fake or f"planning for {fake.device}, not the model's {own_device}"
    else:
        why = "mode='fake'"
    say(f"node times ({fake_times})")
    fwd_t, bwd_t, sac_t = _fake_times(fake_times, prog, model, rec, inputs, fake, repeats,
                                       device_spec, small_inputs, loss_fn, say)
    g = build_graph(prog, rec, fwd_t, bwd_t, None, name, finputs, sac_t)
    g.meta["device"] = str(fake.device)
    g.meta["profile"] = {"mode": "fake", "why": why}
    g.meta["times"] = fake_times
    warn_fake_scratch(model, g, fake.device)
    if fake.device.type == own_device.type and fake.device.type != "meta":
        g.checkpoint_call_s, g.checkpoint_saved_s = checkpoint_costs(fake.device)
    return gm, g, inputs


def _trace(model: nn.Module, inputs: tuple[Any, ...], loss_fn: Any,
           fake: FakeStep | None = None) -> fx.GraphModule:
    """`trace`, with the model's own error on these inputs (a shape or dtype it does not
    take) raised as a one-line `RejectedInputsError`."""
    try:
        return trace(model, inputs, loss_fn=loss_fn, fake=fake)
    except Exception as e:  # noqa: BLE001 - re-raised as is unless the model rejected inputs
        rejected = rejected_inputs(e, model, inputs, fake=fake is not None)
        if rejected is None:
            raise
        raise rejected from e


def _check_real_device(device: Any, own: torch.device, mode: str) -> None:
    """A real profile runs where the model is: ``device`` (when given) must be that one."""
    if device is None:
        return
    want = parse_device(device)
    if want.type == own.type and (want.index is None or want.index == (own.index or 0)):
        return
    fake = (f", or plan for {want} without running on it with mode='fake'"
            if want.type == "cuda" else "")
    raise ValueError(f"mode={mode!r} runs the step where the model and inputs are ({own}), "
                     f"not on device={str(want)!r}; move them there first{fake}")


def _fake_times(kind: str, prog: Program, model: nn.Module, rec: Rec,
                inputs: tuple[Any, ...], fake: FakeStep, repeats: int, device_spec: Any,
                small_inputs: Sequence[Any] | None, loss_fn: Any, say: Callable[[str], None]
                ) -> tuple[dict[str, float], list[float], dict[str, float]]:
    if kind == "roofline":
        spec = device_spec_of(device_spec)
        fwd = {n: roofline_s(spec, ops) for n, ops in rec.fwd_ops.items()}
        return fwd, [roofline_s(spec, ops) for ops in rec.step_ops], {}
    if kind == "isolated":
        return node_times.isolated_times(prog, model, rec, inputs, fake, repeats)
    return node_times.scaled_times(prog, model, rec, inputs, fake, repeats, small_inputs,
                                   loss_fn, say)


def trace_without_running(model: nn.Module, inputs: tuple[Any, ...], *,
                          loss_fn: Callable[[Any], torch.Tensor] | None = None,
                          fingerprint: bool = False) -> tuple[fx.GraphModule, str | None]:
    """`trace` (and, with ``fingerprint``, `traced_fingerprint`) with the forwards they run on
    fake tensors, so that applying a schedule to a model too big to run unscheduled allocates
    nothing of activation size; where fake tensors cannot run the model, on real ones (with
    inputs that fit), as `trace` always did."""
    why_fake = needs_fake(inputs)
    try:
        fake = FakeStep(model)
        finputs = fake.inputs(inputs)
        gm = trace(model, finputs, loss_fn=loss_fn, fake=fake)
        fp = traced_fingerprint(gm, model, finputs, fake=fake) if fingerprint else None
        return gm, fp
    except Exception as e:  # noqa: BLE001 - the real forward raises what is genuinely wrong
        if why_fake:
            failure = fake_failure(e)
            if failure is not None and failure is not e:
                raise failure from e
            raise
    gm = trace(model, inputs, loss_fn=loss_fn)
    return gm, traced_fingerprint(gm, model, inputs) if fingerprint else None
