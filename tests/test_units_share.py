"""Identical units share one trace (`scheduler.units.share`) only where their calls run the
same ops: checked against the unmodified model's loss and gradients (bit for bit), so that a
unit given a sibling's trace wrongly computes something else and fails."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

import scheduler
from scheduler.units import units_plan


class Layer(nn.Module):
    def __init__(self, idx: int, width: int = 32, *, odd: int | None = None,
                 scale: bool = False):
        super().__init__()
        self.idx, self.odd = idx, odd
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        # (a plain tensor attribute, not a buffer: each layer its own value)
        self.scale = torch.tensor(1.0 + idx) if scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if self.idx == self.odd:  # (read in forward: this layer runs other ops)
            h = h * 2.0
        if self.scale is not None:
            h = h * self.scale
        return x + self.fc2(torch.tanh(h))


class Net(nn.Module):
    def __init__(self, n: int = 4, **kw: Any):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Layer(i, **kw) for i in range(n))
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


def _planned(model: nn.Module, x: torch.Tensor) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return scheduler.solve(model, (x,), budget=0.9, solver="every_block",
                               units="layers.*", loss_fn=lambda out: out)


def _same_step(model: nn.Module, planned: nn.Module, x: torch.Tensor) -> None:
    ref = copy.deepcopy(model)
    want = ref(x)
    want.backward()
    for p in model.parameters():
        p.grad = None
    got = planned(x)
    got.backward()
    assert torch.equal(want, got)
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name


@pytest.mark.parametrize("kw, traced", [({}, 1), ({"odd": 2}, 2), ({"scale": True}, 4)])
def test_units_share_a_trace_only_where_they_run_the_same_ops(kw: dict, traced: int) -> None:
    """Four layers of one class: identical ones trace once; a layer whose ``forward`` reads
    its index to run other ops, or reads a tensor attribute of its own, traces for itself."""
    model = Net(**kw)
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(1))
    plan = _planned(model, x)
    forwards = list(units_plan(plan.module).forwards.values())
    assert len(forwards) == 4
    _same_step(model, plan.module, x)
    shared = forwards[0]._shared
    signatures = forwards[0].traces
    assert signatures >= 1 and all(f.traces == signatures for f in forwards)
    # (every signature: one trace per distinct op sequence, the rest shared)
    assert shared.shared == (4 - traced) * signatures
    assert units_plan(plan.module).fallback_calls == 0


def test_a_shared_trace_reads_each_units_own_parameters_after_they_change() -> None:
    """After the plan's parameters are replaced (as ``fully_shard`` does) and updated, each
    unit still computes with its own: the step equals the unmodified model's with the same
    new parameters."""
    model = Net()
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(1))
    plan = _planned(model, x)
    assert units_plan(plan.module).forwards["layers.1"]._shared.shared > 0
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            layer.fc1.weight.mul_(1.0 + 0.1 * i)
    _same_step(model, plan.module, x)


def test_hugging_face_layers_of_two_attention_types_share_within_their_ops() -> None:
    """A Hugging Face Qwen3 whose layers 2 and 3 use sliding-window attention (the layers
    differ by ``layer_idx`` only, and are handed the mask of their type): planned in units,
    its step equals the unmodified model's, with traces shared (exported by ``torch.export``,
    parameters read as attributes)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        use_cache=False, use_sliding_window=True, sliding_window=16, max_window_layers=2)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).train()
    assert model.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = scheduler.solve(model, batch, budget=0.9, solver="every_block")
    forwards = list(units_plan(plan.module).forwards.values())
    assert len(forwards) == 4 and forwards[0]._shared.shared > 0
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    want = ref(**batch).loss
    want.backward()
    torch.manual_seed(1)
    got = plan.module(**batch).loss
    got.backward()
    assert torch.equal(want, got)
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name
    assert units_plan(plan.module).fallback_calls == 0
