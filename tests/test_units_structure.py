"""Units found by structure where a model gives no hints, and a head whose code reads tensor
values running as the user's code around them.

Checked against independent references: module paths read off the models' definitions, the
unmodified model's loss and gradients (bit for bit, same RNG), counted unit calls, and
measured peaks against the budget."""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn as nn

import scheduler
from scheduler.capture.trace import TraceError
from scheduler.measurement.step import measure
from scheduler.units import find_units, units_plan


class Block(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Stage(nn.Module):
    def __init__(self, depth: int, width: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class Nested(nn.Module):
    """Stages of blocks under an encoder, two heads of different shapes, a Sequential of
    different layers: only the stages (or, where the stages differ, their blocks) repeat."""

    def __init__(self, depths: tuple[int, ...]):
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.stages = nn.ModuleList(Stage(d) for d in depths)
        self.heads = nn.ModuleList([nn.Linear(16, 2), nn.Linear(16, 3)])
        self.mix = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))


def test_units_by_structure_are_the_outermost_identical_children_wherever_they_sit() -> None:
    same = find_units(Nested((3, 3)))  # identical stages: the stages
    assert same.paths == ("encoder.stages.0", "encoder.stages.1")
    assert "ModuleList" in same.why and "2 Stage" in same.why
    differ = find_units(Nested((3, 2)))  # the stages differ: each stage's blocks
    assert differ.paths == ("encoder.stages.0.blocks.0", "encoder.stages.0.blocks.1",
                            "encoder.stages.0.blocks.2", "encoder.stages.1.blocks.0",
                            "encoder.stages.1.blocks.1")
    assert "5 Block" in differ.why
    # a plain model keeps the whole-graph default; "auto" finds the same units
    assert find_units(Nested((3, 3)), "default").paths == ()
    assert find_units(Nested((3, 3)), "auto").paths == same.paths


transformers = pytest.importorskip("transformers")


def wav2vec2_ctc(layerdrop: float = 0.1) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A tiny wav2vec2 with a CTC head (its _no_split_modules is empty), from a stock config
    but for its sizes: SpecAugment's time masks (NumPy draws) and layer drop on."""
    torch.manual_seed(0)
    cfg = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, vocab_size=12, layerdrop=layerdrop)
    g = torch.Generator().manual_seed(0)
    batch = {"input_values": torch.randn(2, 1600, generator=g),
             "labels": torch.randint(1, 12, (2, 10), generator=g)}
    return transformers.Wav2Vec2ForCTC(cfg).train(), batch


def deberta_v2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A tiny DeBERTa-v2 for sequence classification (its _no_split_modules is empty)."""
    torch.manual_seed(0)
    cfg = transformers.DebertaV2Config(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
        vocab_size=100, max_position_embeddings=128, num_labels=3)
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 100, (2, 24), generator=g),
             "labels": torch.randint(0, 3, (2,), generator=g)}
    return transformers.DebertaV2ForSequenceClassification(cfg).train(), batch


def test_a_hugging_face_model_without_split_hints_defaults_to_units_by_structure() -> None:
    for build, layers in ((wav2vec2_ctc, "wav2vec2.encoder.layers"),
                          (deberta_v2, "deberta.encoder.layer")):
        model, _ = build()
        assert not model._no_split_modules
        choice = find_units(model, "default")
        assert choice.paths == tuple(f"{layers}.{i}" for i in range(3)), choice
        assert "Hugging Face" in choice.why and "_no_split_modules is empty" in choice.why
        assert find_units(model, "auto").paths == choice.paths
        assert find_units(model, None).paths == ()


def same_step(model: nn.Module, planned: nn.Module, call: Callable[[nn.Module], torch.Tensor]
              ) -> None:
    """Loss and every gradient of ``planned`` equal the unmodified model's, bit for bit, from
    the same torch and NumPy random states (wav2vec2 draws its time masks with NumPy)."""
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    np.random.seed(1)
    want = call(ref)
    want.backward()
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    np.random.seed(1)
    got = call(planned)
    got.backward()
    assert torch.equal(want, got)
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        assert a.grad is None or torch.equal(a.grad, b.grad), name


class ValueHead(nn.Module):
    """Blocks in a ModuleList and a head that reads its labels' values (as DeBERTa's and
    CTC's losses do): neither fx nor export can trace the step."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        logits = self.out(h).mean(1)
        kept = (labels >= 0).nonzero().view(-1)
        if kept.numel() > 0:
            return nn.functional.cross_entropy(logits[kept], labels[kept])
        return logits.sum() * 0


def test_a_head_that_reads_values_runs_as_the_users_code() -> None:
    """units='auto' plans the blocks and the head runs as written: planned calls, no
    fallback, loss and gradients equal the model's, measured peak within the budget. The
    whole-graph plan, which would run the head as one graph for every batch, still refuses."""
    torch.manual_seed(0)
    model = ValueHead().train()
    g = torch.Generator().manual_seed(0)
    x, labels = torch.randn(4, 64, 8, generator=g), torch.tensor([1, -1, 3, 0])
    with pytest.raises(TraceError, match="nonzero|data-dependent|control flow"):
        scheduler.solve(model, (x, labels), budget=0.7, units=None, time_limit_s=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = scheduler.solve(model, (x, labels), budget=0.7, units="auto", time_limit_s=5)
    assert plan.units.paths == ("layers.0", "layers.1", "layers.2")
    assert plan.schedule.recompute_regions
    units = units_plan(plan.module)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no unit falls back
        same_step(model, plan.module, lambda m: m(x, labels))
        got = measure(plan.module, (x, labels), repeats=1, allocator=False).peak_bytes
    assert units.fallback_calls == 0 and units.planned_calls >= 2 * len(units.forwards) > 0
    assert got <= plan.budget_bytes, (got, plan.budget_bytes)
    # other labels (another number kept) run the same plan, as the head's own code
    other = torch.tensor([-1, -1, 2, 2])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        same_step(model, plan.module, lambda m: m(x, other))
    assert units.fallback_calls == 0


def check_acceptance(model: nn.Module, batch: dict[str, torch.Tensor], layers: str,
                     largest: Callable[[bool], Any] = lambda on: None) -> None:
    """``solve(model, batch, budget="70%")`` with defaults plans every layer, its unit calls
    run planned with the model's loss and gradients, and its measured peak (of the largest
    step: ``largest(True)`` makes it) is within the budget."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = scheduler.solve(model, batch, budget="70%")
    assert plan.units.paths == tuple(f"{layers}.{i}" for i in range(3)), plan.units
    assert "_no_split_modules is empty" in plan.units.why
    units = units_plan(plan.module)
    assert units.forwards and plan.schedule.recompute_regions
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no unit falls back
        same_step(model, plan.module, lambda m: m(**batch).loss)
        largest(True)
        try:
            got = measure(plan.module, batch, repeats=1, allocator=False).peak_bytes
            own = measure(model, batch, repeats=1, allocator=False).peak_bytes
        finally:
            largest(False)
    assert units.fallback_calls == 0 and units.planned_calls >= len(units.forwards)
    assert got <= plan.budget_bytes < own, (got, plan.budget_bytes, own)


@pytest.mark.slow  # (a real profile and the default solve: about 30 s)
def test_wav2vec2_ctc_plans_in_its_layers_with_defaults() -> None:
    """Issue 58's wav2vec2: the CTC loss (its output size depends on the labels) and the
    layer drop run as the model's code; the profile is of the step with every layer (layer
    drop off while recording), and the peak is measured for that step."""
    model, batch = wav2vec2_ctc(layerdrop=0.5)

    def all_layers(on: bool) -> None:
        model.config.layerdrop = 0.0 if on else 0.5

    check_acceptance(model, batch, "wav2vec2.encoder.layers", all_layers)
    assert model.config.layerdrop == 0.5


@pytest.mark.slow  # (a real profile and the default solve: about 65 s)
def test_deberta_v2_classification_plans_in_its_layers_with_defaults() -> None:
    """Issue 58's DeBERTa-v2: the loss's ``nonzero`` of the labels runs as the model's code."""
    model, batch = deberta_v2()
    check_acceptance(model, batch, "deberta.encoder.layer")
