"""Prototype: a code-generated executor for a (traced graph, schedule) pair.

`generate(gm, schedule)` returns an ``fx.GraphModule`` whose generated ``forward`` runs the
model's nodes in order; every recompute region is one call of a `CheckpointRegion` submodule,
whose body is its own ``fx.GraphModule`` (a copy of the region's nodes). Parameters, buffers
and the user's submodules are referenced (never copied): both the outer and every region
module are built from a ``{target: object}`` dict, so ``get_attr`` / ``call_module`` resolve
to the user's own objects.

Save sets are expressed without mutable state: every save-set node is emitted as
``_saved(fn, *args)``, which runs the node under ``torch.fx.traceback.annotate`` with
``{SAVE_KEY: True}``. The selective-checkpoint policy reads that annotation from
``torch.fx.traceback.current_meta``: in eager the annotation is set while the node's ops
dispatch; under torch.compile dynamo records it in the node's ``meta["custom"]`` and
AOTAutograd's replay of the region graph (``preserve_node_meta``) puts it back into
``current_meta`` while the policy is asked about each ATen op.

Eager-only bookkeeping (RNG after a cached save-set node, BatchNorm-style buffer restore
after the replay) sits behind ``torch.compiler.is_compiling()``: dynamo resolves it to a
constant, so the compiled graph holds no side effects (functionalisation and inductor's RNG
functionalisation do that job there).
"""
from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx import traceback as fx_traceback
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from scheduler.capture.program import Program
from scheduler.capture.trace import model_nodes

SAVE_KEY = "scheduler_save"


# -- save-set marking ---------------------------------------------------------------------
class _EagerCall:
    """One forward call of a region in eager: whether it is the replay, and RNG states."""

    def __init__(self) -> None:
        self.n = 0
        self.rng: dict[str, torch.Tensor] = {}


_STACK: list[_EagerCall] = []


def _saved(key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    with fx_traceback.annotate({SAVE_KEY: True}):
        out = fn(*args, **kwargs)
    if not torch.compiler.is_compiling() and _STACK:
        # eager replay: the cached node drew no random numbers; put the RNG where forward
        # left it (the current CheckpointedModule does the same)
        call = _STACK[-1]
        if call.n > 1:
            torch.set_rng_state(call.rng[key])
        else:
            call.rng[key] = torch.get_rng_state()
    return out


def _saved_method(key: str, name: str, obj: Any, *args: Any, **kwargs: Any) -> Any:
    return _saved(key, getattr(obj, name), *args, **kwargs)


@functools.lru_cache(maxsize=None)
def _is_view(op: Any) -> bool:
    schema = getattr(op, "_schema", None)
    if schema is None:
        return False
    return not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)


def save_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Pure policy: MUST_SAVE for non-view ops of annotated (save-set) nodes."""
    custom = fx_traceback.current_meta.get("custom")
    if custom and custom.get(SAVE_KEY) and not _is_view(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


SAVE_CONTEXT = functools.partial(create_selective_checkpoint_contexts, save_policy,
                                 allow_cache_entry_mutation=True)


# -- region module -------------------------------------------------------------------------
class CheckpointRegion(nn.Module):
    """A recompute region: ``checkpoint(body, *inputs)``; body is an ``fx.GraphModule``."""

    def __init__(self, body: fx.GraphModule, has_save: bool, buffers: list[torch.Tensor]):
        super().__init__()
        self.body = body
        self.has_save = has_save
        object.__setattr__(self, "_buffers_mut", buffers)  # not registered: the user's own

    def forward(self, *args: Any) -> Any:
        if torch.compiler.is_compiling():
            if self.has_save:
                return checkpoint(self.body, *args, use_reentrant=False, context_fn=SAVE_CONTEXT)
            return checkpoint(self.body, *args, use_reentrant=False)
        call = _EagerCall()
        kw = {"context_fn": SAVE_CONTEXT} if self.has_save else {}
        return checkpoint(functools.partial(self._eager_body, call), *args,
                          use_reentrant=False, preserve_rng_state=True, **kw)

    def _eager_body(self, call: _EagerCall, *args: Any) -> Any:
        call.n += 1
        replay = call.n > 1
        saved = []
        if replay and self._buffers_mut:
            with torch.utils._python_dispatch._disable_current_modes(), torch.no_grad():
                saved = [b.clone() for b in self._buffers_mut]
        _STACK.append(call)
        try:
            return self.body(*args)
        finally:
            _STACK.pop()
            if saved:
                with torch.utils._python_dispatch._disable_current_modes(), torch.no_grad():
                    for b, s in zip(self._buffers_mut, saved):
                        b.copy_(s)


# -- generation ----------------------------------------------------------------------------
def _copy_node(g: fx.Graph, node: fx.Node, env: dict[fx.Node, fx.Node],
               save: bool) -> fx.Node:
    def arg(a: fx.Node) -> fx.Node:
        return env[a]
    args, kwargs = fx.map_arg((node.args, node.kwargs), arg)
    if not save:
        new = g.node_copy(node, arg)
    elif node.op == "call_module":
        mod = g.get_attr(node.target)
        new = g.call_function(_saved, (node.name, mod, *args), kwargs)
    elif node.op == "call_function":
        new = g.call_function(_saved, (node.name, node.target, *args), kwargs)
    else:
        new = g.call_function(_saved_method, (node.name, node.target, *args), kwargs)
    return new


def prog_fetch(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _module_from(root: nn.Module, g: fx.Graph, name: str,
                 extra: dict[str, nn.Module] | None = None) -> fx.GraphModule:
    d: dict[str, Any] = dict(extra or {})
    for n in g.nodes:
        if n.op in ("get_attr", "call_module") and n.target not in d:
            d[n.target] = prog_fetch(root, n.target)
    g.lint()
    return fx.GraphModule(d, g, class_name=name)


def generate(gm: fx.GraphModule, schedule: Any) -> fx.GraphModule:
    """The executor for ``schedule`` over the traced ``gm`` (returns the model's output)."""
    prog = Program(gm)
    by_name = prog.by_name
    info = prog.info
    region_of: dict[str, int] = {}
    for ri, r in enumerate(schedule.regions):
        for n in r.nodes:
            region_of[n] = ri
    readers: dict[str, set[int]] = {}
    for n in model_nodes(gm):
        if n.name in info.loss_nodes:
            continue
        for a in n.all_input_nodes:
            readers.setdefault(a.name, set()).add(region_of[n.name])
    out_leaves = [x for x in prog.model_out_leaves if isinstance(x, fx.Node)]
    out_names = {x.name for x in out_leaves}

    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in prog.placeholders:
        env[p] = g.placeholder(p.name)
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            env[n] = g.get_attr(n.target)
    regions: dict[str, nn.Module] = {}
    for ri, r in enumerate(schedule.regions):
        nodes = [by_name[x] for x in r.nodes]
        if not r.recompute:
            for n in nodes:
                env[n] = _copy_node(g, n, env, False)
            continue
        inside = set(r.nodes)
        ins: dict[fx.Node, None] = {}
        for n in nodes:
            for a in n.all_input_nodes:
                if a.name not in inside and a.op != "get_attr":
                    ins[a] = None
        outs = [n for n in nodes if n.name in out_names
                or any(x != ri for x in readers.get(n.name, ()))]
        body = fx.Graph()
        benv: dict[fx.Node, fx.Node] = {}
        for a in ins:
            benv[a] = body.placeholder(a.name)
        for n in gm.graph.nodes:
            if n.op == "get_attr":
                benv[n] = body.get_attr(n.target)
        for n in nodes:
            benv[n] = _copy_node(body, n, benv, n.name in r.save)
        body.output(tuple(benv[o] for o in outs))
        _drop_unused_attrs(body)
        body_gm = _module_from(gm, body, f"Region{ri}")
        bufs = _buffers_of(gm, nodes)
        regions[f"region{ri}"] = CheckpointRegion(body_gm, bool(r.save), bufs)
        call = g.call_module(f"region{ri}", tuple(env[a] for a in ins))
        for i, o in enumerate(outs):
            env[o] = g.call_function(operator.getitem, (call, i))
    leaves = [env[x] if isinstance(x, fx.Node) else x for x in prog.model_out_leaves]
    g.output(pytree.tree_unflatten(leaves, prog.model_out_spec))
    _drop_unused_attrs(g)
    return _module_from(gm, g, "PlanExecutor", regions)


def _drop_unused_attrs(g: fx.Graph) -> None:
    for n in list(g.nodes):
        if n.op == "get_attr" and not n.users:
            g.erase_node(n)


def _buffers_of(gm: fx.GraphModule, nodes: list[fx.Node]) -> list[torch.Tensor]:
    bufs: dict[int, torch.Tensor] = {}
    for n in nodes:
        if n.op == "call_module":
            for b in gm.get_submodule(n.target).buffers():
                bufs[id(b)] = b
    return list(bufs.values())
