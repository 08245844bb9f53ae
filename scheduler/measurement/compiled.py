"""Peak memory of a training step of a compiled module (``torch.compile``), from the profiler.

`scheduler.measure` counts storages with a ``TorchDispatchMode``; dynamo skips every frame
that runs under such a mode, so what it measures of a compiled module is the module run
eagerly. `compiled_peak` instead reads the allocator's own record: the ``[memory]`` events of
``torch.profiler.profile(profile_memory=True)`` over one step after the warm-up steps (which
compile), summed in time order; the peak of that running total, plus `storage.base_bytes`
(parameters, buffers, inputs, alive before the step), is the step's peak.

What it sees: every allocation and free through c10's allocator on the module's device
(CPU: eager kernels and inductor's ``empty_strided`` buffers alike; CUDA: the caching
allocator's tensor allocations), including memory a kernel allocates and frees inside
itself, which `storage.StorageTracker` does not see. It does not see memory outside that
allocator (inductor's C++ scratch from ``malloc``, the profiler's own bookkeeping), nor
gradients that existed before the step (every parameter's ``.grad`` starts at None).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

from ..capture.calls import as_tuple
from ..capture.state import preserved_state
from ..capture.trace import default_loss_recipe
from ..rewrite import planned
from .storage import base_bytes

__all__ = ["allocator_rise", "compiled_peak", "memory_timeline"]


def compiled_peak(module: nn.Module, example_inputs: Sequence[Any] | Mapping[str, Any], *,
                  loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  warmup: int = 2) -> int:
    """Peak bytes of one training step ``loss_fn(module(*inputs)).backward()`` (gradients
    starting at None), base included; the module's buffers, ``.grad`` and RNG are restored.

    Args:
        module: any module, typically ``torch.compile(plan.module)``; its default ``loss_fn``
            is the planned module's (`rewrite.PlanForward.loss_fn`), else
            `trace.default_loss_recipe`.
        example_inputs: positional inputs, or a mapping of keyword inputs (passed as keywords).
        warmup: steps run first, unmeasured (compilation, then one compiled step).
    """
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (the first step compiles), got {warmup}")
    if isinstance(example_inputs, Mapping):
        args, kwargs = (), dict(example_inputs)
    else:
        args, kwargs = as_tuple(example_inputs), {}
    inner = getattr(module, "_orig_mod", module)  # (torch.compile's wrapper holds the module)
    loss_fn = loss_fn or getattr(planned(inner), "loss_fn", None)
    params = list(module.parameters())
    device = params[0].device if params else torch.device("cpu")

    def step() -> None:
        for p in params:
            p.grad = None
        out = module(*args, **kwargs)
        loss = (loss_fn or default_loss_recipe(out))(out)
        del out
        loss.backward()

    with preserved_state(inner):
        for _ in range(warmup):
            step()
        for p in params:
            p.grad = None
        base = base_bytes(inner, (*args, *kwargs.values()))
        rise = allocator_rise(step, device)
        for p in params:
            p.grad = None
    return base + rise


def allocator_rise(step: Callable[[], Any], device: torch.device) -> int:
    """The most bytes c10's allocator on ``device`` held during ``step()`` above what it held
    before: the running total of ``torch.profiler``'s ``[memory]`` events over the step, in
    time order, at its highest. It counts what kernels allocate and free inside themselves
    (convolution scratch), which no tensor-level count sees."""
    current = peak = 0
    for _, nbytes in memory_timeline(step, device)[0]:
        current += nbytes
        peak = max(peak, current)
    return peak


def memory_timeline(step: Callable[[], Any], device: torch.device, *, ranges: str = ""
                    ) -> tuple[list[tuple[int, int]], list[tuple[str, int, int]]]:
    """Run ``step()`` under ``torch.profiler`` with memory events on: the allocator's events
    on ``device`` as ``(start_ns, bytes)`` (negative for a free) in time order, and, where
    ``ranges`` is given, the ``record_function`` ranges whose names start with it as
    ``(name, start_ns, end_ns)`` in time order (marks the step made, on the same clock)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if device.type == "cuda" else [])
    prof = profile(activities=activities, profile_memory=True)
    with _quiet_stderr():  # (kineto prints a line to fd 2 as it starts and as it stops)
        prof.__enter__()
    try:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    kind = "CUDA" if device.type == "cuda" else "CPU"
    memory, marks = [], []
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if name == "[memory]":
            if e.device_type().name == kind:
                memory.append((e.start_ns(), e.nbytes()))
        elif ranges and name.startswith(ranges):
            marks.append((name, e.start_ns(), e.end_ns()))
    memory.sort(key=lambda m: m[0])
    marks.sort(key=lambda m: m[1])
    return memory, marks


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 pointed at the null device for the block (C++ code writes there
    directly, past ``sys.stderr``)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
