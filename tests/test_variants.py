"""Call variants of a units plan (`scheduler.units.variants`): a padded batch, an unpadded one
and every sequence length run planned, within the budget, with the model's gradients; a
dispatch mode around the step (a FLOP counter, a storage tracker) does not turn the plan off.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import scheduler
from scheduler.ir.region import KEEP, RECOMPUTE, Region, ScheduleError
from scheduler.ir.schedule import Schedule
from scheduler.measurement.storage import StorageTracker
from scheduler.units import units_plan
from scheduler.units.variants import (
    VARIANTS,
    UnitRun,
    match_ops,
    runs_from_meta,
    with_extras,
)

transformers = pytest.importorskip("transformers")

SLICE = ("call_function", "aten.slice.Tensor")
MM = ("call_function", "aten.mm.default")
RELU = ("call_function", "aten.relu.default")


def test_match_ops_allows_only_extra_views() -> None:
    ops = (MM, RELU, MM)
    assert match_ops(ops, ops) == [0, 1, 2]
    assert match_ops((MM, SLICE, RELU, SLICE, MM, SLICE), ops) == [0, None, 1, None, 2, None]
    assert match_ops((MM, RELU), ops) is None  # an op missing
    assert match_ops((MM, MM, RELU, MM), ops) is None  # an op more that is not a view
    assert match_ops((MM, RELU, MM), (MM, SLICE, RELU, MM)) is None  # a view missing


def test_extra_views_run_with_the_op_after_them() -> None:
    regions = [Region(KEEP, ("a",)),
               Region(RECOMPUTE, ("b", "c", "d"),
                      inner=(Region(KEEP, ("b",)), Region(RECOMPUTE, ("c", "d"))))]
    got = with_extras(regions, {"c": ["v1"], "b": ["v0"]}, ["v2"])
    assert got[0] == Region(KEEP, ("a",))
    assert got[1].nodes == ("v0", "b", "v1", "c", "d", "v2")
    assert [r.nodes for r in got[1].inner] == [("v0", "b"), ("v1", "c", "d", "v2")]
    flat = [Region(RECOMPUTE, ("a", "b"), frozenset({"b"}))]
    assert with_extras(flat, {"b": ["v"]}, []) == [
        Region(RECOMPUTE, ("a", "v", "b"), frozenset({"b"}))]


def test_variants_round_trip_and_bad_meta() -> None:
    run = UnitRun((MM, RELU), (Region(RECOMPUTE, ("#0", "#1"), frozenset({"#0"})),),
                  frozenset({"#0"}))
    meta = [{"name": "padded", "peak_bytes": 10, "units": {"layers.0": {
        "ops": [list(o) for o in run.ops], "regions": [r.to_dict() for r in run.regions],
        "flop_saves": ["#0"]}}}]
    sched = Schedule([Region(KEEP, ("x",))], meta={VARIANTS: meta})
    back = Schedule.from_dict(sched.to_dict())
    assert runs_from_meta(back) == {"layers.0": [run]}
    bad = Schedule([Region(KEEP, ("x",))], meta={VARIANTS: [{"units": {"l": {"ops": 3}}}]})
    with pytest.raises(ScheduleError, match=r"unit_variants\[0\]\.units\['l'\]"):
        runs_from_meta(bad)


def _llama(layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).train()


def _batch(length: int, pad: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, length, dtype=torch.long)
    if pad:
        mask[1, length - pad:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _grads_equal(model: torch.nn.Module, planned: torch.nn.Module, batch: dict[str, Any]
                 ) -> None:
    ref = copy.deepcopy(model)
    want = ref(**batch).loss
    want.backward()
    for p in model.parameters():
        p.grad = None
    got = planned(**batch).loss
    got.backward()
    assert torch.equal(want, got)
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name
    for p in model.parameters():
        p.grad = None


def _peak(module: torch.nn.Module, batch: dict[str, Any]) -> int:
    return scheduler.measure(module, batch, repeats=1, warmup=0, allocator=False).peak_bytes


def test_padded_batch_first_met_under_dispatch_modes_runs_planned() -> None:
    """Solved on an unpadded batch (no mask), a padded batch (an explicit mask: its layers
    run other ops) first met under `FlopCounterMode` runs planned; measured under the storage
    tracker within the budget, its gradients the model's; the unpadded batch still planned."""
    model = _llama()
    unpadded = {k: v for k, v in _batch(64).items() if k != "attention_mask"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = scheduler.solve(model, unpadded, budget="70%", repeats=1, time_limit_s=10)
    names = [v["name"] for v in plan.schedule.meta[VARIANTS]]
    assert names == ["padded"]
    units = units_plan(plan.module)
    assert units is not None and units.forwards
    padded = _batch(64, pad=9)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a unit that falls back fails here
        with FlopCounterMode(display=False) as flops:
            plan.module(**padded).loss.backward()
        assert flops.get_total_flops() > 0
        assert units.planned_calls == len(units.forwards) and units.fallback_calls == 0
        for p in model.parameters():
            p.grad = None
        # a fresh copy of the plan traces its units inside the tracker: still planned
        fresh = copy.deepcopy(plan.module)
        assert _peak(fresh, padded) <= plan.budget_bytes
        assert units_plan(fresh).fallback_calls == 0 and units_plan(fresh).planned_calls > 0
        _grads_equal(model, plan.module, padded)
        _grads_equal(model, plan.module, unpadded)
        assert _peak(plan.module, unpadded) <= plan.budget_bytes
    assert units.fallback_calls == 0
    # one trace a variant, for every length, and each again with Trainer's loss keywords
    # (solve's warm-up: `units.step.trainer_keywords`)
    assert units.traces == 4


@pytest.mark.slow
def test_a_unit_traced_inside_a_storage_tracker_is_planned() -> None:
    """A dispatch mode that reads storages (what a memory tracker does) around the call that
    traces the units: traced and planned, not abandoned."""
    model = _llama()
    batch = _batch(48)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = scheduler.solve(model, batch, budget="70%", repeats=1, time_limit_s=10)
    fresh = copy.deepcopy(plan.module)
    units = units_plan(fresh)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with StorageTracker():
            fresh(**batch).loss.backward()
    assert units.planned_calls == len(units.forwards) and units.fallback_calls == 0


@pytest.mark.slow
def test_trainer_with_a_padding_collator_over_many_lengths(tmp_path: Path) -> None:
    """`Trainer` with a padding collator over texts of 40 to 96 tokens, 32 steps, the plan
    solved at the longest padded batch: every unit call planned (none unplanned), losses equal
    a Trainer run of the unmodified model, and the step at each length met measures within the
    budget."""
    pytest.importorskip("accelerate")
    model = _llama(layers=3)
    g = torch.Generator().manual_seed(1)
    lengths = [int(n) for n in torch.randint(40, 97, (64,), generator=g)]
    rows = [{"input_ids": torch.randint(0, 127, (n,), generator=g) + 1} for n in lengths]
    rows[0]["input_ids"] = torch.randint(1, 128, (96,), generator=g)
    rows[1]["input_ids"] = torch.randint(1, 128, (90,), generator=g)
    collate = _PadCollator()
    longest = collate(rows[:2])
    plain, ours = copy.deepcopy(model), copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = scheduler.solve(ours, longest, budget="70%", repeats=1, time_limit_s=10)
    units = units_plan(plan.module)
    assert units is not None and units.forwards

    def run(m: torch.nn.Module, out: str) -> list[float]:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / out), max_steps=32, per_device_train_batch_size=2,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
            disable_tqdm=True, remove_unused_columns=False, seed=0)
        trainer = transformers.Trainer(model=m, args=args, train_dataset=rows,
                                       data_collator=collate)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    want = run(plain, "plain")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a unit that falls back fails here
        got = run(plan.module, "plan")
    assert got == want and len(got) == 32
    assert units.planned_calls == 32 * len(units.forwards) and units.fallback_calls == 0
    assert units.traces <= 2
    seen = sorted({int(collate(rows[i:i + 2])["input_ids"].shape[1])
                   for i in range(0, 64, 2)}, reverse=True)
    for n in seen[:3]:  # the longest batches met (the budget holds for the longest)
        batch = next(collate(rows[i:i + 2]) for i in range(0, 64, 2)
                     if collate(rows[i:i + 2])["input_ids"].shape[1] == n)
        assert _peak(plan.module.train(), batch) <= plan.budget_bytes, n


@pytest.mark.slow
def test_trainer_torch_compile_with_a_padding_collator(tmp_path: Path) -> None:
    """`Trainer(torch_compile=True)` with a padding collator over 40 to 96 tokens, 16 steps,
    the plan solved at the longest: every unit call planned (the runtime's count, inside
    compiled code), at most 4 graphs, no graph break (Trainer's loss keywords reach the
    layers: traced when solving), and the compiled step at the longest batch within the
    budget (allocator events)."""
    pytest.importorskip("accelerate")
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    from scheduler.measurement.compiled import compiled_peak

    model = _llama(layers=4)
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(1, 128, (int(n),), generator=g)}
            for n in torch.randint(40, 97, (32,), generator=g)]
    rows[0]["input_ids"] = torch.randint(1, 128, (96,), generator=g)
    collate = _PadCollator()
    longest = collate(rows[:2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = scheduler.solve(model, longest, budget="70%", repeats=1, time_limit_s=10)
    units = units_plan(plan.module)
    assert units is not None and units.forwards
    dynamo.reset()
    counters.clear()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=16, per_device_train_batch_size=2,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        remove_unused_columns=False, torch_compile=True, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a unit that falls back fails here
        transformers.Trainer(model=plan.module, args=args, train_dataset=rows,
                             data_collator=collate).train()
    assert units.planned_calls == 16 * len(units.forwards) and units.fallback_calls == 0
    assert counters["stats"]["unique_graphs"] <= 4 and not counters["graph_break"]
    dynamo.reset()
    peak = compiled_peak(torch.compile(plan.module.train()), longest)
    assert peak <= plan.budget_bytes, (peak, plan.budget_bytes)


class _PadCollator:
    """Right padding to the longest row, labels -100 at the padding (what a padding collator
    for causal language modelling gives)."""

    def __call__(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        n = max(len(r["input_ids"]) for r in rows)
        ids = torch.zeros(len(rows), n, dtype=torch.long)
        mask = torch.zeros(len(rows), n, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r["input_ids"])] = r["input_ids"]
            mask[i, :len(r["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask,
                "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.slow  # (the compiled fit compiles a few plans: minutes on two cores)
def test_a_plan_fitted_for_compile_holds_compiled_with_the_configs_cache_on() -> None:
    """``execution="compiled"`` at 60% on a 4-layer Llama whose config turns the key/value
    cache on (the default): the whole model compiled afresh and called as users call it (no
    ``use_cache`` given) measures within the budget (allocator events), every unit call
    planned. The fit measured the step as profiled, without the cache; before the plan ran
    its training calls without one, the fresh compiled step measured 4.06 MB against a
    3.45 MB budget (the model's own code outside the units runs otherwise with it)."""
    import torch._dynamo as dynamo

    from scheduler.measurement.compiled import compiled_peak

    model = _llama(layers=4)
    assert model.config.use_cache
    batch = {k: v for k, v in _batch(128).items() if k != "attention_mask"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = scheduler.solve(model, batch, budget="60%", repeats=1, time_limit_s=10,
                               execution="compiled")
    units = units_plan(plan.module)
    assert units is not None and units.forwards
    dynamo.reset()
    before = units.planned_calls
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a unit that falls back fails here
        peak = compiled_peak(torch.compile(plan.module), batch)
    assert peak <= plan.budget_bytes, (peak, plan.budget_bytes, plan.compiled_peak_bytes)
    assert units.planned_calls - before == 3 * len(units.forwards)  # (3 compiled steps)
    assert units.fallback_calls == 0
