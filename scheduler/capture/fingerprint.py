"""What a traced graph's nodes are, written as a profile records them, and the fingerprint of
its structure that profiling it would give, without profiling.

`target_str` and `shape_str` are the strings a `CostGraph`'s nodes carry (`Node.target`,
`Node.shape`); `traced_fingerprint` runs one no-grad forward (on fake tensors too) to get the
output shapes and builds `CostGraph.fingerprint` from them, so that a saved schedule is checked
against a model (`plan.apply`) without recording a step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..ir.graph import structure_fingerprint
from .program import Program
from .state import preserved_state

__all__ = ["shape_str", "target_str", "traced_fingerprint"]


def target_str(n: fx.Node) -> str:
    """A node's target as recorded (`Node.target`): an attribute or method name, an ATen
    overload's name, a function's qualified name."""
    t = n.target
    if isinstance(t, str):
        return t
    if isinstance(t, torch._ops.OpOverload):
        return str(t)
    return getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or str(t)


def shape_str(value: Any) -> str:
    """A node's output as recorded (`Node.shape`): ``dtype[d0,d1,...]`` for each tensor leaf,
    the type's name for anything else, space-separated."""
    parts = []
    for t in pytree.tree_leaves(value):
        if isinstance(t, torch.Tensor):
            dt = str(t.dtype).removeprefix("torch.")
            parts.append(f"{dt}[{','.join(str(d) for d in t.shape)}]")
        else:
            parts.append(type(t).__name__)
    return " ".join(parts)


def traced_fingerprint(gm: fx.GraphModule, model: nn.Module, inputs: tuple[Any, ...], *,
                       fake: Any = None) -> str:
    """The `CostGraph.fingerprint` that profiling ``gm`` would give, from one no-grad forward
    (no profiling): used to check that a saved schedule fits a model. With a `fake.FakeStep`
    (and ``inputs`` its fakes) the forward runs on fake tensors."""
    prog = Program(gm)
    shapes: dict[str, str] = {}

    def around(i: int, node: fx.Node, thunk: Callable[[], Any]) -> Any:
        out = thunk()
        shapes[node.name] = shape_str(out)
        return out

    active = fake.active(model, gm) if fake is not None else contextlib.nullcontext()
    with preserved_state(model), torch.no_grad(), active:
        prog.run(inputs, around=around)
    compute = {n.name for n in prog.nodes}
    return structure_fingerprint(
        (n.name, n.op, target_str(n),
         tuple(dict.fromkeys(a.name for a in n.all_input_nodes if a.name in compute)),
         shapes[n.name], n.name in prog.info.loss_nodes)
        for n in prog.nodes)
