"""Which traced nodes may draw random numbers (`capture.randomness`), and the RNG state a
plan's checkpoints keep: only regions that draw stash it, and what they stash is within the
budget by the allocator's own count (the profiler's memory events), an independent count."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import scheduler
from scheduler.capture import randomness
from scheduler.capture.randomness import may_draw_random
from scheduler.cost.rng import rng_stash_bytes
from scheduler.checkpointing import CheckpointRegion
from scheduler.rewrite import planned


class _Leaf(nn.Module):
    """A module of other code (not torch.nn): nothing says what it draws."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.1)
        self.off = nn.Dropout(0.0)
        self.leaf = _Leaf()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.off(self.drop(self.lin(x)))
        h = F.dropout(h, 0.2, True) + torch.rand_like(h) + F.normalize(h)
        h = F.scaled_dot_product_attention(h[None], h[None], h[None], dropout_p=0.0)[0]
        h = F.scaled_dot_product_attention(h[None], h[None], h[None], dropout_p=0.5)[0]
        return self.leaf(h.bernoulli_(0.5).relu())


def test_which_nodes_may_draw_random_numbers() -> None:
    class Leaves(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, name: str) -> bool:
            return isinstance(m, _Leaf) or super().is_leaf_module(m, name)

    model = _Mixed()
    graph = Leaves().trace(model)
    got = {n.name: may_draw_random(n, model) for n in graph.nodes}
    assert got == {"x": False, "lin": False, "drop": True, "off": False, "dropout": True,
                   "rand_like": True, "normalize": False, "add": False, "add_1": False,
                   "getitem": False, "getitem_1": False, "getitem_2": False,
                   "scaled_dot_product_attention": False, "getitem_3": False,
                   "getitem_4": False, "getitem_5": False, "getitem_6": False,
                   "scaled_dot_product_attention_1": True, "getitem_7": False,
                   "bernoulli_": True, "relu": False, "leaf": True, "output": False}, got
    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    for op, expected in ((aten.native_dropout.default, True), (aten.bernoulli.p, True),
                         (aten.mm.default, False), (aten.randn_like, True),
                         (aten.relu.default, False)):
        assert may_draw_random(g.call_function(op, (x,)), model) is expected, op


def _gpt(dropout: float):
    from examples.gpt import build

    return build(n_layer=2, dropout=dropout)


def test_only_regions_that_draw_keep_an_rng_state_and_the_plan_fits_by_the_allocator() -> None:
    """The GPT example at 60% (70% without dropout, whose 60% is infeasible):
    with dropout every recompute region stashes the CPU RNG state
    (5,056 bytes each, once outside the cost model: the demo measured 0.4% over its budget by
    the allocator's count), and the budget holds by both counts; without dropout no region
    stashes, and the allocator's count is the tensors' (no stash to add)."""
    for dropout, budget in ((0.1, "60%"), (0.0, "70%")):
        model, inputs = _gpt(dropout)
        plan = scheduler.solve(model, inputs, budget=budget, repeats=1, time_limit_s=10)
        fwd = planned(plan.module)
        code = fwd._steps[fwd.planned_key].code  # (the generated step the plan runs)
        regions = [m for m in code.modules() if isinstance(m, CheckpointRegion)]
        assert regions
        assert any(r.random for r in regions) == (dropout > 0), [r.random for r in regions]
        stash = rng_stash_bytes(plan.graph, plan.schedule)
        assert (stash > 0) == (dropout > 0)
        got = scheduler.measure(plan.module, inputs, repeats=1, allocator=True)
        assert got.allocator_peak_bytes is not None
        assert got.allocator_peak_bytes <= plan.budget_bytes, (
            got.allocator_peak_bytes, plan.budget_bytes, dropout)
        assert got.peak_bytes + stash <= plan.budget_bytes


def test_a_region_wrongly_judged_not_to_draw_raises_instead_of_replaying_other_numbers(
        monkeypatch) -> None:
    model, inputs = _gpt(0.1)
    monkeypatch.setattr(randomness, "may_draw_random", lambda node, root: False)
    monkeypatch.setattr("scheduler.executor.may_draw_random", lambda node, root: False)
    graph = scheduler.profile(model, inputs, repeats=1)
    schedule = scheduler.solvers.get_solver("every_block")(graph, 1 << 62).schedule
    module = scheduler.apply(model, schedule, inputs)
    try:
        module(*inputs)
    except RuntimeError as e:
        assert "judged to draw no random numbers moved the RNG" in str(e)
    else:
        raise AssertionError("a region that drew random numbers without a stash ran")
