"""A units plan trained by Hugging Face's own `Trainer`, with default arguments: the plan's
units run at every step, losses, evaluation and the saved weights equal a `Trainer` run of
the unmodified model (bit for bit, same seed), and a step's measured peak is within the
budget."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import scheduler
from scheduler.units import units_plan

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS = 5


def _data(n: int, seq: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        x = torch.randint(0, 128, (seq,), generator=g)
        rows.append({"input_ids": x, "labels": x.clone()})
    return rows


def _run(model: torch.nn.Module, out: Path, **args: Any
         ) -> tuple[Any, list[float], dict[str, float]]:
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2,
        per_device_eval_batch_size=2, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, **args)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(16),
                                   eval_dataset=_data(4))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses, trainer.evaluate()


def _models() -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """Two copies of one tiny Llama (the unmodified one, the one to plan, in training mode)
    and a batch of ids."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(  # a stock config, only sizes changed (use_cache=True)
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1)
    model = transformers.LlamaForCausalLM(cfg)
    return copy.deepcopy(model), copy.deepcopy(model).train(), torch.stack(
        [r["input_ids"] for r in _data(2)])


def test_trainer_with_default_arguments_runs_the_plan(tmp_path: Path) -> None:
    plain, ours, x = _models()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = scheduler.solve(ours, {"input_ids": x, "labels": x}, budget=0.75,
                               time_limit_s=10, units="auto")
    units = units_plan(plan.module)
    assert units is not None and units.forwards

    _, want, want_eval = _run(plain, tmp_path / "plain")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a unit that falls back fails here
        trainer, got, got_eval = _run(plan.module, tmp_path / "plan")
    assert len(got) == STEPS
    assert got == want
    assert got_eval["eval_loss"] == want_eval["eval_loss"]
    assert units.planned_calls == STEPS * len(units.forwards)
    assert units.fallback_calls == 0
    # the step Trainer runs (forward and backward of a collated batch, in training mode:
    # `evaluate` left the module in eval mode), measured after training: within the budget,
    # and planned (not the model's own forward)
    peak = scheduler.measure(plan.module.train(), {"input_ids": x, "labels": x}, repeats=1,
                             allocator=False).peak_bytes
    assert peak <= plan.budget_bytes, (peak, plan.budget_bytes)
    assert units.fallback_calls == 0 and units.planned_calls > STEPS * len(units.forwards)

    plan.module.save_pretrained(tmp_path / "saved_plan")
    plain.save_pretrained(tmp_path / "saved_plain")
    a = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved_plan").state_dict()
    b = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved_plain").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    with pytest.raises(ValueError, match="gradient_checkpointing=False"):
        transformers.Trainer(model=plan.module, args=transformers.TrainingArguments(
            output_dir=str(tmp_path / "gc"), max_steps=1, gradient_checkpointing=True,
            report_to=[], use_cpu=True), train_dataset=_data(2)).train()


@pytest.mark.slow
def test_trainer_in_bf16_runs_the_plan_solved_under_autocast(tmp_path: Path) -> None:
    """``bf16=True`` (Trainer's forward under bf16 autocast, with its cache of weight casts
    on): the plan solved under the same autocast runs every step planned, with the losses of
    the unmodified model's run, and its step measures within the budget by both counts (the
    plan's code runs with the cache off, as profiled)."""
    plain, ours, x = _models()
    batch = {"input_ids": x, "labels": x}
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("ignore")
        plan = scheduler.solve(ours, batch, budget=0.7, time_limit_s=10, units="auto")
    units = units_plan(plan.module)
    assert units is not None and units.forwards

    _, want, _ = _run(plain, tmp_path / "plain", bf16=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a unit that falls back fails here
        _, got, _ = _run(plan.module, tmp_path / "plan", bf16=True)
    assert len(got) == STEPS and got == want
    assert units.planned_calls >= STEPS * len(units.forwards) and units.fallback_calls == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m = scheduler.measure(plan.module.train(), batch, repeats=1)
    assert m.peak_bytes <= plan.budget_bytes and m.allocator_peak_bytes <= plan.budget_bytes
    assert units.fallback_calls == 0
