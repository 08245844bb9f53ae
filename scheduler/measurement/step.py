"""Measured peak memory and step time of one training step.

On CPU the peak comes from `storage.StorageTracker` (live tensor storages, counted), and the
allocator's own count beside it from the profiler's memory events (`compiled.allocator_rise`:
it also sees what kernels allocate inside themselves); on CUDA both are
``torch.cuda.max_memory_allocated``. Step time is the median of real steps.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from ..capture.calls import call_inputs, check_differentiable
from ..capture.fake import needs_fake
from ..capture.state import preserved_state
from ..capture.trace import default_loss_recipe
from ..rewrite import planned
from .compiled import allocator_rise
from .storage import StorageTracker, base_bytes, state_tensors

__all__ = ["Measurement", "OverBudgetWarning", "check_measurable", "measure", "measure_in_turns",
           "over_budget_warning", "warn_if_over_budget"]


class OverBudgetWarning(RuntimeWarning):
    """A plan that the solver said fits its budget measured a peak above it: a bug in the
    cost model or a solver, which we want reported with the saved schedule."""


def over_budget_warning(schedule: Any, measured_peak_bytes: int,
                        budget_bytes: int | None = None, *,
                        allocator_peak_bytes: int | None = None) -> str | None:
    """The warning text when ``schedule`` (a `Schedule` whose status says it fits: OPTIMAL or
    FEASIBLE) measured above its budget (``budget_bytes``, default the one stamped on it), by
    the tensors it counts (``measured_peak_bytes``) or by the allocator's count
    (``allocator_peak_bytes``, `Measurement.allocator_peak_bytes`); None when it did not, or
    when it claims nothing (a baseline's that missed)."""
    budget = schedule.budget_bytes if budget_bytes is None else budget_bytes
    held = allocator_peak_bytes or 0
    if (not isinstance(budget, int) or schedule.status not in ("OPTIMAL", "FEASIBLE")
            or max(measured_peak_bytes, held) <= budget):
        return None
    predicted = (schedule.estimate or {}).get("peak_bytes")
    if measured_peak_bytes <= budget:  # only the allocator's count is over
        scratch = held - measured_peak_bytes
        room = math.ceil(100 * scratch / budget) / 100  # the headroom that holds it
        return (f"a plan measured over its budget by the allocator's count: {held} bytes > "
                f"budget {budget} bytes, while its tensors peak at {measured_peak_bytes} "
                f"bytes (predicted {predicted} bytes). The {scratch} bytes between are memory "
                "outside the tensors: what kernels allocate and free inside themselves "
                "(scratch, workspaces), which a real profile counts but a fake one cannot, "
                "or a different thread count than the profile's (oneDNN sizes scratch per "
                "thread); and on CPU, the RNG state each random region's checkpoint keeps "
                "(about 5 KB a region, held back from the budget by `solve_graph`, not by a "
                f"schedule made otherwise). Leave room for them: solve with headroom={room:.2f} "
                "or more")
    return (f"a plan measured over its budget: measured peak {measured_peak_bytes} bytes > "
            f"budget {budget} bytes (predicted {predicted} bytes; solver {schedule.solver!r}, "
            f"{len(schedule.regions)} regions, {len(schedule.recompute_regions)} recomputed). "
            "This is a bug in the cost model or the solver: please report it with the saved "
            "schedule (plan.save('schedule.json')) and the profiled graph (graph.save)")


def warn_if_over_budget(schedule: Any, measured_peak_bytes: int,
                        budget_bytes: int | None = None, *, stacklevel: int = 3,
                        allocator_peak_bytes: int | None = None) -> bool:
    """Warn `OverBudgetWarning` with `over_budget_warning`'s text, if any; whether it did."""
    text = over_budget_warning(schedule, measured_peak_bytes, budget_bytes,
                               allocator_peak_bytes=allocator_peak_bytes)
    if text is not None:
        warnings.warn(text, OverBudgetWarning, stacklevel=stacklevel)
    return text is not None


@dataclass(frozen=True)
class Measurement:
    """One measured training step (forward, loss, backward)."""

    peak_bytes: int  # peak of live tensor memory over the step, base included
    base_bytes: int  # alive before the step: parameters, buffers, inputs
    step_s: float  # median wall time of a step
    step_s_all: tuple[float, ...]  # every timed step
    loss: float
    device: str
    # the allocator's own count of the step's peak, base included: on CPU from the profiler's
    # memory events over one more step (`compiled.allocator_rise`), which also sees what
    # kernels allocate and free inside themselves (convolution scratch); on CUDA the same as
    # ``peak_bytes``. None where it was not taken (``measure(..., allocator=False)``).
    allocator_peak_bytes: int | None = None
    # with ``measure(..., timeline=True)`` on CPU: live bytes after every allocation and free
    # of the tracked step, base included (empty otherwise)
    timeline: tuple[int, ...] = field(default=(), repr=False, compare=False)
    timeline_backward_at: int = field(default=0, repr=False, compare=False)  # its first index
    # in backward

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("timeline")
        d.pop("timeline_backward_at")
        return d


def check_measurable(module: nn.Module, inputs: tuple[Any, ...]) -> None:
    """Raise ValueError, naming why, when ``module`` cannot run a real step on ``inputs``
    (meta parameters, ``(shape, dtype)`` specs: `fake.needs_fake`)."""
    why_not = needs_fake(inputs, module)
    if why_not:
        raise ValueError(f"measuring runs real training steps, but {why_not}; give real "
                         "tensors and a model with real parameters, or plan it without "
                         "measuring (profile/solve with mode='fake', compare with "
                         "measure=False)")


def measure(module: nn.Module, example_inputs: Sequence[Any] | Mapping[str, Any], *,
            loss_fn: Callable[[Any], torch.Tensor] | None = None, repeats: int = 5,
            warmup: int = 1, timeline: bool = False, allocator: bool = True) -> Measurement:
    """Run real training steps of ``module`` and measure peak memory and step time.

    One step is ``loss_fn(module(*inputs)).backward()`` with gradients starting at ``None``.
    The module's state (buffers, ``.grad``, RNG) is restored afterwards.

    Args:
        module: any module, e.g. a checkpointed one from `scheduler.apply`; its default
            ``loss_fn`` is the one it was traced with, else `trace.default_loss_recipe`.
        example_inputs: positional inputs, or a mapping of keyword inputs.
        loss_fn: ``loss_fn(output) -> scalar``.
        repeats: timed steps (the median is reported).
        warmup: untimed steps first.
        timeline: on CPU, also record the live bytes after every allocation and free of the
            tracked step (`Measurement.timeline`, for `report.plot_timeline`).
        allocator: on CPU, also count the allocator's peak over one more step, under the
            profiler (`Measurement.allocator_peak_bytes`).

    Returns:
        `Measurement`. On CPU the peak comes from `StorageTracker` (a separate, untimed step);
        on CUDA from ``torch.cuda.max_memory_allocated``.

    Warns:
        OverBudgetWarning: ``module`` is a plan's (it carries its schedule) whose schedule
            said it fits its budget, and the measured peak exceeds that budget.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    inputs = call_inputs(module, example_inputs)
    check_measurable(module, inputs)
    check_differentiable(module, inputs)
    # (a planned module's loss is on what runs its plan, `rewrite.planned`)
    loss_fn = (loss_fn or getattr(module, "loss_fn", None)
               or getattr(planned(module), "loss_fn", None))
    params = list(module.parameters())
    device = params[0].device if params else torch.device("cpu")

    trace: list[int] = []
    backward_at = [0]

    def step() -> torch.Tensor:
        for p in params:
            p.grad = None
        out = module(*inputs)
        fn = loss_fn or default_loss_recipe(out)
        loss = fn(out)
        del out
        backward_at[0] = len(trace)
        loss.backward()
        return loss.detach()

    with preserved_state(module):
        for _ in range(warmup):
            step()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        for p in params:
            p.grad = None
        base = base_bytes(module, inputs)
        # each measured step starts from an empty autocast cache: the casts of parameters
        # that the steps before left there are memory this step holds too, which neither
        # count would see (as `capture.record` does)
        torch.clear_autocast_cache()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device)
            loss = step()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - start + base
            held = peak
        else:
            trace.clear()
            active = [timeline]

            def record(_key: int, _nbytes: int) -> None:
                if active[0]:  # frees after the step (weak references) are not part of it
                    trace.append(tracker.current_bytes)

            tracker = StorageTracker(on_alloc=record, on_free=record)
            for t in state_tensors(module, inputs):
                tracker.register(t)
            with tracker:
                loss = step()
            active[0] = False
            peak = tracker.peak_bytes
            split = backward_at[0]  # (the step below sets it again)
            for p in params:  # (freed inside the profiled step, they were allocated before
                p.grad = None  # it: c10 warns of such frees on stderr)
            torch.clear_autocast_cache()
            held = allocator_rise(step, device) + base if allocator else None
        for p in params:
            p.grad = None
    schedule = getattr(module, "schedule", None) or getattr(planned(module), "schedule", None)
    if schedule is not None and hasattr(schedule, "regions"):
        warn_if_over_budget(schedule, int(peak), allocator_peak_bytes=held)
    return Measurement(peak_bytes=int(peak), base_bytes=base, allocator_peak_bytes=held,
                       step_s=statistics.median(times), step_s_all=tuple(times),
                       loss=float(loss), device=str(device),
                       timeline=tuple(trace) if device.type != "cuda" else (),
                       timeline_backward_at=split if device.type != "cuda" else 0)


def measure_in_turns(cases: dict[Any, tuple[nn.Module, Sequence[Any]]], *, repeats: int,
                     loss_fn: Callable[[Any], torch.Tensor] | None = None,
                     step: Callable[..., None] | None = None) -> dict[Any, Measurement]:
    """Measure each ``(module, inputs)`` case in ``repeats`` rounds of one timed step each, so
    that a burst of load from elsewhere on the machine slows all of them alike rather than one:
    each case's step time is the median over its rounds, its peak the largest (on CPU every
    round's peak is the same). ``step(description)`` and ``step(advance=1)`` report progress."""
    runs: dict[Any, list[Measurement]] = {key: [] for key in cases}
    for i in range(repeats):
        for j, (key, (module, inputs)) in enumerate(cases.items()):
            if step is not None:
                step(f"measuring: round {i + 1}/{repeats}, case {j + 1}/{len(cases)}")
            runs[key].append(measure(module, inputs, loss_fn=loss_fn, repeats=1,
                                     warmup=int(i == 0), allocator=i == 0))
            if step is not None:
                step(advance=1)
    out = {}
    for key, ms in runs.items():
        times = tuple(t for m in ms for t in m.step_s_all)
        out[key] = replace(ms[0], peak_bytes=max(m.peak_bytes for m in ms),
                           step_s=statistics.median(times), step_s_all=times)
    return out
