"""The generated code of a scheduled step: plain Python that ``torch.compile`` captures whole.

`generate` turns a traced step (`capture.program.Program`) and its planned regions into an
``fx.GraphModule`` whose generated ``forward(*inputs, *attributes)`` runs the model's nodes in
order and returns the leaves of the model's output. A keep region's nodes are inline; a
recompute region is one call of a `CheckpointRegion` submodule, which runs a copy of the
region's nodes (its ``body``, another ``fx.GraphModule``) under ``torch.utils.checkpoint.
checkpoint(use_reentrant=False, preserve_rng_state=True)``; a nested region's body calls
`CheckpointRegion` submodules of its own for its inner recompute regions (nested
non-reentrant checkpoints), its inner keep regions inline. fx's generated code drops each
value after its last reader, so values live as long as profiling saw them live.

* **Attributes** (the graph's ``get_attr`` values: parameters and buffers it reads directly)
  are arguments of the generated code, never stored in it: the caller reads them from the live
  module at each call, so what a wrapper such as FSDP2's ``fully_shard`` swaps in is what runs.
  Called submodules (``call_module``) are the model's own module objects, referenced.
* **Save sets**: each save-set node runs as ``_saved(...)``, under ``torch.fx.traceback.
  annotate({SAVE_KEY: True})``, and one pure selective-checkpoint policy (`save_policy`) marks
  the ops it sees under that annotation MUST_SAVE. Eagerly the annotation is set while the
  node's ops dispatch; under ``torch.compile`` dynamo records it in the node's metadata and
  AOTAutograd puts it back while it asks the policy about each ATen op of the region.
* **Eager-only bookkeeping**, skipped when ``torch.compiler.is_compiling()``: after a save-set
  node the replay resets the RNG to where forward left it (the replay skips the node, so it
  draws no random numbers there, and a later dropout must draw forward's mask); buffers a
  region mutates (BatchNorm running statistics) are restored after its replay, so they are
  updated once per step. Compiled, the functionalised graph writes each buffer once and
  inductor functionalises the RNG: neither is needed there.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx import traceback as fx_traceback
from torch.utils import _python_dispatch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    get_device_states,
    set_device_states,
)

from .capture.program import Program

__all__ = ["SAVE_KEY", "CheckpointRegion", "PlannedRegion", "generate", "save_policy"]

#: Key of the ``torch.fx.traceback`` annotation that marks a save-set node's ops.
SAVE_KEY = "scheduler_save"


@dataclass
class PlannedRegion:
    """One region of a schedule, resolved against the traced graph."""

    recompute: bool
    nodes: list[fx.Node]
    inputs: list[str]  # values read from outside the region (not attributes)
    outputs: list[str]  # values read after the region
    save: frozenset[str]
    attrs: list[str] = field(default_factory=list)  # get_attr values its nodes read
    # a nested region's inner regions (their inputs and outputs relative to themselves)
    inner: list[PlannedRegion] = field(default_factory=list)


# -- save sets -----------------------------------------------------------------------------
class _EagerCall:
    """One eager forward of a region and its backward replay: which call this is, the
    region's inputs, and the RNG state forward left after each save-set node."""

    def __init__(self, vals: tuple[Any, ...]) -> None:
        self.n = 0
        self.vals = vals
        self.rng: dict[str, tuple[Any, ...]] = {}


def _saved(call: _EagerCall | None, key: str, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with its ops marked for saving (``call`` None: compiled)."""
    with fx_traceback.annotate({SAVE_KEY: True}):
        out = fn(*args, **kwargs)
    if call is not None:
        if call.n > 1:
            _set_rng(call.rng[key])
        else:
            call.rng[key] = _get_rng(call.vals)
    return out


def _saved_method(call: _EagerCall | None, key: str, name: str, obj: Any, /, *args: Any,
                  **kwargs: Any) -> Any:
    return _saved(call, key, getattr(obj, name), *args, **kwargs)


@functools.lru_cache(maxsize=None)
def _is_view(op: Any) -> bool:
    """Whether an ATen op only returns aliases of its inputs without mutating them."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return False
    return not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)


def save_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective-checkpoint policy of every region with a save set.

    Ops of a save-set node that allocate their outputs are MUST_SAVE (cached in forward, not
    run by the replay), and so are its in-place ops (dropout's ``bernoulli_`` mutates a tensor
    it just allocated: replaying it on the cached tensor would apply it twice). Its pure view
    ops are recomputed: caching a view would pin its base (often the node's input) until the
    replay, and a view costs nothing to redo. Every op of other nodes is recomputed.
    """
    custom = fx_traceback.current_meta.get("custom")
    if custom and custom.get(SAVE_KEY) and not _is_view(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_SAVE_CONTEXT = functools.partial(create_selective_checkpoint_contexts, save_policy,
                                  allow_cache_entry_mutation=True)


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


# -- the region module ---------------------------------------------------------------------
class CheckpointRegion(nn.Module):
    """A recompute region: called with its inputs and then its attributes, it runs
    ``checkpoint(partial(body, call, attributes), *inputs)``.

    Args:
        body: an ``fx.GraphModule`` of the region's nodes, ``body(call, attributes, *inputs)``;
            ``call`` is the eager call state (None when compiled).
        n_inputs: how many of the values it is called with are inputs (the rest: attributes).
        has_save: whether the region has a save set (then `save_policy` applies).
        buffer_modules: the called submodules whose buffers the region may mutate.
        buffer_args: positions, among the attributes, of those that are buffers.
    """

    def __init__(self, body: fx.GraphModule, n_inputs: int, has_save: bool,
                 buffer_modules: tuple[nn.Module, ...], buffer_args: tuple[int, ...]):
        super().__init__()
        self.n_inputs = n_inputs
        self.body = body
        self.has_save = has_save
        self.buffer_modules = buffer_modules  # (a tuple: the user's modules, not registered)
        self.buffer_args = buffer_args

    def forward(self, *vals: Any) -> tuple[Any, ...]:
        # the attributes reach the body bound, not as checkpoint inputs: checkpoint would
        # save those and refuse a buffer the region itself writes (a counter's ``add_``)
        inputs, attrs = vals[:self.n_inputs], vals[self.n_inputs:]
        # (compiled, checkpoint accepts only a context_fn of selective checkpointing)
        kw = {"context_fn": _SAVE_CONTEXT} if self.has_save else {}
        if torch.compiler.is_compiling():
            return checkpoint(functools.partial(self.body, None, attrs), *inputs,
                              use_reentrant=False, preserve_rng_state=True, **kw)
        # (the call state keeps the inputs only for a save set's RNG states: a nested region's
        # inputs must die when its parent's checkpoint lets go of them)
        call = _EagerCall(inputs if self.has_save else ())
        return checkpoint(functools.partial(self._eager_body, call, attrs), *inputs,
                          use_reentrant=False, preserve_rng_state=True, **kw)

    def _eager_body(self, call: _EagerCall, attrs: tuple[Any, ...], *inputs: Any
                    ) -> tuple[Any, ...]:
        call.n += 1
        replay = call.n > 1
        buffers = self._buffers_now(attrs) if replay else []
        # outside every dispatch mode: selective checkpointing expects the replay to run
        # exactly the ops forward ran, and these copies are not part of the model
        with _python_dispatch._disable_current_modes(), torch.no_grad():
            saved = [b.clone() for b in buffers]
        try:
            return self.body(call, attrs, *inputs)
        finally:
            with _python_dispatch._disable_current_modes(), torch.no_grad():
                for b, s in zip(buffers, saved):
                    b.copy_(s)

    def _buffers_now(self, attrs: tuple[Any, ...]) -> list[torch.Tensor]:
        bufs = {id(b): b for m in self.buffer_modules for b in m.buffers()}
        bufs.update((id(attrs[i]), attrs[i]) for i in self.buffer_args)
        return list(bufs.values())


# -- generation ----------------------------------------------------------------------------
def generate(prog: Program, regions: list[PlannedRegion]) -> fx.GraphModule:
    """The step's executor: ``forward(*flat_inputs, *attributes)`` (attributes in the order
    of ``prog.attrs``) returns the model output's leaves that are graph values, in order."""
    every = {n.name: n for n in prog.gm.graph.nodes}
    modules: dict[str, Any] = {}
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in prog.placeholders:
        env[p] = g.placeholder(p.name)
    for name in prog.attrs:
        env[every[name]] = g.placeholder(name)
    for ri, r in enumerate(regions):
        if not r.recompute:
            for n in r.nodes:
                env[n] = _copy_node(g, n, env, None, prog, modules)
            continue
        target = f"region{ri}"
        modules[target] = _region_module(prog, r, str(ri), every)
        vals = [env[every[a]] for a in (*r.inputs, *r.attrs)]
        call = g.call_module(target, tuple(vals))
        for i, name in enumerate(r.outputs):
            env[every[name]] = g.call_function(operator.getitem, (call, i))
    g.output(tuple(env[x] for x in prog.model_out_leaves if isinstance(x, fx.Node)))
    g.lint()
    return fx.GraphModule(modules, g, class_name="ScheduledStep")


def _region_module(prog: Program, r: PlannedRegion, label: str,
                   every: dict[str, fx.Node]) -> CheckpointRegion:
    body = fx.Graph()
    modules: dict[str, Any] = {}
    call = body.placeholder("scheduler_call")
    attr_tuple = body.placeholder("scheduler_attrs")
    env = {every[a]: body.placeholder(a) for a in r.inputs}
    for i, a in enumerate(r.attrs):
        env[every[a]] = body.call_function(operator.getitem, (attr_tuple, i))
    for j, sub in enumerate(r.inner or [r]):
        if sub is not r and sub.recompute:  # a nested checkpoint, called in the body
            target = f"region{label}_{j}"
            modules[target] = _region_module(prog, sub, f"{label}_{j}", every)
            inner_call = body.call_module(target, tuple(env[every[a]]
                                                        for a in (*sub.inputs, *sub.attrs)))
            for i, name in enumerate(sub.outputs):
                env[every[name]] = body.call_function(operator.getitem, (inner_call, i))
            continue
        for n in sub.nodes:
            env[n] = _copy_node(body, n, env, call if n.name in r.save else None, prog, modules)
    body.output(tuple(env[every[o]] for o in r.outputs))
    body.lint()
    attrs = prog.attrs
    buffer_args = tuple(i for i, a in enumerate(r.attrs)
                        if isinstance(attrs[a], torch.Tensor)
                        and not isinstance(attrs[a], nn.Parameter))
    called = tuple(prog.gm.get_submodule(n.target) for n in r.nodes if n.op == "call_module")
    return CheckpointRegion(fx.GraphModule(modules, body, class_name=f"Region{label}"),
                            len(r.inputs), bool(r.save), tuple(dict.fromkeys(called)), buffer_args)


def _copy_node(g: fx.Graph, node: fx.Node, env: dict[fx.Node, fx.Node],
               call: fx.Node | None, prog: Program, modules: dict[str, Any]) -> fx.Node:
    """``node`` in graph ``g`` (its submodule, if any, registered in ``modules`` under a flat
    name); a save-set node (``call`` given) as a `_saved` call."""
    target = node.target
    if node.op == "call_module":
        target = f"m{len(modules)}_{str(node.target).split('.')[-1]}"
        modules[target] = prog.gm.get_submodule(node.target)
    if call is None:
        new = g.node_copy(node, lambda a: env[a])
        new.target = target
        return new
    args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: env[a])
    if node.op == "call_module":
        fn, head = _saved, (g.get_attr(target),)
    elif node.op == "call_function":  # (the function as an attribute: fx's code names it)
        name = f"f{len(modules)}_{getattr(target, '__name__', 'fn')}"
        modules[name] = target
        fn, head = _saved, (g.get_attr(name),)
    else:
        fn, head = _saved_method, (target,)
    new = g.create_node("call_function", fn, (call, node.name, *head, *args), kwargs,
                        name=node.name)
    new.meta = dict(node.meta)
    return new
