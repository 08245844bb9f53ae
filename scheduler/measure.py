"""Measured peak memory and step time of one training step.

On CPU, PyTorch keeps no allocator statistics, so `StorageTracker` counts live tensor
storages itself: a ``TorchDispatchMode`` sees every op's outputs (forward, backward and
recompute), registers each new storage once with a weak reference, and subtracts it when the
storage dies. Views and in-place results share their base's storage and count once. Memory an op
allocates and frees inside its own kernel is invisible to it (CUDA measurement sees it).
On CUDA, `measure` uses ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Measurement", "StorageTracker", "measure"]


class StorageTracker(TorchDispatchMode):
    """Counts the bytes of live tensor storages while active (CPU peak-memory measurement).

    ``current_bytes``/``peak_bytes`` include the storages passed to `register` beforehand
    (parameters, inputs). ``on_alloc(storage_key, nbytes)`` and ``on_free(storage_key, nbytes)``
    callbacks, when given, see every new storage and every death, in order; the key is stable
    for the storage's lifetime.
    """

    def __init__(self, *, on_alloc: Callable[[int, int], None] | None = None,
                 on_free: Callable[[int, int], None] | None = None):
        super().__init__()
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self.on_alloc = on_alloc
        self.on_free = on_free

    def key(self, t: torch.Tensor) -> int:
        return id(t.untyped_storage())

    def register(self, t: torch.Tensor, *, notify: bool = False) -> bool:
        """Count ``t``'s storage if it is not counted yet; returns whether it was new."""
        st = t.untyped_storage()
        k = id(st)
        if k in self._live:
            return False
        n = st.nbytes()

        def _dead(_ref: weakref.ref, k: int = k, n: int = n) -> None:
            if self._live.pop(k, None) is not None:
                self.current_bytes -= n
                if self.on_free is not None:
                    self.on_free(k, n)

        self._live[k] = (weakref.ref(st, _dead), n)
        self.current_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        if notify and self.on_alloc is not None:
            self.on_alloc(k, n)
        return True

    def is_live(self, t: torch.Tensor) -> bool:
        return id(t.untyped_storage()) in self._live

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.register(t, notify=True)
        return out


@dataclass(frozen=True)
class Measurement:
    """One measured training step (forward, loss, backward)."""

    peak_bytes: int  # peak of live tensor memory over the step, base included
    base_bytes: int  # alive before the step: parameters, buffers, inputs
    step_s: float  # median wall time of a step
    step_s_all: tuple[float, ...]  # every timed step
    loss: float
    device: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure(module: nn.Module, example_inputs: Sequence[Any], *,
            loss_fn: Callable[[Any], torch.Tensor] | None = None, repeats: int = 5,
            warmup: int = 1) -> Measurement:
    """Run real training steps of ``module`` and measure peak memory and step time.

    One step is ``loss_fn(module(*inputs)).backward()`` with gradients starting at ``None``.
    The module's state (buffers, ``.grad``, RNG) is restored afterwards.

    Args:
        module: any module, e.g. a checkpointed one from `scheduler.apply`; its default
            ``loss_fn`` is the one it was traced with, else `trace.default_loss_recipe`.
        example_inputs: positional inputs.
        loss_fn: ``loss_fn(output) -> scalar``.
        repeats: timed steps (the median is reported).
        warmup: untimed steps first.

    Returns:
        `Measurement`. On CPU the peak comes from `StorageTracker` (a separate, untimed step);
        on CUDA from ``torch.cuda.max_memory_allocated``.
    """
    from .trace import _as_tuple, default_loss_recipe, preserved_state

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    inputs = _as_tuple(example_inputs)
    loss_fn = loss_fn or getattr(module, "loss_fn", None)
    params = list(module.parameters())
    device = params[0].device if params else torch.device("cpu")

    def step() -> torch.Tensor:
        for p in params:
            p.grad = None
        out = module(*inputs)
        fn = loss_fn or default_loss_recipe(out)
        loss = fn(out)
        del out
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
        base = _base_bytes(module, inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device)
            loss = step()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - start + base
        else:
            tracker = StorageTracker()
            for t in _state_tensors(module, inputs):
                tracker.register(t)
            with tracker:
                loss = step()
            peak = tracker.peak_bytes
        for p in params:
            p.grad = None
    return Measurement(peak_bytes=int(peak), base_bytes=base,
                       step_s=statistics.median(times), step_s_all=tuple(times),
                       loss=float(loss), device=str(device))


def _state_tensors(module: nn.Module, inputs: Sequence[Any]) -> list[torch.Tensor]:
    ts = [*module.parameters(), *module.buffers()]
    ts += [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    return ts


def _base_bytes(module: nn.Module, inputs: Sequence[Any]) -> int:
    """Bytes of the unique storages of parameters, buffers and tensor inputs."""
    seen: dict[int, int] = {}
    for t in _state_tensors(module, inputs):
        st = t.untyped_storage()
        seen[st.data_ptr() or id(st)] = st.nbytes()
    return sum(seen.values())
