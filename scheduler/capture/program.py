"""Running a traced graph node by node, the way profiling and the rewritten module both do.

A `Program` evaluates the nodes of a `trace`d ``GraphModule`` against the module's own
attributes (which are the user's parameter objects), frees each value after its last reader,
and splits the output into the model's output and the loss. Profiling instruments it;
`rewrite` runs slices of it as checkpoint regions. Keeping one executor means the profiled
lifetimes are the lifetimes the rewritten module has.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .trace import TraceInfo, model_nodes

__all__ = ["Program"]


class Program:
    """The executable form of a traced step. ``nodes`` are in execution order."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.info: TraceInfo = gm.meta["scheduler"]
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.attrs = {n.name: _fetch_attr(gm, n.target)
                      for n in gm.graph.nodes if n.op == "get_attr"}
        self.nodes = model_nodes(gm)
        self.by_name = {n.name: n for n in self.nodes}
        self.output = next(n for n in gm.graph.nodes if n.op == "output")
        out_leaves = pytree.tree_leaves(self.output.args[0])
        self.model_out_leaves = out_leaves[:-1]
        self.loss_leaf = out_leaves[-1]
        self.model_out_spec = self.info.out_spec.child(0)
        pos = {n: i for i, n in enumerate(self.nodes)}
        end = len(self.nodes)
        # last position at which each value is read; model outputs live to the end of forward
        self.last_read: dict[str, int] = {}
        for n in self.nodes:
            for a in n.all_input_nodes:
                self.last_read[a.name] = max(self.last_read.get(a.name, -1), pos[n])
        for leaf in out_leaves:
            if isinstance(leaf, fx.Node):
                self.last_read[leaf.name] = end
        self.pos = pos

    def inputs_env(self, inputs: Iterable[Any]) -> dict[str, Any]:
        """The environment before any node runs: placeholders and attributes."""
        flat = pytree.tree_leaves(tuple(inputs))
        if len(flat) != len(self.placeholders):
            raise TypeError(f"the traced model takes {len(self.placeholders)} inputs, got "
                            f"{len(flat)}")
        env = {p.name: v for p, v in zip(self.placeholders, flat)}
        env.update(self.attrs)
        return env

    def run_node(self, node: fx.Node, env: dict[str, Any]) -> Any:
        args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: env[a.name])
        if node.op == "call_module":
            return self.gm.get_submodule(node.target)(*args, **kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        self_obj, *rest = args  # call_method
        return getattr(self_obj, node.target)(*rest, **kwargs)

    def free_after(self, i: int, env: dict[str, Any]) -> None:
        """Drop every value whose last reader is the node at position ``i``."""
        node = self.nodes[i]
        for a in (*node.all_input_nodes, node):
            if self.last_read.get(a.name, -1) <= i and a.name in env and a.op != "get_attr":
                del env[a.name]

    def run(self, inputs: Iterable[Any], *,
            around: Callable[[int, fx.Node, Callable[[], Any]], Any] | None = None
            ) -> tuple[Any, torch.Tensor]:
        """Run the whole step and return ``(model_output, loss)``. ``around(i, node, thunk)``,
        when given, wraps each node's execution (for timing and attribution)."""
        env = self.inputs_env(inputs)
        for i, node in enumerate(self.nodes):
            if around is None:
                env[node.name] = self.run_node(node, env)
            else:
                env[node.name] = around(i, node, lambda n=node: self.run_node(n, env))
            self.free_after(i, env)
        return self.outputs(env)

    def outputs(self, env: dict[str, Any]) -> tuple[Any, torch.Tensor]:
        """``(model_output, loss)`` from a finished environment."""
        return self.model_output(env), _val(self.loss_leaf, env)

    def model_output(self, env: dict[str, Any]) -> Any:
        """The model's output (in its own structure) from an environment."""
        return pytree.tree_unflatten([_val(x, env) for x in self.model_out_leaves],
                                     self.model_out_spec)


def _val(leaf: Any, env: dict[str, Any]) -> Any:
    return env[leaf.name] if isinstance(leaf, fx.Node) else leaf


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
