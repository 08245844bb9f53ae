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
* **Save sets**: each save-set node runs as ``run_saved(...)``, under ``torch.fx.traceback.
  annotate({SAVE_KEY: ops})``, and one pure selective-checkpoint policy (`save_policy`) marks
  the ops it sees under that annotation MUST_SAVE (with ``ops`` `FLOP_OPS`, under
  ``torch.compile`` only those with FLOPs: `cost.compiled_form`'s ``flop_saves``). Eagerly the annotation is set while the
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

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .capture.program import Program
from .capture.randomness import may_draw_random
from .checkpointing import (
    ALL_OPS,
    FLOP_OPS,
    SAVE_KEY,
    CheckpointRegion,
    run_saved,
    run_saved_method,
    save_policy,
)

__all__ = ["SAVE_KEY", "CheckpointRegion", "PlannedRegion", "generate", "save_policy"]


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
    # save-set nodes that save only their ops with FLOPs under torch.compile (`FLOP_OPS`)
    flop_save: frozenset[str] = frozenset()


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
            env[n] = _copy_node(body, n, env, call if n.name in r.save else None, prog, modules,
                                FLOP_OPS if n.name in r.flop_save else ALL_OPS)
    body.output(tuple(env[every[o]] for o in r.outputs))
    body.lint()
    attrs = prog.attrs
    buffer_args = tuple(i for i, a in enumerate(r.attrs)
                        if isinstance(attrs[a], torch.Tensor)
                        and not isinstance(attrs[a], nn.Parameter))
    called = tuple(prog.gm.get_submodule(n.target) for n in r.nodes if n.op == "call_module")
    random = any(may_draw_random(n, prog.gm) for n in r.nodes)
    return CheckpointRegion(fx.GraphModule(modules, body, class_name=f"Region{label}"),
                            len(r.inputs), bool(r.save), tuple(dict.fromkeys(called)), buffer_args,
                            random)


def _copy_node(g: fx.Graph, node: fx.Node, env: dict[fx.Node, fx.Node],
               call: fx.Node | None, prog: Program, modules: dict[str, Any],
               ops: str = ALL_OPS) -> fx.Node:
    """``node`` in graph ``g`` (its submodule, if any, registered in ``modules`` under a flat
    name); a save-set node (``call`` given) as a `run_saved` call saving ``ops``."""
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
        fn, head = run_saved, (g.get_attr(target),)
    elif node.op == "call_function":  # (the function as an attribute: fx's code names it)
        name = f"f{len(modules)}_{getattr(target, '__name__', 'fn')}"
        modules[name] = target
        fn, head = run_saved, (g.get_attr(name),)
    else:
        fn, head = run_saved_method, (target,)
    new = g.create_node("call_function", fn, (call, node.name, ops, *head, *args), kwargs,
                        name=node.name)
    new.meta = dict(node.meta)
    return new
