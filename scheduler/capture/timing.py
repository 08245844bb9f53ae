"""Timing a traced step: each node's forward time and each backward step's time (medians of
timed steps), a node's extra cost under a selective-checkpoint policy, and what a checkpoint
call and each tensor saved under it cost on the device (`checkpoint_costs`, once a process).
`GradFnIndex` maps autograd nodes back to the forward node that made them, for both the
timing and the recording in `profile`."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from ..checkpointing import CheckpointRegion
from ..measurement.storage import sync_device
from .program import Program

__all__ = ["GradFnIndex", "checkpoint_costs", "time_sac_forward", "time_steps"]


#: (checkpoint calls, ops in each) of the calibration chains `checkpoint_costs` times
_CALIBRATION = ((1, 4), (1, 32), (4, 4), (4, 16), (16, 2), (16, 4))


#: `checkpoint_costs` per (device, torch threads), measured once a process
_COSTS: dict[tuple[str, int], tuple[float, float]] = {}


def checkpoint_costs(device: torch.device, *, rounds: int = 9) -> tuple[float, float]:
    """What a non-reentrant `torch.utils.checkpoint` region costs on ``device`` beyond running
    its forward once more: (seconds per checkpoint call, seconds per tensor saved in it).
    Measured once a process for each device and number of torch threads (about 0.2 s; the
    first checkpoint of a process also pays PyTorch's one-time setup, about 1.5 s here).

    Times chains of ``tanh`` on a small tensor (each op saves one tensor) as K calls of the
    executor's region module (`checkpointing.CheckpointRegion`) of N ops each, beside the
    same ops without checkpoints and their forward alone, in turns for ``rounds`` rounds
    (medians), and fits ``extra = K * call + K * N * saved`` by least squares over
    `_CALIBRATION` (both clamped at 0). Both are small but not negligible on CPU, where the
    pack and unpack hooks run in Python. Forward times of real ops do not enter: only the
    hooks' and the call's work, which depends on the device and the Python build, not on the
    model."""
    key = (str(device), torch.get_num_threads())
    if key not in _COSTS:
        _COSTS[key] = _fit_checkpoint_costs(device, rounds)
    return _COSTS[key]


def _chain_region(n: int) -> CheckpointRegion:
    """The region module the executor runs (`checkpointing.CheckpointRegion`), around a body
    of ``n`` ``tanh`` ops built the way `executor` builds one."""
    g = fx.Graph()
    g.placeholder("scheduler_call")
    g.placeholder("scheduler_attrs")
    x = g.placeholder("x")
    for _ in range(n):
        x = g.call_function(torch.tanh, (x,))
    g.output((x,))
    return CheckpointRegion(fx.GraphModule({}, g, class_name="Calibration"), 1, False, (), ())


def _fit_checkpoint_costs(device: torch.device, rounds: int) -> tuple[float, float]:
    # (no random numbers: the caller's RNG state is left as it was)
    x0 = torch.linspace(-1.0, 1.0, 256, device=device).reshape(16, 16).requires_grad_()
    regions = {n: _chain_region(n) for n in {n for _, n in _CALIBRATION}}

    def chain(x: torch.Tensor, n: int) -> torch.Tensor:
        for _ in range(n):
            x = torch.tanh(x)
        return x

    def timed(fn: Callable[[], Any]) -> float:
        sync_device(device)
        t0 = time.perf_counter()
        fn()
        sync_device(device)
        return time.perf_counter() - t0

    def checkpointed(k: int, n: int) -> None:
        x = x0
        for _ in range(k):
            x = regions[n](x)[0]
        x.sum().backward()

    samples: dict[tuple[int, int], list[float]] = defaultdict(list)
    for r in range(rounds + 1):  # the first warms up
        for k, n in _CALIBRATION:
            ck = timed(lambda: checkpointed(k, n))
            plain = timed(lambda: chain(x0, k * n).sum().backward())
            fwd = timed(lambda: chain(x0, k * n))
            if r:
                samples[k, n].append(ck - plain - fwd)
    x0.grad = None
    # least squares for (call, saved) over rows (k, k * n), by the normal equations
    rows = [(k, k * n, statistics.median(samples[k, n])) for k, n in _CALIBRATION]
    aa = sum(a * a for a, _, _ in rows)
    ab = sum(a * b for a, b, _ in rows)
    bb = sum(b * b for _, b, _ in rows)
    ay = sum(a * y for a, _, y in rows)
    by = sum(b * y for _, b, y in rows)
    det = aa * bb - ab * ab
    call, saved = (bb * ay - ab * by) / det, (aa * by - ab * ay) / det
    if call < 0:  # the best fit with the call's cost at 0
        call, saved = 0.0, by / bb
    if saved < 0:
        call, saved = max(0.0, ay / aa), 0.0
    return max(0.0, call), max(0.0, saved)


class GradFnIndex:
    """Maps the autograd nodes a forward node creates to that node, with pre-hooks that report
    which forward node's backward is running."""

    def __init__(self, on_enter: Callable[[str], None]):
        self.on_enter = on_enter
        self.seen: dict[int, Any] = {}  # id -> grad_fn (kept alive so ids stay unique)
        # the pre-hooks, removed by `clear`: an autograd node may outlive the step (autocast
        # caches a parameter's cast, and its grad_fn, across the steps of one autocast block)
        self.handles: list[Any] = []

    def claim(self, name: str, outputs: list[torch.Tensor]) -> None:
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or id(fn) in self.seen:
                continue
            self.seen[id(fn)] = fn
            if type(fn).__name__ == "AccumulateGrad":
                continue
            self.handles.append(fn.register_prehook(lambda _g, name=name: self.on_enter(name)))
            stack.extend(f for f, _ in fn.next_functions)

    def clear(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.seen.clear()


def time_steps(prog: Program, model: nn.Module, inputs: tuple[Any, ...], repeats: int,
               steps: list[dict[str, Any]]) -> tuple[dict[str, float], list[float]]:
    """Median forward time per node, median time per recorded backward step, and each node's
    median extra forward time under a selective-checkpoint policy (`time_sac_forward`)."""
    fwd: dict[str, list[float]] = defaultdict(list)
    sac: dict[str, list[float]] = defaultdict(list)
    bwd: list[list[float]] = [[] for _ in steps]
    for r in range(repeats + 1):  # the first run warms up
        for p in model.parameters():
            p.grad = None
        marks: list[tuple[str, float]] = []
        index = GradFnIndex(lambda n: marks.append((n, time.perf_counter()))
                             if not marks or marks[-1][0] != n else None)
        times: dict[str, float] = {}

        def around(i: int, node: fx.Node, thunk: Callable[[], Any]) -> Any:
            t0 = time.perf_counter()
            out = thunk()
            times[node.name] = time.perf_counter() - t0
            index.claim(node.name, [t for t in pytree.tree_leaves(out)
                                    if isinstance(t, torch.Tensor)])
            return out

        loss = prog.run(inputs, around=around)[1]
        marks.append(("", time.perf_counter()))
        loss.backward()
        end = time.perf_counter()
        del loss
        index.clear()
        sac_times = time_sac_forward(prog, inputs)
        if r == 0:
            continue
        for k, v in times.items():
            fwd[k].append(v)
        for k, v in sac_times.items():
            sac[k].append(v)
        # marks[0] is the seed step; recorded and timed steps run the same sequence
        seq = marks
        if [n for n, _ in seq] == [s["node"] for s in steps]:
            stamps = [t for _, t in seq] + [end]
            for j in range(len(seq)):
                bwd[j].append(stamps[j + 1] - stamps[j])
    for p in model.parameters():
        p.grad = None
    fwd_med = {k: statistics.median(v) for k, v in fwd.items()}
    bwd_med = [statistics.median(v) if v else 0.0 for v in bwd]
    sac_extra = {k: max(0.0, statistics.median(v) - fwd_med.get(k, 0.0)) for k, v in sac.items()}
    return fwd_med, bwd_med, sac_extra


def time_sac_forward(prog: Program, inputs: tuple[Any, ...]) -> dict[str, float]:
    """Each node's forward time under a selective-checkpoint policy's dispatch mode (every op
    recomputable, so nothing is cached): what a node in a save-set region costs to run."""
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.PREFER_RECOMPUTE

    times: dict[str, float] = {}

    def around(i: int, node: fx.Node, thunk: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = thunk()
        times[node.name] = time.perf_counter() - t0
        return out

    fwd_ctx, _ = create_selective_checkpoint_contexts(policy)
    with fwd_ctx:
        out = prog.run(inputs, around=around)
    del out
    return times
