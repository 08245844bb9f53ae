"""The parts of ``benchmarks/calibrate.py`` that look at one graph: which op kind a node is
(`op_kind`), the node times of each kind (`kind_times`), and this machine's roofline
(`measure_spec`).

A script helper, not part of the package: imported with ``benchmarks/`` on ``sys.path``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from scheduler.capture.roofline import DeviceSpec

__all__ = ["KindTimes", "kind_times", "measure_spec", "op_kind"]


def op_kind(model: nn.Module) -> Callable[[Any], str]:
    """A node's op kind in ``model``'s graph: a module call's class (``Linear``, ``Conv2d``),
    a function's name (``add``, ``scaled_dot_product_attention``), an aten op's without its
    overload (``addmm``: exported graphs, e.g. Hugging Face GPT-2's) or a method's
    (``Tensor.transpose``); the loss nodes are ``loss: NAME``."""
    classes = {path: type(m).__name__ for path, m in model.named_modules()}

    def kind(node: Any) -> str:
        if node.op == "call_module":
            # (the traced step wraps the model: its module targets start with "model.")
            for path in (node.module_path, node.target, node.target.removeprefix("model.")):
                if path in classes:
                    name = classes[path]
                    break
            else:
                name = node.target
        elif node.op == "call_method":
            name = f"Tensor.{node.target}"
        elif node.target.startswith(("aten.", "prims.")):  # an exported graph's op overload
            name = node.target.split(".")[1]  # ("aten.add.Tensor": add)
        else:
            name = node.target.rsplit(".", 1)[-1]
        return f"loss: {name}" if node.is_loss else name

    return kind


@dataclass
class KindTimes:
    """The nodes of one op kind in one profile: how many, and their forward and backward
    seconds added up (`Node.time_s`, `Node.bwd_time_s`)."""

    count: int = 0
    fwd_s: float = 0.0
    bwd_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s


def kind_times(graph: Any, kind: Callable[[Any], str],
               names: set[str] | None = None) -> dict[str, KindTimes]:
    """Each op kind's `KindTimes` over ``graph``'s nodes (only those in ``names`` when given),
    in the graph's order of first appearance."""
    out: dict[str, KindTimes] = {}
    for node in graph.nodes:
        if names is not None and node.name not in names:
            continue
        k = out.setdefault(kind(node), KindTimes())
        k.count += 1
        k.fwd_s += node.time_s
        k.bwd_s += node.bwd_time_s
    return out


def _best_s(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # (warm-up: first-touch page faults, the kernel's first dispatch)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_spec(*, quick: bool = False) -> DeviceSpec:
    """This CPU's roofline at torch's current thread count: peak FLOP/s from a square float32
    ``mm`` (2 n^3 FLOPs, best of 3), bandwidth from copying a large float32 tensor (its bytes
    read and written, best of 3) and the fixed cost of an op from a one-element ``add``
    (median of 5 batches of 1,000). The models run in float32, so the half-precision peak is
    set to the float32 one. ``quick``: smaller sizes (a smoke test's rough numbers)."""
    n, copy_bytes = (512, 32 << 20) if quick else (2048, 256 << 20)
    a, b = torch.randn(n, n), torch.randn(n, n)
    flops = 2 * n**3 / _best_s(lambda: torch.mm(a, b), 3)
    src = torch.ones(copy_bytes // 4)
    dst = torch.empty_like(src)
    bandwidth = 2 * copy_bytes / _best_s(lambda: dst.copy_(src), 3)
    one = torch.ones(1)

    def thousand_adds() -> None:
        for _ in range(1000):
            torch.add(one, one)

    thousand_adds()
    per_op = []
    for _ in range(5):
        t0 = time.perf_counter()
        thousand_adds()
        per_op.append((time.perf_counter() - t0) / 1000)
    return DeviceSpec(f"this CPU, {torch.get_num_threads()} thread(s)", flops=flops,
                      flops_fp32=flops, bandwidth=bandwidth, per_op_s=statistics.median(per_op))
