"""Runs of several gloo ranks on CPU for the per-rank tests: spawn, the models, the wrappings,
and each rank's measured peak.

A rank's peak is measured with `StorageTracker` (every storage a dispatched op makes, the
reducer's buckets and FSDP2's collective buffers included: they are ``aten.empty`` calls; and
FSDP2's unsharded parameters, which it allocates and frees by resizing their storages, told to
the tracker by `_resizes_seen`) from the start of the step, on top of what the rank holds then:
its local parameter shards (a DTensor's local tensor), buffers, inputs, and for DDP the buckets
(the wrapper is built under the tracker, so it sees them made). What C++ allocates inside an op
(gloo's scratch on its worker thread, CPU ``chunk_cat``'s padded copies) it does not see: the
prediction counts gloo's scratch, which in these runs is never above the copy-out it precedes.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from scheduler.measurement.compiled import allocator_rise
from scheduler.measurement.storage import StorageTracker


def spawn(worker: Callable[..., dict[str, Any]], world: int, tmp: Path, *args: Any
          ) -> list[dict[str, Any]]:
    """Run ``worker(rank, world, *args) -> record`` on ``world`` gloo ranks; their records."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_main, args=(world, port, str(tmp), worker, args), nprocs=world, join=True)
    recs = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, rec in enumerate(recs):
        assert "crash" not in rec, f"rank {r} crashed:\n{rec['crash']}"
    return recs


def _main(rank: int, world: int, port: int, out: str, worker: Callable[..., dict[str, Any]],
          args: tuple[Any, ...]) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    try:
        rec = worker(rank, world, *args)
    except Exception:  # noqa: BLE001 - reported by the tests, with the rank's traceback
        rec = {"crash": traceback.format_exc()}
    torch.save(rec, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def wrap(module: nn.Module, how: str, units: tuple[str, ...] = (), **kw: Any) -> nn.Module:
    """``module`` wrapped as users do: ``"ddp"``, or ``"fsdp2"`` (``fully_shard`` on each of
    ``units``, then the root, torchtitan's order)."""
    if how == "ddp":
        return DistributedDataParallel(module, **kw)
    for path in units:
        fully_shard(module.get_submodule(path), **kw)
    fully_shard(module, **kw)
    return module


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class _Tracker(StorageTracker):
    """`StorageTracker` that counts a DTensor by its local tensor."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.register(_local(t), notify=True)
        return out


def wrapped_step(module: nn.Module, how: str, units: tuple[str, ...], call: Callable[
        [nn.Module], torch.Tensor], inputs: Any, *, adamw: bool = False, warm: bool = False,
                 steps: int = 1, **kw: Any) -> tuple[nn.Module, list[int]]:
    """Wrap ``module`` (`wrap`) and run ``steps`` training steps ``call(wrapped).backward()``,
    each with gradients at None and an optimizer step after each but the last (SGD, or
    ``AdamW`` with ``adamw``); returns the wrapped module (the last step's gradients in it) and
    this rank's measured peak bytes of each step. With ``adamw``, a step and an ``AdamW`` step
    first (not measured): its state is then held through the measured steps. With ``warm``, a
    step first (not measured): a plan's units that trace at their first call (under a
    ``MixedPrecisionPolicy``) trace then, not under the tracker."""
    tracker = _Tracker()
    for t in [*module.parameters(), *module.buffers(),
              *[x for x in torch.utils._pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)]]:
        tracker.register(_local(t))
    # (DDP's buckets are made here, under the tracker; fully_shard's sharded parameters are
    # counted below, and not its device mesh's few bytes of bookkeeping)
    with tracker if how == "ddp" else contextlib.nullcontext():
        wrapped = wrap(module, how, units, **kw)
    state: list[torch.Tensor] = []
    if adamw:
        opt: torch.optim.Optimizer = torch.optim.AdamW(wrapped.parameters(), foreach=False)
        call(wrapped).backward()
        opt.step()
        state = [t for st in opt.state.values() for t in st.values()]
    else:
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.01, foreach=False)
        if warm:
            call(wrapped).backward()
    for t in [*wrapped.parameters(), *wrapped.buffers(), *state]:
        tracker.register(_local(t))  # (FSDP2's shards, the optimizer's state)
    peaks = []
    for step in range(steps):
        if step:
            opt.step()  # (not in the step's peak: the budget is forward and backward)
        for p in wrapped.parameters():
            p.grad = None
        tracker.reset_peak()
        with tracker, _resizes_seen(tracker), _settled():
            call(wrapped).backward()
        peaks.append(tracker.peak_bytes)
    return wrapped, peaks


@contextlib.contextmanager
def _settled() -> Iterator[None]:
    """FSDP2's collectives run to completion on this thread: gloo's work object holds the
    collective's tensors, and when its worker thread happens to drop it last, their frees
    come late (the measured peak then holds one more buffer, in about one run of three).
    Each is run asynchronously, waited for, given 3 ms for the worker to let go, and dropped
    here."""
    saved = {name: getattr(dist, name) for name in ("all_gather_single",
                                                   "reduce_scatter_single")}

    def settled(fn: Callable[..., Any]) -> Callable[..., None]:
        def run(*args: Any, **kwargs: Any) -> None:
            kwargs["async_op"] = True
            work = fn(*args, **kwargs)
            if work is not None:
                work.wait()
            time.sleep(0.003)
            del work
        return run

    for name, fn in saved.items():
        setattr(dist, name, settled(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def _resizes_seen(tracker: StorageTracker) -> Iterator[None]:
    """FSDP2 frees and re-allocates its unsharded parameters by resizing their storages in
    place (``_fsdp_param.free_storage`` / ``alloc_storage``), which no op dispatch shows: tell
    the tracker of each, by wrapping those two functions where FSDP2 calls them."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    def seen(fn: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        def run(t: torch.Tensor) -> None:
            fn(t)
            tracker.resized(t)
        return run

    saved = [(mod, name, getattr(mod, name)) for mod in (_fsdp_param, _fsdp_param_group)
             for name in ("alloc_storage", "free_storage") if hasattr(mod, name)]
    for mod, name, fn in saved:
        setattr(mod, name, seen(fn))
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def full_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, gathered whole (a DTensor's ``full_tensor``)."""
    out = {}
    for name, p in module.named_parameters():
        g = p.grad
        if g is not None:
            out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def allocator_peak(module: nn.Module, call: Callable[[nn.Module], torch.Tensor], inputs: Any
                   ) -> int:
    """This rank's peak bytes in one training step ``call(module).backward()`` (gradients at
    None) of a wrapped module whose compiled parts allocate outside dispatch (inductor's
    buffers, which `_Tracker` does not see): c10's allocator's rise over the step, from the
    profiler's memory events (`measurement.compiled.allocator_rise`; FSDP2's storage resizes
    allocate through it too), on top of the storages the rank holds before it (local
    parameter shards, buffers, inputs)."""
    for p in module.parameters():
        p.grad = None
    held: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers(),
              *[x for x in torch.utils._pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)]]:
        s = _local(t).untyped_storage()
        held[s.data_ptr()] = s.nbytes()
    rise = allocator_rise(lambda: call(module).backward(), torch.device("cpu"))
    for p in module.parameters():
        p.grad = None
    return sum(held.values()) + rise
