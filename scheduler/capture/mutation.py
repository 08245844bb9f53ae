"""In-place writes and aliasing in a traced graph: which inputs a node writes into
(`mutated_inputs`), which values may share storage (`alias_groups`), and which reads a replay
would see written (`written_reads`).

Tracing uses them to keep in the model the writes a model output depends on
(`trace.TraceInfo.loss_nodes`); profiling records `written_reads` in the `CostGraph`, where
they become the recompute regions the rewriter refuses (`ir.replays`), and the rewriter checks
them again (`regions.CheckpointedStep`).
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx
from torch.utils import _pytree as pytree

__all__ = ["alias_groups", "mutated_inputs", "written_reads"]


#: fx-level callables that write into their first argument.
_WRITES_FIRST = {operator.setitem, operator.iadd, operator.isub, operator.imul,
                 operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
                 operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift}


def mutated_inputs(node: fx.Node) -> list[fx.Node]:
    """The input nodes ``node`` writes into in place. ATen ops say so in their schema
    (``Tensor(a!)``); fx-level calls are recognised by ``operator.setitem`` and friends, a
    trailing underscore (``x.add_``, ``torch.relu_``), ``inplace=True`` or an ``out=``."""
    schema = getattr(node.target, "_schema", None)
    if node.op == "call_function" and schema is not None:
        return [x for a, arg in zip(_bound_args(node, schema), schema.arguments)
                if arg.alias_info is not None and arg.alias_info.is_write for x in a]
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    out = [node.kwargs["out"]] if isinstance(node.kwargs.get("out"), fx.Node) else []
    name = getattr(node.target, "__name__", node.target) if node.op != "call_module" else ""
    inplace = node.kwargs.get("inplace") is True or (
        node.op == "call_module" and getattr(_module_of(node), "inplace", False) is True)
    in_place_name = isinstance(name, str) and (
        name.endswith("_") and not name.startswith("__") or name in ("__setitem__",))
    if first is not None and (node.target in _WRITES_FIRST or inplace or in_place_name):
        return [first, *out]
    return out


def _module_of(node: fx.Node) -> Any:
    """The submodule a ``call_module`` node calls (None for other nodes)."""
    owner = node.graph.owning_module
    return owner.get_submodule(node.target) if node.op == "call_module" and owner else None


def _bound_args(node: fx.Node, schema: Any) -> list[list[fx.Node]]:
    """The nodes in each of an ATen node's arguments, in schema order (a ``Tensor[]``
    argument holds several)."""
    return [[x for x in pytree.tree_leaves(node.args[i] if i < len(node.args)
                                           else node.kwargs.get(a.name))
             if isinstance(x, fx.Node)]
            for i, a in enumerate(schema.arguments)]


#: fx-level methods and functions whose result is a view of their first argument.
_VIEWS = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "expand",
          "expand_as", "narrow", "squeeze", "unsqueeze", "flatten", "unflatten", "t",
          "select", "chunk", "split", "unbind", "as_strided", "detach", "contiguous",
          "movedim", "moveaxis", "swapaxes", "swapdims", "unfold", "diagonal", "view_as_real",
          "view_as_complex", "real", "imag", "getitem", "__getitem__"}


def alias_groups(gm: fx.GraphModule, nodes: list[fx.Node]) -> dict[fx.Node, int]:
    """Each node of ``gm``'s alias group, from the calls of ``nodes`` (the nodes that run,
    `trace.model_nodes`): nodes whose values may share storage get the same id. ATen
    ops alias the arguments their schema annotates (views and in-place ops, ``Tensor(a)``);
    fx-level calls alias their first argument when they are views (`_VIEWS`, ``x[:, 1:]``)
    or write into it (`mutated_inputs`); any other call is taken to allocate its result."""
    parent: dict[fx.Node, fx.Node] = {n: n for n in gm.graph.nodes}

    def root(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in nodes:
        schema = getattr(n.target, "_schema", None)
        if n.op == "call_function" and schema is not None:
            aliased = [x for a, arg in zip(_bound_args(n, schema), schema.arguments)
                       if arg.alias_info is not None for x in a]
        else:
            name = getattr(n.target, "__name__", n.target) if n.op != "call_module" else ""
            first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            aliased = mutated_inputs(n) or ([first] if first is not None and name in _VIEWS
                                            else [])
        for a in aliased:
            parent[root(a)] = root(n)
    ids: dict[fx.Node, int] = {}
    return {n: ids.setdefault(root(n), len(ids)) for n in gm.graph.nodes}


def written_reads(gm: fx.GraphModule, nodes: list[fx.Node]) -> list[tuple[str, str, str]]:
    """``(reader, value, writer)`` for each node of ``nodes`` (the nodes that run, in order)
    and each value it reads (a node, or ``input:<name>`` for anything that does not run: a
    placeholder) whose storage a node of ``nodes`` writes in place: ``writer`` the last such
    node. Only reads where a recompute region could start after the value and at or before
    the write, with the reader inside, are listed: those the rewriter refuses
    (`ir.replays`). Values that alias an attribute (buffers) are left out: a replay restores
    the buffers it mutates."""
    group = alias_groups(gm, nodes)
    attr_groups = {group[n] for n in gm.graph.nodes if n.op == "get_attr"}
    pos = {n: i for i, n in enumerate(nodes)}
    last: dict[int, fx.Node] = {}
    for n in nodes:
        for a in mutated_inputs(n):
            if group[a] not in attr_groups:
                last[group[a]] = n
    out = []
    for n in nodes:
        for a in dict.fromkeys(n.all_input_nodes):
            w = last.get(group[a]) if a.op != "get_attr" else None
            if w is not None and pos.get(a, -1) < min(pos[w], pos[n]):
                out.append((n.name, a.name if a in pos else f"input:{a.name}", w.name))
    return out
