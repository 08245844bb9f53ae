"""Counting the work of each op a step runs: its FLOPs and the bytes it reads and writes.

`OpCounter` is a dispatch mode the recorder runs the step under (`record.Recorder`); its
counts are what a fake profile's times are estimated from (`roofline`, `node_times`) and what
`Node.flop_share` is weighed with. It reads shapes only, so it counts fake tensors' ops too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter"]


class OpCounter(TorchDispatchMode):
    """Counts each op's floating-point operations (``torch.utils.flop_counter``'s formulas:
    matmuls, convolutions, attention) and the bytes it reads and writes (its tensor inputs
    and outputs, each tensor once), and passes them to ``on_op(flops, nbytes, half)``, where
    ``half`` says whether it works in half precision (a bf16/fp16 tensor among its inputs and
    outputs). Works on fake tensors: only shapes are read."""

    def __init__(self, on_op: Any):
        super().__init__()
        from torch.utils.flop_counter import flop_registry
        self.registry = flop_registry
        self.on_op = on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops = 0
        count = self.registry.get(func._overloadpacket)
        if count is not None:
            try:
                flops = int(count(*args, **kwargs, out_val=out))
            except Exception:  # noqa: BLE001 - a formula that does not fit this overload
                flops = 0
        seen: set[int] = set()
        nbytes = 0
        half = False
        for t in pytree.tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                half = half or t.dtype in (torch.float16, torch.bfloat16)
                k = id(t)
                if k not in seen:
                    seen.add(k)
                    nbytes += t.numel() * t.element_size()
        self.on_op(flops, nbytes, half)
        return out

