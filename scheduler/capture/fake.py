"""Profiling without allocating: a training step run under fake tensors.

`FakeStep` holds one ``torch._subclasses.FakeTensorMode`` and, while `FakeStep.active`, puts
fake stand-ins in place of a model's parameters and buffers (restored on exit): tensors with
the real ones' shapes, strides, storage offsets, dtypes and ``requires_grad``, on the device
being planned for, that carry no data; tensors that share a storage share its fake, of the
same bytes (tied weights, parameters carved from one buffer, inputs sliced from one batch).
Every op then runs on metadata only, through the same dispatch modes, saved-tensor hooks and
autograd graph as a real step, so `capture.profile`'s recorder sees the same storages, saved
tensors and backward steps without allocating any of them.

Inputs may be real tensors, tensors on the ``meta`` device, or ``(shape, dtype)`` specs
(`is_spec`); `FakeStep.inputs` turns each into a fake tensor on the device.

What fake tensors cannot follow: an op whose output shape or value depends on tensor data
(``nonzero``, ``unique``, boolean-mask indexing, ``.item()``), an op without a fake-tensor
kernel (a custom op with no ``register_fake``), reading a tensor's data (``.numpy()``). Such a
step raises `FakeProfileError` (`fake_failure`), naming the op and the line of the model, with
the way out (``mode="real"``). A model that raises on the example inputs themselves (a wrong
shape or dtype) raises `RejectedInputsError` instead (`rejected_inputs`), real or fake.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Mapping
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.utils import _pytree as pytree

from .usercode import first_line, where

__all__ = ["FakeProfileError", "FakeStep", "RejectedInputsError",
           "check_not_meta", "fake_failure", "is_spec", "needs_fake", "parse_device",
           "rejected_inputs", "rounded_bytes", "spec_of", "specs_as_meta"]

#: what the CUDA caching allocator rounds every block up to (``kMinBlockSize``): the bytes
#: ``torch.cuda.memory_allocated`` counts for a storage
CUDA_BLOCK = 512


class FakeProfileError(ValueError):
    """A step cannot be profiled under fake tensors (an op they cannot follow, a device this
    build cannot fake); the message names the op or device and the fix."""


class RejectedInputsError(ValueError):
    """The model raised on the example inputs (a shape or dtype its forward does not take);
    the message names the inputs, the error and the line of the model."""


def is_spec(x: Any) -> bool:
    """Whether ``x`` is an input given as ``(shape, dtype)``: a tuple of a shape (a tuple,
    list or ``torch.Size`` of ints) and a ``torch.dtype``."""
    return (isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.dtype)
            and isinstance(x[0], (tuple, list, torch.Size))
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in x[0]))


def spec_of(x: Any) -> Any:
    """``x`` with a ``(shape, dtype)`` spec turned into a meta tensor (anything else as is)."""
    if is_spec(x):
        return torch.empty(tuple(x[0]), dtype=x[1], device="meta")
    return x


def specs_as_meta(example_inputs: Any) -> Any:
    """``(shape, dtype)`` specs among the top-level example inputs (positional, or a mapping's
    values) as meta tensors (`spec_of`); anything else as is."""
    if isinstance(example_inputs, Mapping):
        return {k: spec_of(v) for k, v in example_inputs.items()}
    if is_spec(example_inputs):
        return (spec_of(example_inputs),)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(spec_of(x) for x in example_inputs)
    return example_inputs


def needs_fake(inputs: Any, model: nn.Module | None = None) -> str:
    """Why this step can only be profiled under fake tensors ("" when it can run): an input
    that is a meta tensor or a spec (named by its place in ``inputs``, the example inputs as
    given: ``example_inputs['labels']``), or a parameter or buffer of ``model`` on the meta
    device."""
    for path, x in pytree.tree_flatten_with_path(inputs, is_leaf=is_spec)[0]:
        x = spec_of(x)
        if isinstance(x, torch.Tensor) and x.device.type == "meta":
            return (f"example_inputs{pytree.keystr(path)} is a meta tensor or a (shape, "
                    f"dtype) spec ({_describe(x)})")
    if model is not None:
        for kind, named in (("parameter", model.named_parameters()),
                            ("buffer", model.named_buffers())):
            for name, t in named:
                if t.device.type == "meta":
                    return (f"{type(model).__name__}'s {kind} {name!r} is on the meta device "
                            f"({_describe(t)})")
    return ""


def rounded_bytes(nbytes: int, device: torch.device) -> int:
    """The bytes a storage of ``nbytes`` takes on ``device``: CUDA's caching allocator rounds
    every block up to a multiple of 512 bytes; other devices count the storage's own size."""
    if device.type == "cuda":
        return int(math.ceil(nbytes / CUDA_BLOCK) * CUDA_BLOCK)
    return nbytes


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


class FakeStep:
    """A fake-tensor mode for one model and device (see the module docstring).

    Args:
        device: the device planned for; default: that of the model's first parameter (or
            ``cpu`` for a model on ``meta`` or without parameters).

    Raises:
        FakeProfileError: the device's type is one this PyTorch build cannot run autograd
            for, even on fake tensors (CUDA on a CPU-only build).
        ValueError: ``device`` is not a device (`parse_device`).
    """

    def __init__(self, model: nn.Module, device: str | torch.device | None = None):
        if device is None:
            p = next(iter(model.parameters()), None)
            device = p.device if p is not None and p.device.type != "meta" else "cpu"
        self.device = parse_device(device)
        _check_device(self.device)
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._fakes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(real) -> (real, fake)
        # id(real storage) -> (real storage, its fake): tensors that share a storage (tied
        # weights, parameters carved from one flat buffer, inputs sliced from one batch)
        # share its fake, of the same size, so that it is counted once and whole, as for real
        self._storages: dict[int, tuple[Any, Any]] = {}

    def fake(self, t: torch.Tensor) -> torch.Tensor:
        """The fake stand-in of ``t`` (one per tensor object): same shape, strides, storage
        offset, dtype and ``requires_grad``, on `device`, in the fake of ``t``'s storage (of
        the same bytes); a ``nn.Parameter`` for a parameter."""
        got = self._fakes.get(id(t))
        if got is not None and got[0] is t:
            return got[1]
        real_storage = t.untyped_storage()
        shared = self._storages.get(id(real_storage))
        with self.mode:
            if shared is None or shared[0] is not real_storage:
                shared = (real_storage, torch.empty(real_storage.nbytes(), dtype=torch.uint8,
                                                    device=self.device).untyped_storage())
                self._storages[id(real_storage)] = shared
            f = torch.empty(0, dtype=t.dtype, device=self.device).set_(
                shared[1], t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if isinstance(t, nn.Parameter):
            f = nn.Parameter(f, requires_grad=t.requires_grad)
        elif t.requires_grad:
            f.requires_grad_(True)
        self._fakes[id(t)] = (t, f)
        return f

    def inputs(self, inputs: Sequence[Any]) -> tuple[Any, ...]:
        """``inputs`` with every tensor (real or meta) and every ``(shape, dtype)`` spec made a
        fake tensor on `device`."""
        leaves, spec = pytree.tree_flatten(tuple(spec_of(x) for x in inputs))
        return pytree.tree_unflatten(
            [self.fake(x) if isinstance(x, torch.Tensor) else x for x in leaves], spec)

    @contextlib.contextmanager
    def active(self, *modules: nn.Module) -> Iterator[None]:
        """Run under the fake mode with the parameters and buffers of ``modules`` (and of all
        their submodules) replaced by their fakes; everything is put back on exit."""
        with self.swapped(*modules), self.mode, _named_failures(), _quiet_meta_failures():
            yield

    @contextlib.contextmanager
    def swapped(self, *modules: nn.Module) -> Iterator[None]:
        """The parameters and buffers of ``modules`` (and of all their submodules) replaced by
        their fakes, outside the fake mode (what ``torch.export`` traces with: it enters the
        fake mode of its inputs itself); everything is put back on exit."""
        swapped: list[tuple[dict[str, Any], str, Any]] = []
        try:
            for m in _unique_modules(modules):
                for d in (m._parameters, m._buffers):
                    for name, t in list(d.items()):
                        if isinstance(t, torch.Tensor):
                            swapped.append((d, name, t))
                            d[name] = self.fake(t)
            yield
        finally:
            for d, name, t in reversed(swapped):
                d[name] = t

    def put_back(self, module: nn.Module) -> None:
        """Replace every fake of this step among the parameters and buffers of ``module`` (and
        its submodules) by the real tensor it stands for: a graph ``torch.export`` traced
        under `swapped` holds the fakes, and must hold the model's own tensors."""
        real_of = {id(f): real for real, f in self._fakes.values()}
        for m in module.modules():
            for d in (m._parameters, m._buffers):
                for name, t in list(d.items()):
                    if id(t) in real_of:
                        d[name] = real_of[id(t)]


def _unique_modules(modules: Iterable[nn.Module]) -> list[nn.Module]:
    seen: dict[int, nn.Module] = {}
    for root in modules:
        for m in root.modules():
            seen.setdefault(id(m), m)
    return list(seen.values())


def parse_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``.

    Raises:
        ValueError: it names no device type PyTorch knows (the message names it)."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a device ({first_line(e, 300)}); give e.g. "
                         f"'cpu', 'cuda' or 'cuda:1'") from None


def check_not_meta(device: str | torch.device | None) -> None:
    """Refuse ``device="meta"`` as the device to plan for: meta tensors have no storage, so a
    step on them has no memory to count (a model *on* the meta device is fine: it is planned
    for a real device under fake tensors).

    Raises:
        FakeProfileError: ``device`` is the meta device (the message names the way out).
        ValueError: ``device`` is not a device (`parse_device`).
    """
    if device is not None and parse_device(device).type == "meta":
        raise FakeProfileError(
            f"device={str(device)!r} is not a device to plan for: meta tensors have no storage, "
            f"so a step on them has no memory to count; pass the device the model will train "
            f"on (device='cpu' or 'cuda'). A model built on the meta device is planned for "
            f"that device with mode='fake' (or 'auto')")


def _check_device(device: torch.device) -> None:
    check_not_meta(device)
    if device.type == "cuda" and torch.version.cuda is None and torch.version.hip is None:
        raise FakeProfileError(
            f"cannot plan for device {device} here: this PyTorch build ({torch.__version__}) "
            f"has no CUDA support, and autograd needs it even for fake CUDA tensors; install a "
            f"CUDA build of PyTorch (no GPU is needed for a fake profile), or plan for "
            f"device='cpu'")
    if device.type not in ("cpu", "cuda"):
        raise FakeProfileError(
            f"cannot plan for device {device} under fake tensors (only cpu and cuda are "
            f"supported); profile on the device itself with mode='real'")


#: user-facing names of the ops fake tensors most often stop at
_OP_NAMES = {
    "_local_scalar_dense": "Tensor.item() (also .tolist(), int(t), float(t), bool(t), "
                           "`if t:` on a tensor)",
    "nonzero": "torch.nonzero (also indexing with a boolean mask)",
    "masked_select": "torch.masked_select (also indexing with a boolean mask)",
    "_unique2": "torch.unique",
    "unique_dim": "torch.unique",
    "unique_consecutive": "torch.unique_consecutive",
    "bincount": "torch.bincount",
    "repeat_interleave": "torch.repeat_interleave with tensor repeats",
}


#: words of the errors fake tensors raise on what they cannot do (lower case)
_FAKE_WORDS = ("meta tensor", "faketensor", "fake tensor", "fake impl", "register_fake",
               "tensor subclass", "'meta' backend")


def _op_name(op: Any) -> str:
    if op is None:
        return "an op"
    base = getattr(op, "_overloadpacket", op)
    base = str(getattr(base, "__name__", base)).split(".")[-1]
    known = _OP_NAMES.get(base)
    return f"{known} [{op}]" if known else str(op)


def fake_failure(e: BaseException) -> FakeProfileError | None:
    """A `FakeProfileError` for an exception fake tensors raise on an op they cannot run
    (None for other exceptions): one line naming the op, the line of the model that ran it
    (`usercode.where`) and the way out."""
    if isinstance(e, FakeProfileError):
        return e
    if isinstance(e, RejectedInputsError):
        return None
    at = where(e)
    real = "profile with mode='real' (on inputs that fit the device)"
    if isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)):
        return FakeProfileError(
            f"{_op_name(getattr(e, 'func', None))}{at} has an output whose shape or value "
            f"depends on tensor data, which fake tensors cannot follow; {real}, or make the "
            f"model free of it (torch.where or a multiplication by a mask instead of boolean "
            f"indexing, no .item() in forward)")
    if isinstance(e, UnsupportedOperatorException):
        return FakeProfileError(
            f"{_op_name(getattr(e, 'func', None) or (e.args[0] if e.args else None))}{at} has "
            f"no fake-tensor kernel; {real}, or register one (torch.library.register_fake)")
    if isinstance(e, UnsupportedFakeTensorException):
        return FakeProfileError(f"fake tensors cannot run this step: {first_line(e, 300)}{at}; "
                                f"{real}")
    msg = str(e).lower()
    if any(k in msg for k in _FAKE_WORDS):
        return FakeProfileError(
            f"fake tensors cannot run this step: {first_line(e, 300)}{at}; {real}")
    return None


def rejected_inputs(e: BaseException, model: nn.Module, inputs: Sequence[Any], *,
                    fake: bool = False) -> RejectedInputsError | None:
    """A `RejectedInputsError` for an exception ``model`` raised running on ``inputs`` (its
    first forward, in `trace`): an error of the kind shape and dtype checks raise
    (``RuntimeError``, ``ValueError``, ``IndexError``, ``TypeError``) from the model's code;
    None for anything else (fake tensors' own limits, `fake_failure`; running out of
    memory; errors raised outside the model). ``fake``: the inputs were fake tensors."""
    if (not isinstance(e, (RuntimeError, ValueError, IndexError, TypeError))
            or isinstance(e, (FakeProfileError, torch.OutOfMemoryError))
            or fake_failure(e) is not None):
        return None
    msg = str(e)
    if "out of memory" in msg or "can't allocate memory" in msg:
        return None
    at = where(e)
    if not at:
        return None
    name = type(model).__name__
    shapes = " ".join(_describe(t) if isinstance(t, torch.Tensor) else type(t).__name__
                      for t in pytree.tree_leaves(tuple(inputs)))
    hint = (" (found running on fake tensors: if the real model takes these inputs, profile "
            "with mode='real')" if fake else "")
    return RejectedInputsError(
        f"{name} rejects the example inputs {shapes}: {first_line(e, 300)}{at}; give inputs of "
        f"the shapes and dtypes {name}.forward takes{hint}")


@contextlib.contextmanager
def _named_failures() -> Iterator[None]:
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised as is unless fake tensors caused it
        named = fake_failure(e)
        if named is None or named is e:
            raise
        raise named from e


class _DropMetaFailures(logging.Filter):
    """Drops fake tensors' log of an op whose meta kernel raised: the exception itself
    reaches the caller, named (`fake_failure`, `rejected_inputs`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")


@contextlib.contextmanager
def _quiet_meta_failures() -> Iterator[None]:
    log = logging.getLogger("torch._subclasses.fake_tensor")
    drop = _DropMetaFailures()
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)
