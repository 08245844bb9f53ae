"""Counting the work of each op a step runs: its FLOPs and the bytes it reads and writes.

`OpCounter` is a dispatch mode the recorder runs the step under (`record.Recorder`); its
counts are what a fake profile's times are estimated from (`roofline`, `node_times`) and what
`Node.flop_share` is weighed with. It reads shapes only, so it counts fake tensors' ops too.

What is counted:

* **FLOPs**: ``torch.utils.flop_counter``'s formulas (matmuls, convolutions), and for every
  scaled-dot-product attention kernel, forward and backward (flash, efficient, cuDNN, the
  CPU flash kernel, the overrideable fused one), `attention_flops`: two matmuls forward and
  five backward over the pairs of positions the mask lets through, so a causal kernel costs
  about half (``flop_counter`` has no formula for the CPU kernel and ignores ``is_causal``).
* **Bytes**: each tensor the op reads or writes once, at most its storage's size (an
  expanded tensor reads its few elements), not an output that aliases an input (in place).
* **Nothing** for an op that moves no data: a view or alias of its input (``view``, ``t``,
  ``detach``, ``expand``, ``_unsafe_view``) or an op without tensor outputs (``prim.device``,
  ``sym_size``). On a GPU such an op launches no kernel; `roofline` prices it at 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "attention_flops", "moves_no_data"]

#: ops that return a view of their input although their schema does not say so
ALIASING = frozenset({"_unsafe_view", "lift_fresh", "_reshape_alias"})


def _bound(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``func``'s arguments by their schema's names."""
    out = dict(zip((a.name for a in func._schema.arguments), args))
    out.update(kwargs)
    return out


def _pairs(sq: int, sk: int, causal: bool) -> int:
    """Query-key pairs that attention computes: all, or with a causal mask aligned at the
    top left (query i sees keys 0..i, PyTorch's ``is_causal``)."""
    if not causal:
        return sq * sk
    full = min(sq, sk)  # rows 0..full-1 see i + 1 keys, the rest all sk
    return full * (full + 1) // 2 + (sq - full) * sk


def attention_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """FLOPs of a scaled-dot-product attention kernel (``aten._scaled_dot_product_*``,
    forward or backward), None for any other op. Forward: ``q @ k^T`` and ``p @ v``, ``2 *
    b * h_q * pairs * (d_qk + d_v)``; backward: the scores again, ``dP = dO @ v^T``,
    ``dV = P^T @ dO``, ``dQ = dS @ k``, ``dK = dS^T @ q``, ``2 * b * h_q * pairs * (3 d_qk +
    2 d_v)``; ``pairs`` the query-key pairs the mask lets through (`_pairs`: half and a
    diagonal for ``is_causal``). Grouped-query attention broadcasts key/value heads: the
    query's head count is the work. Elementwise softmax work is left to the bytes."""
    name = func._schema.name
    if not name.startswith("aten::_scaled_dot_product_") or "attention" not in name:
        return None
    bound = _bound(func, args, kwargs)
    q, k, v = bound.get("query"), bound.get("key"), bound.get("value")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_nested
               for t in (q, k, v)):
        return None
    b, h, sq, dqk = q.shape
    sk, dv = k.shape[2], v.shape[3]
    pairs = _pairs(int(sq), int(sk), bool(bound.get("is_causal", False)))
    per_pair = 3 * dqk + 2 * dv if name.endswith("_backward") else dqk + dv
    return int(2 * b * h * pairs * per_pair)


def moves_no_data(func: Any, out: Any) -> bool:
    """Whether ``func`` (with output ``out``) moves no data: every output is a view or
    alias of an input (by its schema, or `ALIASING`), or it returns no tensor at all."""
    if not any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(out)):
        return True
    schema = func._schema
    if schema.name.split("::")[-1] in ALIASING:
        return True
    returns = schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                 for r in returns)


def _nbytes(t: torch.Tensor) -> int:
    """Bytes ``t`` reads or writes: its elements, at most its storage (an expanded tensor)."""
    n = t.numel() * t.element_size()
    try:
        return min(n, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # a tensor without a storage
        return n


class OpCounter(TorchDispatchMode):
    """Counts each op's floating-point operations and the bytes it reads and writes (see the
    module docstring) and passes them to ``on_op(flops, nbytes, half)``, where ``half`` says
    whether it works in half precision (a bf16/fp16 tensor among its inputs and outputs); an
    op that moves no data (`moves_no_data`) is not passed on. Works on fake tensors: only
    shapes are read."""

    def __init__(self, on_op: Any):
        super().__init__()
        from torch.utils.flop_counter import flop_registry
        self.registry = flop_registry
        self.on_op = on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops = attention_flops(func, args, kwargs)
        if flops is None:
            flops = 0
            count = self.registry.get(func._overloadpacket)
            if count is not None:
                try:
                    flops = int(count(*args, **kwargs, out_val=out))
                except Exception:  # noqa: BLE001 - a formula that does not fit this overload
                    flops = 0
        if not flops and moves_no_data(func, out):
            return out
        seen: set[int] = set()
        nbytes = 0
        half = False
        for t in pytree.tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                half = half or t.dtype in (torch.float16, torch.bfloat16)
                k = id(t)
                if k not in seen:  # (an output that is an input, in place, counts once)
                    seen.add(k)
                    nbytes += _nbytes(t)
        self.on_op(flops, nbytes, half)
        return out
