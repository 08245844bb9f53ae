"""What `OpCounter` counts per op: attention FLOPs by kernel against the matmul formula (and
``torch.utils.flop_counter`` where it has one), nothing for ops that move no data, and the
bytes an op really reads and writes."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

import scheduler
from scheduler.capture.op_counter import OpCounter, attention_flops
from scheduler.capture.roofline import DEVICE_SPECS

aten = torch.ops.aten


def rows(fn: Callable[[], Any]) -> list[tuple[int, int, bool]]:
    got: list[tuple[int, int, bool]] = []
    with OpCounter(lambda *row: got.append(row)):
        fn()
    return got


def pairs(sq: int, sk: int, causal: bool) -> int:
    """Query-key pairs a mask lets through, counted on the mask itself."""
    mask = torch.ones(sq, sk, dtype=torch.bool)
    return int((mask.tril() if causal else mask).sum())


def qkv(b: int = 2, h: int = 4, hk: int = 4, sq: int = 24, sk: int = 24, d: int = 16,
        dv: int = 16, device: str = "meta", grad: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    make = (lambda *s: torch.randn(*s, generator=g, requires_grad=grad)) if device == "cpu" \
        else (lambda *s: torch.empty(*s, device="meta"))
    return make(b, h, sq, d), make(b, hk, sk, d), make(b, hk, sk, dv)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(24, 24), (8, 24), (24, 8)])
def test_every_attention_kernel_costs_its_matmuls(causal: bool, sq: int, sk: int) -> None:
    """Each SDPA kernel's forward is 2 matmuls, its backward 5, over the pairs its mask lets
    through; without a mask that is flop_counter's own count (an independent formula)."""
    q, k, v = qkv(sq=sq, sk=sk, dv=8)
    grad = torch.empty(2, 4, sq, 8, device="meta")
    out, lse = torch.empty_like(grad), torch.empty(2, 4, sq, device="meta")
    share = pairs(sq, sk, causal) / (sq * sk)
    fwd = sdpa_flop_count(q.shape, k.shape, v.shape) * share
    bwd = sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape) * share
    calls = {
        aten._scaled_dot_product_flash_attention.default: (q, k, v, 0.0, causal),
        aten._scaled_dot_product_flash_attention_for_cpu.default: (q, k, v, 0.0, causal),
        aten._scaled_dot_product_efficient_attention.default: (q, k, v, None, True, 0.0,
                                                               causal),
        aten._scaled_dot_product_cudnn_attention.default: (q, k, v, None, True, 0.0, causal),
        aten._scaled_dot_product_flash_attention_backward.default: (
            grad, q, k, v, out, lse, None, None, sq, sk, 0.0, causal, None, None),
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (
            grad, q, k, v, out, lse, 0.0, causal),
        aten._scaled_dot_product_efficient_attention_backward.default: (
            grad, q, k, v, None, out, lse, None, None, 0.0, [True] * 4, causal),
    }
    for op, args in calls.items():
        want = bwd if "backward" in op._schema.name else fwd
        assert attention_flops(op, args, {}) == pytest.approx(want, rel=1e-12), op
    assert attention_flops(aten.mm.default, (q, k), {}) is None


def test_grouped_query_attention_counts_the_query_heads() -> None:
    q, k, v = qkv(h=8, hk=2)
    assert attention_flops(aten._scaled_dot_product_flash_attention_for_cpu.default,
                           (q, k, v, 0.0, False), {}) == 2 * 2 * 8 * 24 * 24 * 32


@pytest.mark.parametrize("causal", [False, True])
def test_the_cpu_kernel_is_counted_as_it_runs(causal: bool) -> None:
    """A real CPU attention forward and backward: one op each way carries the attention
    FLOPs (flop_counter has no formula for the CPU kernel: it counted it as 0)."""
    q, k, v = qkv(device="cpu", grad=True)
    fwd, bwd = [], []
    with OpCounter(lambda *row: fwd.append(row)):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    with OpCounter(lambda *row: bwd.append(row)):
        out.sum().backward()
    share = pairs(24, 24, causal) / 24 ** 2
    assert [f for f, _, _ in fwd if f] == [sdpa_flop_count(q.shape, k.shape, v.shape) * share]
    assert [f for f, _, _ in bwd if f] == [
        sdpa_backward_flop_count(out.shape, q.shape, k.shape, v.shape) * share]


def test_ops_that_move_no_data_cost_nothing() -> None:
    x = torch.randn(32, 64)
    w = torch.randn(64, 64, requires_grad=True)
    for view in (lambda: x.view(64, 32), lambda: x.t(), lambda: x.detach(),
                 lambda: x[:, :8], lambda: x.expand(2, 32, 64), lambda: x.unsqueeze(0),
                 lambda: x.split(8), lambda: aten._unsafe_view(x, (64, 32)),
                 lambda: torch.ops.prim.device(x), lambda: x.transpose(0, 1)):
        assert rows(view) == []
    # a matmul reads both and writes one; in place, the output is the input it wrote
    assert rows(lambda: x @ w.detach()) == [(2 * 32 * 64 * 64, 4 * (32 * 64 * 2 + 64 * 64),
                                             False)]
    y = x.clone()
    assert rows(lambda: y.add_(x)) == [(0, 2 * 32 * 64 * 4, False)]
    # an expanded operand reads its storage: 64 floats, not 32 * 64
    b = torch.randn(64)
    assert rows(lambda: torch.add(x, b.expand(32, 64))) == [(0, 4 * (2 * 32 * 64 + 64), False)]


def test_a_fake_roofline_profile_prices_views_at_nothing() -> None:
    """A fake profile with roofline times at a length where attention is compute-bound: a
    node that only reshapes costs 0; the attention node's forward and backward are their
    causal matmul FLOPs at the device's peak and one launch, within 5%. (Their backward
    steps accumulate gradients: those move data.)"""

    class Attn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(64, 192)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(1, 8192, 3, 4, 16).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    spec = DEVICE_SPECS["h100"]
    g = scheduler.profile(Attn(), (((1, 8192, 64), torch.float32),), mode="fake",
                          times="roofline", device_spec=spec)
    compute = [n for n in g.nodes if not n.is_loss]
    views = [n for n in compute if n.target in ("view", "permute", "getitem")]
    assert len(views) == 5 and all(n.time_s == 0 for n in views)
    sdpa = next(n for n in compute if "scaled_dot_product" in n.target)
    share = pairs(8192, 8192, True) / 8192 ** 2
    shapes = ((1, 4, 8192, 16),) * 3
    fwd = sdpa_flop_count(*shapes) * share / spec.flops_fp32
    bwd = sdpa_backward_flop_count(*((1, 4, 8192, 16),) * 4) * share / spec.flops_fp32
    assert sdpa.time_s == pytest.approx(fwd + spec.per_op_s, rel=0.05)
    assert sdpa.bwd_time_s == pytest.approx(bwd + spec.per_op_s, rel=0.05)
