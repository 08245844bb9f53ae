"""A traced step run under a schedule: recompute regions as non-reentrant checkpoints.

`CheckpointedStep` runs the model nodes of a `trace`d graph (`capture.program.Program`) region
by region. Each ``recompute`` region runs under ``torch.utils.checkpoint.checkpoint(
use_reentrant=False, preserve_rng_state=True)``; a region with a save set adds a
selective-checkpoint policy that marks every op of those nodes MUST_SAVE. Buffers a region
mutates in forward (BatchNorm running statistics) are restored after its replay in backward,
so they are updated once per step. Values are freed after their last reader, as profiling
frees them, so the lifetimes are the profiled ones.

`rewrite` wraps it into the planned module; nothing here decides when it runs.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _python_dispatch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    get_device_states,
    set_device_states,
)

from .capture.program import Program
from .capture.trace import alias_groups, mutated_inputs
from .ir.schedule import Schedule, ScheduleError

__all__ = ["CheckpointedStep"]


@dataclass
class _Region:
    recompute: bool
    nodes: list[fx.Node]
    inputs: list[str]  # values read from outside the region (not attributes)
    outputs: list[str]  # values read after the region
    save: frozenset[str]
    buffers: list[torch.Tensor]  # buffers its nodes may mutate
    last_read: dict[str, int] = field(default_factory=dict)  # value -> last local reader
    current: list[str | None] = field(default_factory=lambda: [None])  # node running now


class CheckpointedStep:
    """The model part of a traced step with ``schedule`` applied; ``root`` is the module that
    stands for the traced model at run time (`capture.program.Program`).

    Raises:
        ScheduleError: the schedule's regions do not name the graph's model nodes in order,
            or a recompute region would replay a value written in place after it.
    """

    def __init__(self, gm: fx.GraphModule, schedule: Schedule, root: nn.Module | None = None):
        # (attributes are read from ``root``, the planned module, at each run: what a wrapper
        # such as FSDP2's fully_shard swaps in is what the step uses)
        self.prog = Program(gm, root=root)
        self.schedule = schedule
        self.regions = _plan(self.prog, schedule)

    @property
    def info(self) -> Any:
        """The graph's `TraceInfo`."""
        return self.prog.info

    def __call__(self, args: tuple[Any, ...]) -> Any:
        """The model's output for positional ``args`` (gradients on: the caller checks)."""
        prog = self.prog
        env = prog.inputs_env(args)
        last = self._last_pos
        for region in self.regions:
            if region.recompute:  # (`forward` comes here with gradients on only)
                vals = [env[n] for n in region.inputs]
                outs = checkpoint(
                    functools.partial(_run_region, prog, region, _Calls()), *vals,
                    use_reentrant=False, preserve_rng_state=True,
                    context_fn=_sac_context(region) if region.save else _noop_context)
                env.update(zip(region.outputs, outs))
                end = prog.pos[region.nodes[-1]]
                for name in region.inputs:
                    if last.get(name, -1) <= end:
                        env.pop(name, None)
            else:
                for node in region.nodes:
                    env[node.name] = prog.run_node(node, env)
                    i = prog.pos[node]
                    for a in (*node.all_input_nodes, node):
                        if last.get(a.name, -1) <= i and a.op != "get_attr":
                            env.pop(a.name, None)
        return prog.model_output(env)

    @functools.cached_property
    def _last_pos(self) -> dict[str, int]:
        """Position of the last model node that reads each value; model outputs: never freed."""
        prog = self.prog
        last: dict[str, int] = {}
        for r in self.regions:
            for n in r.nodes:
                for a in n.all_input_nodes:
                    last[a.name] = prog.pos[n]
        for leaf in prog.model_out_leaves:
            if isinstance(leaf, fx.Node):
                last[leaf.name] = len(prog.nodes)
        return last


class _Calls:
    """Counts calls of one region's function: the second call is the backward replay."""

    def __init__(self) -> None:
        self.n = 0
        self.rng: dict[str, Any] = {}  # save-set node -> RNG state forward left after it


def _run_region(prog: Program, region: _Region, calls: _Calls, *vals: Any) -> tuple[Any, ...]:
    calls.n += 1
    replay = calls.n > 1
    saved_bufs = _snapshot(region.buffers) if replay else []
    try:
        env = dict(zip(region.inputs, vals))
        env.update(prog.attrs)
        keep = set(region.outputs)
        for i, node in enumerate(region.nodes):
            region.current[0] = node.name
            env[node.name] = prog.run_node(node, env)
            if node.name in region.save:
                # the replay takes a save-set node's outputs from the cache without running
                # it, so it draws no random numbers there: put the RNG where forward left it,
                # or a later random op of the region (dropout) draws a different mask
                if replay:
                    _set_rng(calls.rng[node.name])
                else:
                    calls.rng[node.name] = _get_rng(vals)
            for a in (*node.all_input_nodes, node):
                if (region.last_read.get(a.name, -1) <= i and a.name not in keep
                        and a.op != "get_attr"):
                    env.pop(a.name, None)
        return tuple(env[n] for n in region.outputs)
    finally:
        if replay:
            _restore(region.buffers, saved_bufs)


def _snapshot(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    # outside every dispatch mode: selective checkpointing expects the replay to run exactly
    # the ops forward ran, and these copies are not part of the model
    with _python_dispatch._disable_current_modes(), torch.no_grad():
        return [b.clone() for b in buffers]


def _get_rng(vals: tuple[Any, ...]) -> tuple[Any, ...]:
    # the states checkpoint(preserve_rng_state=True) itself stashes: CPU, and the devices of
    # the region's tensor inputs once CUDA is initialised
    with _python_dispatch._disable_current_modes():
        devices = get_device_states(*vals) if torch.cuda.is_initialized() else ([], [])
        return torch.get_rng_state(), *devices


def _set_rng(state: tuple[Any, ...]) -> None:
    cpu, devices, device_states = state
    with _python_dispatch._disable_current_modes():
        torch.set_rng_state(cpu)
        set_device_states(devices, device_states)


def _restore(buffers: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
    with _python_dispatch._disable_current_modes(), torch.no_grad():
        for b, s in zip(buffers, saved):
            b.copy_(s)


def _sac_context(region: _Region) -> Callable[[], Any]:
    """Selective checkpointing for a region's save set.

    Ops of a save-set node that allocate their outputs are MUST_SAVE (cached in forward, not
    run by the replay), and so are its in-place ops (dropout's ``bernoulli_`` mutates a tensor
    it just allocated: replaying it on the cached tensor would apply it twice). Its pure view
    ops are recomputed: caching a view would pin its base (often the node's input) until the
    replay, and a view costs nothing to redo. Every op of other nodes is recomputed.
    """
    current, save = region.current, region.save

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if current[0] in save and not _is_view(op):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy,
                             allow_cache_entry_mutation=True)


@functools.lru_cache(maxsize=None)
def _is_view(op: Any) -> bool:
    """Whether an ATen op only returns aliases of its inputs without mutating them."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return False
    return not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)


def _noop_context() -> tuple[Any, Any]:
    return contextlib.nullcontext(), contextlib.nullcontext()


def _plan(prog: Program, schedule: Schedule) -> list[_Region]:
    by_name = prog.by_name
    model_names = [n.name for n in prog.nodes if n.name not in prog.info.loss_nodes]
    got = [n for r in schedule.regions for n in r.nodes]
    if got != model_names:
        diff = next((i for i, (a, b) in enumerate(zip(got, model_names)) if a != b),
                    min(len(got), len(model_names)))
        a = got[diff] if diff < len(got) else None
        b = model_names[diff] if diff < len(model_names) else None
        raise ScheduleError(
            f"schedule does not match the traced model: at node {diff} the schedule has {a!r} "
            f"and the model {b!r}; solve again for this model")
    readers: dict[str, list[int]] = {}
    regions = []
    for r in schedule.regions:
        nodes = [by_name[n] for n in r.nodes]
        regions.append(_Region(r.recompute, nodes, [], [], r.save, []))
    out_names = {x.name for x in prog.model_out_leaves if isinstance(x, fx.Node)}
    for ri, r in enumerate(regions):
        inside = {n.name for n in r.nodes}
        ins: dict[str, None] = {}
        for n in r.nodes:
            for a in n.all_input_nodes:
                if a.name not in inside and a.op != "get_attr":
                    ins[a.name] = None
                    readers.setdefault(a.name, []).append(ri)
        r.inputs = list(ins)
    for ri, r in enumerate(regions):
        r.outputs = [n.name for n in r.nodes
                     if n.name in out_names or any(x != ri for x in readers.get(n.name, ()))]
        if r.recompute:
            r.buffers = _buffers_of(prog, r.nodes)
            for i, n in enumerate(r.nodes):
                for a in n.all_input_nodes:
                    r.last_read[a.name] = i
    _check_mutations(prog, regions)
    return regions


def _check_mutations(prog: Program, regions: list[_Region]) -> None:
    """Refuse a recompute region whose backward replay would see other data than its forward.

    The replay reads the region's inputs as they are in backward. If a value the region reads
    from outside (or a view of it) is written in place by the region itself or by any later
    node, the replay computes from the written value: autograd's saved-tensor check stops it
    in backward ("modified by an inplace operation") without naming the op, so it is refused
    here, before any step. Buffers are exempt: the replay restores those it mutates
    (BatchNorm statistics), and they are not region inputs.
    """
    group = alias_groups(prog.gm)
    attr_groups = {group[n] for n in prog.gm.graph.nodes if n.op == "get_attr"}
    writes = [(n, group[a]) for n in prog.nodes for a in mutated_inputs(n)
              if group[a] not in attr_groups]
    every = {n.name: n for n in prog.gm.graph.nodes}
    for ri, r in enumerate(regions):
        if not (r.recompute and writes):
            continue
        start = prog.pos[r.nodes[0]]
        outside = {group[every[n]]: n for n in r.inputs}
        for node, g in writes:
            if prog.pos[node] >= start and g in outside:
                raise ScheduleError(
                    f"region {ri} recomputes from {outside[g]!r}, which node {node.name!r} "
                    f"({node.target}) writes in place afterwards: the backward replay would "
                    f"read the written value. Keep region {ri} (policy keep), or let one "
                    f"recompute region hold both {node.name!r} and the allocation of the "
                    f"value it writes into")


def _buffers_of(prog: Program, nodes: list[fx.Node]) -> list[torch.Tensor]:
    """Buffers the nodes can mutate: those of called submodules and those read directly."""
    bufs: dict[int, torch.Tensor] = {}
    for n in nodes:
        if n.op == "call_module":
            for b in prog.gm.get_submodule(n.target).buffers():
                bufs[id(b)] = b
        for a in n.all_input_nodes:
            v = prog.attrs.get(a.name) if a.op == "get_attr" else None
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
                bufs[id(v)] = v
    return list(bufs.values())
