"""Profiling without allocating: a training step run under fake tensors.

`FakeStep` holds one ``torch._subclasses.FakeTensorMode`` and, while `FakeStep.active`, puts
fake stand-ins in place of a model's parameters and buffers (restored on exit): tensors with
the real ones' shapes, strides, dtypes and ``requires_grad``, on the device being planned
for, that carry no data. Every op then runs on metadata only, through the same dispatch
modes, saved-tensor hooks and autograd graph as a real step, so `capture.profile`'s recorder
sees the same storages, saved tensors and backward steps without allocating any of them.

Inputs may be real tensors, tensors on the ``meta`` device, or ``(shape, dtype)`` specs
(`is_spec`); `FakeStep.inputs` turns each into a fake tensor on the device.

What fake tensors cannot follow: an op whose output shape depends on tensor values
(``nonzero``, ``unique``, boolean-mask indexing, ``.item()`` in Python control flow). Such a
step raises `FakeProfileError`, naming the op, with the way out (``mode="real"``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FakeProfileError", "FakeStep", "OpCounter", "fake_failure", "free_bytes", "is_spec",
           "needs_fake", "rounded_bytes", "spec_of"]

#: what the CUDA caching allocator rounds every block up to (``kMinBlockSize``): the bytes
#: ``torch.cuda.memory_allocated`` counts for a storage
CUDA_BLOCK = 512


class FakeProfileError(ValueError):
    """A step cannot be profiled under fake tensors (an op they cannot follow, a device this
    build cannot fake); the message names the op or device and the fix."""


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


def needs_fake(inputs: Sequence[Any]) -> str:
    """Why these inputs can only be profiled under fake tensors ("" when they can run): a
    meta tensor or a spec among them."""
    for x in pytree.tree_leaves(tuple(inputs)):
        if isinstance(x, torch.Tensor) and x.device.type == "meta":
            return f"an input is on the meta device ({_describe(x)})"
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
    """

    def __init__(self, model: nn.Module, device: str | torch.device | None = None):
        if device is None:
            p = next(iter(model.parameters()), None)
            device = p.device if p is not None and p.device.type != "meta" else "cpu"
        self.device = torch.device(device)
        _check_device(self.device)
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._fakes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(real) -> (real, fake)

    def fake(self, t: torch.Tensor) -> torch.Tensor:
        """The fake stand-in of ``t`` (one per tensor object): same shape, strides, dtype and
        ``requires_grad``, on `device`; a ``nn.Parameter`` for a parameter."""
        got = self._fakes.get(id(t))
        if got is not None and got[0] is t:
            return got[1]
        with self.mode:
            f = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype,
                                    device=self.device)
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
        swapped: list[tuple[dict[str, Any], str, Any]] = []
        try:
            for m in _unique_modules(modules):
                for d in (m._parameters, m._buffers):
                    for name, t in list(d.items()):
                        if isinstance(t, torch.Tensor):
                            swapped.append((d, name, t))
                            d[name] = self.fake(t)
            with self.mode, _named_failures():
                yield
        finally:
            for d, name, t in reversed(swapped):
                d[name] = t


def _unique_modules(modules: Iterable[nn.Module]) -> list[nn.Module]:
    seen: dict[int, nn.Module] = {}
    for root in modules:
        for m in root.modules():
            seen.setdefault(id(m), m)
    return list(seen.values())


def _check_device(device: torch.device) -> None:
    if device.type == "cuda" and torch.version.cuda is None and torch.version.hip is None:
        raise FakeProfileError(
            f"cannot plan for device {device} here: this PyTorch build ({torch.__version__}) "
            f"has no CUDA support, and autograd needs it even for fake CUDA tensors; install a "
            f"CUDA build of PyTorch (no GPU is needed for a fake profile), or plan for "
            f"device='cpu'")
    if device.type not in ("cpu", "cuda", "meta"):
        raise FakeProfileError(
            f"cannot plan for device {device} under fake tensors (only cpu and cuda are "
            f"supported); profile on the device itself with mode='real'")


def fake_failure(e: BaseException) -> FakeProfileError | None:
    """A `FakeProfileError` for an exception fake tensors raise on an op they cannot run
    (None for other exceptions)."""
    if isinstance(e, FakeProfileError):
        return e
    if isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)):
        op = getattr(e, "func", None)
        return FakeProfileError(
            f"{op or 'an op'} has an output whose shape or value depends on tensor data, which "
            f"fake tensors cannot follow; profile with mode='real' (on inputs that fit the "
            f"device), or make the model free of it (e.g. torch.where instead of boolean "
            f"indexing, no .item() in forward)")
    msg = str(e)
    if "meta tensor" in msg or "FakeTensor" in msg or "fake tensor" in msg.lower():
        first = msg.strip().splitlines()[0] if msg.strip() else type(e).__name__
        return FakeProfileError(
            f"fake tensors cannot run this step: {type(e).__name__}: {first[:300]}; profile "
            f"with mode='real' (on inputs that fit the device)")
    return None


@contextlib.contextmanager
def _named_failures() -> Iterator[None]:
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised as is unless fake tensors caused it
        named = fake_failure(e)
        if named is None or named is e:
            raise
        raise named from e


class OpCounter(TorchDispatchMode):
    """Counts each op's floating-point operations (``torch.utils.flop_counter``'s formulas:
    matmuls, convolutions, attention) and the bytes it reads and writes (its tensor inputs
    and outputs, each storage once), and passes them to ``on_op(flops, nbytes, half)``, where
    ``half`` says whether it works in half precision (a bf16/fp16 tensor among its inputs and
    outputs). Works on fake tensors: only shapes are read."""

    def __init__(self, on_op: Any):
        super().__init__()
        from torch.utils.flop_counter import flop_registry
        self.registry = flop_registry
        self.on_op = on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops = 0
        count = self.registry.get(func._overloadpacket)
        if count is not None:
            try:
                flops = int(count(*args, **kwargs, out_val=out))
            except Exception:  # noqa: BLE001 - a formula that does not fit this overload
                flops = 0
        seen: set[int] = set()
        nbytes = 0
        half = False
        for t in pytree.tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                half = half or t.dtype in (torch.float16, torch.bfloat16)
                k = id(t)
                if k not in seen:
                    seen.add(k)
                    nbytes += t.numel() * t.element_size()
        self.on_op(flops, nbytes, half)
        return out


def free_bytes(device: torch.device) -> int | None:
    """Memory free for a step on ``device`` right now: CUDA's free device memory, or the
    machine's available memory (``MemAvailable``) for the CPU; None where it is not known."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            import os
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None
