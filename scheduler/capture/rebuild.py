"""Real tensors for what a fake step recorded, and what the fake profile's node times share.

`materialize` turns a `record.TensorMeta` (shape, strides, dtype, ``requires_grad``) into a
real tensor with harmless values from a local ``torch.Generator`` (the user's RNG is never
drawn from); `on_device` puts a model's or the user's tensor where nodes run. `local_spec`
and `work_s` weigh ops against each other by their roofline time (`roofline`), and `kept`
restores everything a real run of nodes may change.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from .fake import FakeProfileError
from .record import TensorMeta
from .roofline import local_spec, work_s
from .state import preserved_state

__all__ = ["check_runnable", "contiguous_stride", "kept", "local_spec", "materialize",
           "on_device", "work_s"]


def check_runnable(device: torch.device, times: str) -> None:
    """Raise `FakeProfileError` when nodes cannot run for real on ``device`` here."""
    if device.type == "meta" or (device.type == "cuda" and not torch.cuda.is_available()):
        raise FakeProfileError(
            f"times={times!r} runs nodes for real on {device}, which this machine cannot run "
            f"on; use times='roofline' (with device_spec=..., no run at all), or profile on a "
            f"machine that has the device")


@contextlib.contextmanager
def kept(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Restore the model's buffers and ``.grad`` and the RNG states (`state.preserved_state`),
    and ``device``'s CUDA RNG, on exit."""
    cuda = [device] if device.type == "cuda" else []
    with preserved_state(model), torch.random.fork_rng(devices=cuda):
        yield


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


def _storage_numel(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    if any(d == 0 for d in shape):
        return 0
    return 1 + sum((d - 1) * s for d, s in zip(shape, stride))


def materialize(meta: TensorMeta, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """A real tensor of ``meta``'s shape, strides and dtype on ``device``: floating point
    filled with small random values from ``gen`` (uniform in [-0.1, 0.1]), everything else
    zeros (valid indices for embedding and gather, all-false masks); a leaf that requires
    grad when ``meta`` did. Overlapping strides (an expanded tensor) share their storage as
    the recorded tensor did."""
    flat = torch.empty(_storage_numel(meta.shape, meta.stride), dtype=meta.dtype, device=device)
    if flat.is_floating_point():
        flat.uniform_(-0.1, 0.1, generator=gen)
    else:
        flat.zero_()
    t = flat.as_strided(meta.shape, meta.stride).detach()
    return t.requires_grad_() if meta.requires_grad else t


def on_device(t: torch.Tensor, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """``t`` itself when it is a real tensor on ``device``; else a copy there (a real tensor
    on another device) or a rebuilt one (`materialize`, for a meta or fake tensor), a leaf
    with ``t``'s ``requires_grad``."""
    if is_fake(t) or t.device.type == "meta":
        return materialize(TensorMeta.of(t), device, gen)
    if t.device.type == device.type and (device.index is None or t.device.index == device.index):
        return t
    return t.detach().to(device).requires_grad_(t.requires_grad)
