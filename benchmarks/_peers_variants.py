"""The contestants of ``benchmarks/peers.py``, each a training step a user could run.

* `wrap_blocks`: ``torch.utils.checkpoint`` over each repeated block of the model, as a user
  writes it by hand, with no policy (``every_block``) or a selective-checkpoint policy
  (`titan_policy`, torchtitan's selective AC).
* `compiled`: ``torch.compile`` with inductor, ``activation_memory_budget`` set for this module's
  compilation only (the partitioner reads the config while the backend runs), counting the
  graphs it compiles.
* `Variant`: a name, a module and its inputs, and one training step; `time_rounds` times them in
  interleaved rounds; `peaks` measures each one's peak with the profiler's memory events
  (`compiled_peak`, which sees inductor's allocations) and, for eager ones, with the storage
  tracker (`scheduler.measure`) as well; on CUDA with ``torch.cuda.max_memory_allocated``.

A script helper, not part of the package: imported with ``benchmarks/`` on ``sys.path``.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo.config as dynamo_config
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch import nn
from torch._functorch.partitioners import get_default_op_list
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import scheduler
from scheduler.capture.trace import default_loss_recipe
from scheduler.measurement.compiled import compiled_peak

__all__ = ["Variant", "block_paths", "compiled", "device_of", "fresh_compiles", "peaks",
           "time_rounds", "titan_policy", "titan_save_ops", "wrap_blocks"]


@dataclass
class Variant:
    """One contestant: ``module(*inputs)`` then the default loss and backward is its step.

    ``family`` groups variants in the plot; ``compiled`` says whether its step runs
    ``torch.compile``d code; ``predicted`` holds our cost model's numbers for it, if any
    (``peak_bytes``, ``step_ratio``: predicted step over the predicted unscheduled step);
    ``graphs`` counts the graphs its backend compiled (compiled variants only)."""

    name: str
    family: str
    module: nn.Module
    inputs: tuple[Any, ...]
    compiled: bool = False
    budget_bytes: int | None = None
    predicted: dict[str, float] = field(default_factory=dict)
    graphs: list[int] = field(default_factory=lambda: [0])
    peaks: tuple[int, int | None] | None = None  # `peaks`, once measured
    note: str = ""

    def step(self) -> None:
        params = list(self.module.parameters())
        for p in params:
            p.grad = None
        out = self.module(*self.inputs)
        loss = default_loss_recipe(out)(out)
        del out
        loss.backward()
        for p in params:
            p.grad = None


def block_paths(graph: Any) -> list[str]:
    """The repeated blocks of a profiled graph (``Node.block``, e.g. ``transformer.h.3``), in
    order: the modules a user wraps in ``checkpoint`` by hand."""
    return list(dict.fromkeys(graph.node(n).block for n in graph.compute_nodes
                              if graph.node(n).block))


def wrap_blocks(model: nn.Module, paths: list[str],
                policy: Callable[[], Callable[..., CheckpointPolicy]] | None = None
                ) -> nn.Module:
    """A deep copy of ``model`` whose blocks at ``paths`` run under
    ``checkpoint(use_reentrant=False)``, with ``context_fn`` = selective checkpointing under
    ``policy()`` (a fresh policy per call) when it is given."""
    model = copy.deepcopy(model)
    for path in paths:
        sub = model.get_submodule(path)
        kw: dict[str, Any] = {"use_reentrant": False}
        if policy is not None:
            kw["context_fn"] = lambda: create_selective_checkpoint_contexts(policy())
        sub.forward = functools.partial(checkpoint, sub.forward, **kw)
    return model


def titan_save_ops() -> set[Any]:
    """torchtitan's default save list (``_get_default_save_ops``): the partitioner's
    compute-intensive ops (mm, addmm, bmm, convolution, attention, ...), the attention
    variants and ``aten.max``; plus ``_scaled_dot_product_flash_attention_for_cpu``, the
    attention op that runs on CPU (torchtitan targets CUDA, whose attention ops are listed)."""
    ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    aten = torch.ops.aten
    for name in ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
                 "_scaled_dot_product_fused_attention_overrideable",
                 "_scaled_dot_product_flash_attention_for_cpu", "max"):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    return ops


def titan_policy() -> Callable[..., CheckpointPolicy]:
    """torchtitan's selective-AC policy (``SelectiveAC._wrap_block``): save the outputs of
    the save-list ops, except every second ``mm``/``linear`` (counted separately in forward
    and in the recompute), and recompute everything else."""
    save = titan_save_ops()
    mm_ops = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)
    count = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in mm_ops:
            count[mode] += 1
        if func in save:
            if func in mm_ops and count[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def compiled(module: nn.Module, budget: float | None, graphs: list[int],
             **config: Any) -> nn.Module:
    """``torch.compile(module)`` with inductor; with ``budget``, under
    ``activation_memory_budget=budget`` while this module's graphs are compiled (the
    partitioner reads it then), else at the configured default; ``config``: other functorch
    settings patched meanwhile (``aggressive_recomputation=True``). ``graphs[0]`` counts the
    graphs compiled. Each call makes a new backend, so dynamo does not reuse another
    variant's code (turn the FX-graph and AOT-autograd caches off as well, see `peers.py`)."""
    from torch._inductor.compile_fx import compile_fx

    patch = ({} if budget is None else {"activation_memory_budget": budget}) | config

    def backend(gm: Any, example_inputs: Any) -> Any:
        graphs[0] += 1
        with functorch_config.patch(**patch):
            return compile_fx(gm, example_inputs)

    return torch.compile(module, backend=backend)


def fresh_compiles() -> None:
    """Set torch.compile up for many variants in one process: the FX-graph and AOT-autograd
    caches off (with them on, a second ``activation_memory_budget``'s compilation reused the
    first one's graph) and dynamo's recompile limits raised (our plans' modules share their
    ``forward``'s code, which dynamo counts as recompiles of one function)."""
    inductor_config.force_disable_caches = True
    functorch_config.enable_autograd_cache = False
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, 256)


def time_rounds(variants: list[Variant], rounds: int,
                progress: Callable[[str], None] = lambda s: None) -> list[list[float]]:
    """Wall time of one step of each variant (in their order), in ``rounds`` rounds that each
    run every variant once (so load from elsewhere slows all alike); one untimed step of each
    first."""
    for v in variants:
        v.step()
    times: list[list[float]] = [[] for _ in variants]
    for r in range(rounds):
        progress(f"timing round {r + 1}/{rounds}")
        for i, v in enumerate(variants):
            sync = torch.cuda.synchronize if device_of(v.module).type == "cuda" else None
            if sync:
                sync()
            t0 = time.perf_counter()
            v.step()
            if sync:
                sync()
            times[i].append(time.perf_counter() - t0)
    return times


def device_of(module: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (the CPU without parameters)."""
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def peaks(v: Variant) -> tuple[int, int | None]:
    """(peak from the profiler's memory events, peak from the storage tracker or None for a
    compiled variant: the tracker's dispatch mode makes dynamo run the module eagerly).

    On CUDA: (``torch.cuda.max_memory_allocated`` over one step after a warm-up, less what was
    allocated before it, plus the base; `scheduler.measure`), None): the caching allocator's
    own count, which sees compiled and eager code alike."""
    loss_fn = lambda out: default_loss_recipe(out)(out)  # noqa: E731
    if device_of(v.module).type == "cuda":
        return scheduler.measure(v.module, v.inputs, repeats=1, warmup=1,
                                 loss_fn=loss_fn).peak_bytes, None
    prof = compiled_peak(v.module, v.inputs, loss_fn=loss_fn)
    if v.compiled:
        return prof, None
    # (the allocator's count is ``prof``: not taken again)
    tracked = scheduler.measure(v.module, v.inputs, repeats=1, warmup=1, loss_fn=loss_fn,
                                allocator=False).peak_bytes
    return prof, tracked
