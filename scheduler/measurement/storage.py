"""Live tensor storages, counted: the CPU's peak-memory measurement (PyTorch keeps no allocator
statistics there) and what `capture.profile` records a step with.

`StorageTracker` is a ``TorchDispatchMode`` that sees every op's outputs (forward, backward and
recompute), registers each new storage once with a weak reference, and subtracts it when the
storage dies. Views and in-place results share their base's storage and count once. Memory an
op allocates and frees inside its own kernel is invisible to it (CUDA measurement sees it).
Tensors on the meta device hold no memory and are not counted: no step is planned for it
(`capture.fake.check_not_meta`).
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["StorageTracker", "base_bytes", "free_bytes", "state_tensors", "sync_device"]


class StorageTracker(TorchDispatchMode):
    """Counts the bytes of live tensor storages while active (CPU peak-memory measurement).

    ``current_bytes``/``peak_bytes`` include the storages passed to `register` beforehand
    (parameters, inputs). ``on_alloc(storage_key, nbytes)`` and ``on_free(storage_key, nbytes)``
    callbacks, when given, see every new storage and every death, in order; the key is stable
    for the storage's lifetime. ``size(nbytes)``, when given, is what a storage of ``nbytes``
    counts for (e.g. `capture.fake.rounded_bytes` for CUDA's allocator).
    """

    def __init__(self, *, on_alloc: Callable[[int, int], None] | None = None,
                 on_free: Callable[[int, int], None] | None = None,
                 size: Callable[[int], int] | None = None):
        super().__init__()
        self.size = size or (lambda n: n)
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
        n = self.size(st.nbytes())

        def _dead(_ref: weakref.ref, k: int = k) -> None:
            entry = self._live.pop(k, None)
            if entry is not None:
                self.current_bytes -= entry[1]
                if self.on_free is not None:
                    self.on_free(k, entry[1])

        self._live[k] = (weakref.ref(st, _dead), n)
        self.current_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        if notify and self.on_alloc is not None:
            self.on_alloc(k, n)
        return True

    def resized(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage at its size now: a storage resized in place (FSDP2 frees
        and re-allocates its unsharded parameters so, ``untyped_storage().resize_``, which
        no op dispatch shows) is re-counted when this is called."""
        st = t.untyped_storage()
        entry = self._live.get(id(st))
        if entry is None:
            self.register(t, notify=True)
            return
        n = self.size(st.nbytes())
        self._live[id(st)] = (entry[0], n)
        self.current_bytes += n - entry[1]
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

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




def state_tensors(module: nn.Module, inputs: Sequence[Any]) -> list[torch.Tensor]:
    ts = [*module.parameters(), *module.buffers()]
    ts += [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    return ts


def base_bytes(module: nn.Module, inputs: Sequence[Any]) -> int:
    """Bytes of the unique storages of parameters, buffers and tensor inputs."""
    seen: dict[int, int] = {}
    for t in state_tensors(module, inputs):
        st = t.untyped_storage()
        seen[st.data_ptr() or id(st)] = st.nbytes()
    return sum(seen.values())


# ------------------------------------------------------------------ a real step with an optimizer


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that a timer or a peak reads it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None
