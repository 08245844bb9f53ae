"""Hugging Face models as a user builds them from stock configurations: transformers' own
output-capture hooks (MoE models), ``use_cache=True``, and models built on the meta device.

References are independent of the code under test: a fresh model built with the same seed,
run as it is (its loss, MoE auxiliary loss and gradients), and the same configuration's
profile on the CPU.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import scheduler
from scheduler.units import units_plan
from scheduler.capture.trace import trace
from scheduler.capture.usercode import UserCodeWarning

os.environ.setdefault("HF_HUB_OFFLINE", "1")
tf = pytest.importorskip("transformers")


def ids(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(1, 96, shape, generator=torch.Generator().manual_seed(seed))


BATCH = {"input_ids": ids((2, 16), 1), "labels": ids((2, 16), 2)}


def _mixtral() -> nn.Module:
    return tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.5, use_cache=False, bos_token_id=0, eos_token_id=0))


def _qwen2_moe() -> nn.Module:
    return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_experts=4,
        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5,
        use_cache=False, bos_token_id=0, eos_token_id=0))


MOE: dict[str, Callable[[], nn.Module]] = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe}


def moe(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MOE[name]().train()


def hook_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught
            if issubclass(w.category, UserCodeWarning) and "hooks" in str(w.message)]


def moe_step(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Loss, MoE auxiliary loss and gradients of one step on `BATCH`."""
    for p in module.parameters():
        p.grad = None
    out = module(**BATCH)
    out.loss.backward()
    return (out.loss.detach(), out.aux_loss.detach(),
            [p.grad.clone() for p in module.parameters() if p.grad is not None])


# ------------------------------------------------------------- transformers' own hooks


@pytest.mark.parametrize("units", [None, "auto"])
@pytest.mark.parametrize("name", list(MOE))
def test_transformers_output_capture_hooks_raise_no_false_alarm(name: str, units: Any) -> None:
    """Whole-graph plans trace the capture's data flow; a units plan's units return what the
    hooks inside them capture (`units.capture`): the auxiliary loss (from router logits the
    hooks collect) and the gradients are the model's."""
    model = moe(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = scheduler.solve(model, BATCH, budget=1.0, solver="uniform:2", mode="real",
                               repeats=1, units=units)
    assert hook_warnings(caught) == []
    assert plan.graph is not None and plan.schedule.recompute_regions
    # the hooks are transformers' (a test of the premise: they are there, on inlined layers)
    hooked = [path for path, m in model.named_modules() if m._forward_hooks]
    assert hooked and all(path.startswith("model.layers.") for path in hooked)
    got, want = moe_step(plan.module), moe_step(moe(name))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert want[1] > 0  # the auxiliary loss is there and part of the loss
    assert len(got[2]) == len(want[2]) == sum(1 for _ in model.parameters())
    # the exported graph's backward sums in another order than eager's (bit-equal gradients
    # are not the plan's to promise: solver="none" differs from eager by ~1e-8 too)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b)
    if units:
        counts = units_plan(plan.module)
        assert counts.planned_calls == len(counts.forwards) >= 1 and counts.fallback_calls == 0
        # hidden states asked for at the call (another collector: another trace), and
        # counted by length in the hooks (the first layer's input is prepended once)
        torch.manual_seed(0)
        got = plan.module(**BATCH, output_hidden_states=True).hidden_states
        torch.manual_seed(0)
        want = moe(name)(**BATCH, output_hidden_states=True).hidden_states
        assert len(got) == len(want) == 3
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert counts.fallback_calls == 0


def test_a_user_hook_on_a_moe_layer_still_warns() -> None:
    model = moe("mixtral")
    model.model.layers[1].mlp.register_forward_hook(lambda mod, args, out: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = trace(model, (BATCH["input_ids"], None, None, None, None, BATCH["labels"]))
    said = hook_warnings(caught)
    assert len(said) == 1 and "'model.layers.1.mlp'" in said[0]
    assert "output_capturing_hook" not in said[0]
    assert [h.module for h in gm.meta["scheduler"].unfired_hooks] == ["model.layers.1.mlp"]


# ------------------------------------------------------------- use_cache=True


def test_a_stock_config_with_use_cache_names_the_fix() -> None:
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=32, bos_token_id=0, eos_token_id=0)
    assert config.use_cache  # the stock default
    model = tf.LlamaForCausalLM(config).train()
    inputs = (BATCH["input_ids"], None, None, None, None, BATCH["labels"])
    with pytest.raises(scheduler.TraceError) as e:
        trace(model, inputs)
    msg = str(e.value)
    assert "\n" not in msg and "use_cache=True" in msg and "DynamicCache" in msg
    assert "model.config.use_cache = False" in msg
    # the fix named works: the plan computes the model's own loss and gradients
    model.config.use_cache = False
    plan = scheduler.solve(model, BATCH, budget=1.0, solver="uniform:2", mode="real", repeats=1)
    assert plan.schedule.recompute_regions

    def step(module: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for p in module.parameters():
            p.grad = None
        loss = module(**BATCH).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in module.parameters()]

    got, want = step(plan.module), step(model)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1]):  # sdpa (the stock default) exported sums in another
        torch.testing.assert_close(a, b)  # order than eager: ~1e-8 with solver="none" too
