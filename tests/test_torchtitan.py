"""torchtitan's Llama 3, built by torchtitan itself, trains with plans at three budgets with the
model's own loss and gradients, and measures within each budget.

The model is torchtitan 0.2.2's ``"debugmodel"`` flavour (sdpa attention, whose CPU kernel has a
backward; one RoPE table ``freqs_cis`` read by every block), shrunk to stay within seconds
(`_models.titan_llama3`). It needs torchtitan and what it imports
(`_models.TITAN_INSTALL`, all ``--no-deps``; ``.ci/run`` installs them); without them the test
is skipped, saying what to install. (``pytest.importorskip("torchtitan")`` would skip it
for the wrong reason: ``import torchtitan`` fails without triton, which this model does not
need, see `_models._import_titan`.)
"""

from __future__ import annotations

import pytest
import torch
from conftest import benchmark_modules

import scheduler

(_models,) = benchmark_modules("_models")


def _step(module: torch.nn.Module, params: list[torch.nn.Parameter], inputs: tuple
          ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for p in params:
        p.grad = None
    loss = module(*inputs)
    loss.backward()
    return loss.detach().clone(), [p.grad.clone() for p in params]


BUDGETS = ("90%", "70%", "50%")


@pytest.fixture(scope="module")
def runs() -> dict:
    """Per budget: the plan, one training step of ``plan.module`` against the unmodified
    model's (loss and every gradient) and one measured step (both counts)."""
    try:
        model, inputs = _models.titan_llama3()()
    except _models.Unavailable as e:
        pytest.skip(str(e))
    assert any(n.endswith("freqs_cis") for n, _ in model.named_buffers())  # the shared RoPE table
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    want_loss, want_grads = _step(model, params, inputs)
    out = {}
    for budget in BUDGETS:
        plan = scheduler.solve(model, inputs, budget=budget, repeats=1, time_limit_s=5.0)
        loss, grads = _step(plan.module, params, inputs)
        # bit for bit: a replay runs the same CPU kernels on the same inputs as the first run
        diff = {n: (g - w).abs().max().item() for n, g, w in zip(names, grads, want_grads)
                if not torch.equal(g, w)}
        m = scheduler.measure(plan.module, inputs, repeats=1, warmup=0, allocator=True)
        out[budget] = dict(plan=plan, same_loss=torch.equal(loss, want_loss), grad_diff=diff,
                           measured=m)
    return out


@pytest.mark.slow  # three solves of a real model: a minute or two on two busy cores
@pytest.mark.parametrize("budget", BUDGETS)
def test_torchtitan_llama3_trains_with_plans_its_own_gradients_within_budget(runs, budget):
    r = runs[budget]
    plan, m = r["plan"], r["measured"]
    assert plan.schedule.regions, "a plan that checkpoints nothing tests nothing"
    assert r["same_loss"] and not r["grad_diff"], r["grad_diff"]
    assert m.peak_bytes <= plan.budget_bytes, (m.peak_bytes, plan.budget_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("budget", BUDGETS)
def test_torchtitan_llama3_plans_fit_by_the_allocators_count(runs, budget):
    r = runs[budget]
    assert r["measured"].allocator_peak_bytes <= r["plan"].budget_bytes, (
        r["measured"].allocator_peak_bytes, r["plan"].budget_bytes)
