"""Which nodes of a traced step may draw random numbers, and the size of a checkpoint's RNG stash.

A recompute region that draws random numbers (dropout) must replay with forward's RNG state:
``checkpoint(preserve_rng_state=True)`` stashes it at the region's forward (the CPU
generator's state, 5,056 bytes, and the devices' states, held in host memory), and a save-set
node's `checkpointing.run_saved` stashes it again after the node. A region that draws none
needs neither, and on a CPU that state is memory of the step. `may_draw_random` decides from
the traced node alone, so that the profile (`meta["rng"]`, `cost.rng.RNG_META`), the cost
model's reserve (`cost.rng.rng_stash_bytes`) and the executor agree on which regions stash:

* an ATen op (the `torch.export` path): its ``nondeterministic_seeded`` tag;
* a torch function or tensor method (the fx path): its name (``dropout``, ``bernoulli``,
  ``rand``, ``normal_``, ...), and `scaled_dot_product_attention` by its ``dropout_p``;
* a called module: any dropout module with ``p > 0`` inside it, ``RReLU``, fractional max
  pooling, attention with dropout; another ``torch.nn`` module draws nothing;
* anything it does not know (a module or function of other code left as a leaf) may draw.

It errs towards "may draw" (a stash too many costs 5 KB); the executor checks on a region's
first call that one judged not to draw left the RNG as it was, and raises if not.
"""

from __future__ import annotations

import builtins
import math
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

__all__ = ["may_draw_random", "rng_state_bytes"]

#: name parts (split at ``_``) that make a torch function or method random
_TOKENS = frozenset({"rand", "randn", "randint", "randperm", "normal", "uniform", "exponential",
                     "cauchy", "geometric", "random", "bernoulli", "multinomial", "poisson",
                     "rrelu", "gumbel", "dropout", "dropout1d", "dropout2d", "dropout3d"})
_SUBSTRINGS = ("dropout", "bernoulli", "fractional_max_pool", "rrelu")
_PLAIN = (builtins, operator, math)


def _random_name(name: str) -> bool:
    name = name.lower().strip("_")
    return any(s in name for s in _SUBSTRINGS) or bool(_TOKENS & set(name.split("_")))


def _op_random(op: Any) -> bool:
    if isinstance(op, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in op.tags
    if isinstance(op, torch._ops.OpOverloadPacket):
        return any(torch.Tag.nondeterministic_seeded in getattr(op, o).tags
                   for o in op.overloads())
    return False


def _nonzero(value: Any) -> bool:
    return isinstance(value, fx.Node) or not (isinstance(value, (int, float)) and value == 0)


def _function_random(node: fx.Node) -> bool:
    fn = node.target
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return _op_random(fn)
    if isinstance(fn, torch._ops.HigherOrderOperator):
        return True
    name = getattr(fn, "__name__", "")
    if name == "scaled_dot_product_attention":
        p = node.kwargs.get("dropout_p", node.args[3] if len(node.args) > 3 else 0.0)
        return _nonzero(p)
    module = getattr(fn, "__module__", None) or ""
    if any(module == m.__name__ for m in _PLAIN) or fn in (getattr, setattr, isinstance):
        return False
    if module.startswith("torch") or type(fn).__name__ in ("builtin_function_or_method",
                                                          "method_descriptor"):
        return _random_name(name)
    return True  # (another library's or the user's function, left a leaf by the tracer)


def _module_random(module: nn.Module) -> bool:
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            if m.p > 0:
                return True
        elif isinstance(m, (nn.RReLU, nn.FractionalMaxPool2d, nn.FractionalMaxPool3d)):
            return True
        elif isinstance(m, nn.MultiheadAttention):
            if m.dropout > 0:
                return True
        elif not type(m).__module__.startswith("torch.nn."):
            return True
    return False


def may_draw_random(node: fx.Node, root: nn.Module) -> bool:
    """Whether ``node`` of a graph traced from ``root`` may draw random numbers (module
    docstring: errs towards yes)."""
    if node.op == "call_function":
        return _function_random(node)
    if node.op == "call_method":
        return _random_name(str(node.target))
    if node.op == "call_module":
        return _module_random(root.get_submodule(str(node.target)))
    return False


def rng_state_bytes(device: torch.device | str) -> int:
    """Bytes of the device's memory one checkpoint's RNG stash takes: the CPU generator's
    state on a CPU; nothing on an accelerator (its states are copied to host memory)."""
    return int(torch.get_rng_state().numel()) if torch.device(device).type == "cpu" else 0
