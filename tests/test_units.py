"""Units: the plan runs inside the model's own forward, taking over its repeated blocks.

Checked against independent references: the unmodified model's loss and gradients (bit for
bit), hooks counted as they fire, module paths read from the model, measured peaks."""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import scheduler
from scheduler.ir.region import KEEP, RECOMPUTE, Region, ScheduleError
from scheduler.ir.replays import check, legalize, unit_calls
from scheduler.ir.schedule import Schedule
from scheduler.measurement.step import measure
from scheduler.capture.usercode import UserCodeWarning
from scheduler.units import find_units, units_plan

transformers = pytest.importorskip("transformers")


def tiny_llama(layers: int = 4, **kw: Any) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        attn_implementation="sdpa", **kw)
    return transformers.LlamaForCausalLM(cfg).train()


def gpt() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from examples import gpt as example
    return example.build(batch=2, block_size=32, n_layer=3, n_embd=64, vocab_size=128)


def same_step(model: nn.Module, planned: nn.Module, call: Callable[[nn.Module], torch.Tensor]
              ) -> None:
    """The planned module's loss and every gradient equal the unmodified model's, bit for
    bit, from the same RNG state."""
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    want = call(ref)
    want.backward()
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    got = call(planned)
    got.backward()
    assert torch.equal(want, got)
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name


@pytest.fixture(scope="module")
def llama_plans() -> dict[str, Any]:
    """A tiny Hugging Face Llama from a stock config (use_cache=True, as every config has)
    and its plans at two budgets."""
    model = tiny_llama()
    x = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": x, "labels": x}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = {f: scheduler.solve(model, batch, budget=f, time_limit_s=10, units="auto")
                 for f in (0.85, 0.7)}
    return {"model": model, "batch": batch, "plans": plans}


def test_find_units_auto_and_named() -> None:
    model = tiny_llama(layers=3)
    auto = find_units(model)
    assert auto.paths == ("model.layers.0", "model.layers.1", "model.layers.2")
    assert "_no_split_modules" in auto.why
    layer = type(model.model.layers[0])
    assert find_units(model, layer).paths == auto.paths
    assert find_units(model, "model.layers.*").paths == auto.paths
    assert find_units(model, ["model.layers.1", "model.norm"]).paths == (
        "model.layers.1", "model.norm")
    assert find_units(model, lambda p, m: p.endswith("mlp")).paths == tuple(
        f"model.layers.{i}.mlp" for i in range(3))
    assert find_units(model, None).paths == ()
    g, _ = gpt()
    assert find_units(g).paths == tuple(f"transformer.h.{i}" for i in range(3))
    assert "ModuleList" in find_units(g).why
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    assert find_units(cnn).paths == ()  # not identical children: whole-graph plan
    with pytest.raises(ValueError, match="matches no submodule"):
        find_units(model, "layers.*")
    with pytest.raises(ValueError, match="is not understood"):
        find_units(model, 3)


def test_llama_plans_run_inside_the_models_forward(llama_plans: dict[str, Any]) -> None:
    """Every step runs the units' regions (counted), loss and gradients equal the model's,
    every recompute region lies in one layer, and the model itself is untouched."""
    model, batch = llama_plans["model"], llama_plans["batch"]
    layers = list(model.model.layers)
    for frac, plan in llama_plans["plans"].items():
        assert plan.units.paths == tuple(f"model.layers.{i}" for i in range(4))
        assert "inside the model's own forward" in plan.summary()
        # the model's own forward: its signature, for Trainer's column filter
        assert "forward" not in plan.module.__dict__
        for r in plan.schedule.recompute_regions:
            paths = {plan.graph.node(n).module_path for n in r.nodes}
            units = {p.split(".")[2] if p.startswith("model.layers.") else None for p in paths}
            assert len(units) == 1 and None not in units, (frac, paths)
        units = units_plan(plan.module)
        assert units is not None and units.forwards
        before = units.planned_calls
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no fallback
            same_step(model, plan.module, lambda m: m(**batch).loss)
        assert units.planned_calls - before == len(units.forwards)
        assert units.fallback_calls == 0
    assert list(model.model.layers) == layers
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_units_plan_peak_is_the_eager_models_and_within_budget(
        llama_plans: dict[str, Any]) -> None:
    """The profile is of the eager step: no mask that eager SDPA skips. The measured peak of
    the unplanned model matches the plan's unscheduled prediction, and each plan's measured
    peak is within its budget."""
    model, batch = llama_plans["model"], llama_plans["batch"]
    own = measure(model, batch, repeats=1, allocator=False).peak_bytes
    for frac, plan in llama_plans["plans"].items():
        assert abs(plan.unconstrained_peak_bytes - own) <= 0.02 * own, (frac, own)
        got = measure(plan.module, batch, repeats=1, allocator=False).peak_bytes
        assert got <= plan.budget_bytes, (frac, got, plan.budget_bytes)


def test_hooks_fire_once_per_training_call(llama_plans: dict[str, Any]) -> None:
    model, batch = llama_plans["model"], llama_plans["batch"]
    plan = llama_plans["plans"][0.7]
    planned_unit = next(iter(units_plan(plan.module).forwards))
    fired: list[str] = []
    mods = dict(plan.module.named_modules())
    handles = [mods[p].register_forward_hook(lambda *a, p=p: fired.append(p))
               for p in (planned_unit, "model.norm", "lm_head")]
    try:
        plan.module(**batch).loss.backward()
    finally:
        for h in handles:
            h.remove()
        for p in model.parameters():
            p.grad = None
    assert sorted(fired) == sorted([planned_unit, "model.norm", "lm_head"])


@pytest.mark.slow
def test_solve_warns_only_of_the_hooks_inside_planned_units() -> None:
    """Hooks registered before solving: on a module inside a unit (lost in a planned call),
    on a unit and outside the units (they fire). One warning, naming only the first; a
    training step fires exactly the other two."""
    model = tiny_llama()
    fired: list[str] = []
    for path in ("model.layers.0.mlp", "model.layers.1", "model.norm"):
        model.get_submodule(path).register_forward_hook(lambda *a, p=path: fired.append(p))
    x = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": x, "labels": x, "use_cache": False}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = scheduler.solve(model, batch, budget=0.6, solver="every_block", units="auto")
    said = [str(w.message) for w in caught if issubclass(w.category, UserCodeWarning)]
    assert len(said) == 1 and "'model.layers.0.mlp'" in said[0], said
    assert "'model.layers.1'" not in said[0] and "'model.norm'" not in said[0]
    assert "model.layers.0" in units_plan(plan.module).forwards
    fired.clear()
    plan.module(**batch).loss.backward()
    assert fired == ["model.layers.1", "model.norm"]


def test_hf_gradient_checkpointing_on_a_plan_is_refused(llama_plans: dict[str, Any]) -> None:
    plan = llama_plans["plans"][0.7]
    with pytest.raises(ValueError, match="gradient_checkpointing=False"):
        plan.module.gradient_checkpointing_enable()
    llama_plans["model"].gradient_checkpointing_enable()  # the model's own is untouched
    llama_plans["model"].gradient_checkpointing_disable()


def test_gpt_units_with_dropout_match_the_model() -> None:
    model, inputs = gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = scheduler.solve(model, inputs, budget=0.8, time_limit_s=10, units="auto")
    assert plan.units.paths and units_plan(plan.module).forwards
    same_step(model, plan.module, lambda m: m(*inputs))
    assert units_plan(plan.module).fallback_calls == 0
    # whole-graph plans remain (the default for a model without _no_split_modules)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat = scheduler.solve(model, inputs, budget=0.8, time_limit_s=10)
    assert not flat.units.paths and "forward" in flat.module.__dict__
    same_step(model, flat.module, lambda m: m(*inputs))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_an_encoder_plans_its_layers_by_default(attention: str) -> None:
    """A Hugging Face encoder (BERT: a bidirectional mask, which eager code skips when nothing
    is padded) is planned in its layers without ``units=`` (it declares _no_split_modules);
    every layer call runs the plan (none falls back because its ops differ from the
    profiled step's), loss and gradients equal the model's, and the measured peak is within
    the budget."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, attn_implementation=attention)
    model = transformers.BertForMaskedLM(cfg).train()
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 96, (2, 32), generator=g),
             "labels": torch.randint(0, 96, (2, 32), generator=g)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = scheduler.solve(model, batch, budget=0.8, time_limit_s=10)
    assert plan.units.paths[-3:] == tuple(f"bert.encoder.layer.{i}" for i in range(3))
    assert "_no_split_modules" in plan.units.why and plan.schedule.recompute_regions
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no unit falls back
        same_step(model, plan.module, lambda m: m(**batch).loss)
        got = measure(plan.module, batch, repeats=1, allocator=False).peak_bytes
    units = units_plan(plan.module)
    assert units.fallback_calls == 0 and units.planned_calls >= 2 * len(units.forwards)
    assert got <= plan.budget_bytes


def test_regions_are_split_at_the_units(llama_plans: dict[str, Any]) -> None:
    """A recompute region across units (or outside them) is refused by `check` and split
    by `legalize` into one region per unit call, the model's own code kept."""
    g = llama_plans["plans"][0.7].graph
    names = g.compute_nodes
    calls = unit_calls(g)
    assert [p for p, _, _ in calls] == [f"model.layers.{i}" for i in range(4)]
    bad = Schedule([Region(RECOMPUTE, tuple(names))])
    with pytest.raises(ScheduleError, match="not within one call"):
        check(g, bad)
    fixed, moves = legalize(g, bad)
    assert moves
    check(g, fixed)
    rc = [r for r in fixed.regions if r.policy == RECOMPUTE]
    assert [(names.index(r.nodes[0]), names.index(r.nodes[-1]) + 1) for r in rc] == [
        (a, b) for _, a, b in calls]
    assert all(r.policy == KEEP for r in fixed.regions if r not in rc)


def test_other_shapes_run_the_plan_and_warn_once(llama_plans: dict[str, Any]) -> None:
    """Another batch size and sequence length runs the units' regions (the values equal the
    model's) with the traces made when solving, which hold for every size export kept
    symbolic (no trace per shape), with one warning that the predicted memory was for other
    shapes."""
    model, plan = llama_plans["model"], llama_plans["plans"][0.85]
    y = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(5))
    units = units_plan(plan.module)
    before, traces = units.planned_calls, units.traces
    with pytest.warns(RuntimeWarning, match="it was solved for"):
        same_step(model, plan.module, lambda m: m(input_ids=y, labels=y).loss)
    assert units.planned_calls - before == len(units.forwards) and units.fallback_calls == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # said once
        same_step(model, plan.module, lambda m: m(input_ids=y, labels=y).loss)
    assert scheduler.planned(plan.module) is units and units.traces == traces


def test_a_saved_units_schedule_applies_to_the_model(llama_plans: dict[str, Any],
                                                     tmp_path: Any) -> None:
    """`scheduler.apply` of a saved units schedule: the model's own forward with the same
    units planned, its step bit-equal to the model's; other shapes or another model are
    refused with one line."""
    model, batch = llama_plans["model"], llama_plans["batch"]
    plan = llama_plans["plans"][0.7]
    assert plan.schedule.meta["units"]["paths"] == list(plan.units.paths)
    plan.save(tmp_path / "s.json")
    module = scheduler.apply(model, tmp_path / "s.json", batch)
    units = units_plan(module)
    assert units is not None and set(units.forwards) == set(units_plan(plan.module).forwards)
    same_step(model, module, lambda m: m(**batch).loss)
    assert units.planned_calls == len(units.forwards) and units.fallback_calls == 0
    short = {k: v[:, :32] for k, v in batch.items()}
    with pytest.raises(ScheduleError, match="fingerprint.*input shapes differ"):
        scheduler.apply(model, plan.schedule, short)
    with pytest.raises(ScheduleError, match="units are not"):
        scheduler.apply(gpt()[0], plan.schedule, batch)


def test_a_units_plan_solved_on_the_meta_device_applies_to_the_real_model() -> None:
    """Planned from fake tensors on a model built on the meta device, applied to the real
    model: it runs its units, measures within the budget, and computes the model's step."""
    model = tiny_llama()
    with torch.device("meta"):
        meta = tiny_llama()
    ids = torch.empty((2, 64), dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = scheduler.solve(meta, {"input_ids": ids, "labels": ids}, budget=0.6,
                               time_limit_s=5, units="auto", mode="fake", times="roofline",
                               device_spec="cpu")
    x = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": x, "labels": x}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (the stock config's use_cache)
        module = scheduler.apply(model, plan.schedule, batch)
        peak = measure(module, batch, repeats=1, allocator=False).peak_bytes
    assert peak <= plan.budget_bytes, (peak, plan.budget_bytes)
    units = units_plan(module)
    assert units.forwards and units.planned_calls > 0 and units.fallback_calls == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        same_step(model, module, lambda m: m(**batch).loss)


@pytest.mark.parametrize("units", ["auto", None])
def test_a_plan_keeps_no_parameter_it_was_traced_with(units: Any) -> None:
    """What ``fully_shard`` does to a plan's module (new parameter objects set on its modules,
    the user's model dropped) frees the parameters the plan was traced with: its traces do
    not keep them alive (they did, a full copy of every planned unit's parameters on each
    rank). The plan then trains on the new ones."""
    import gc
    import weakref

    model = tiny_llama(layers=3)
    x = torch.randint(0, 128, (2, 128), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": x, "labels": x, "use_cache": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = scheduler.solve(model, batch, budget=0.85, time_limit_s=10, units=units)
    assert any(r.policy == RECOMPUTE for r in plan.schedule.regions)
    old = [weakref.ref(p) for p in model.parameters()]
    del model
    for mod in plan.module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                setattr(mod, name, nn.Parameter(p.detach().clone()))
    gc.collect()
    assert [r for r in old if r() is not None] == []
    plan.module(**batch).loss.backward()
    assert all(p.grad is not None for p in plan.module.parameters())


@pytest.mark.slow  # (profiles four times: about 15 s idle, 50 s on a loaded machine)
def test_a_units_profile_from_python_saves_solves_and_applies_in_units(tmp_path: Any) -> None:
    """`scheduler.profile(model, batch, units="auto")` of a stock Hugging Face config (its
    ``use_cache=True`` stopped the whole-graph trace), saved, solved from the file alone
    (`solve_graph`), applied (`scheduler.apply`): the module runs the model's forward with
    every layer call planned, none falling back, its loss and gradients bit-equal to the
    model's, its measured peak within the budget. The default, ``units="default"``, is the
    same for a model that declares ``_no_split_modules``, as `solve`'s is; units=None is
    one graph, and a bad ``units`` is refused before anything is traced."""
    model = tiny_llama(layers=3)
    x = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": x, "labels": x}
    said: list[str] = []
    graph = scheduler.profile(model, batch, units="auto", repeats=1, progress=said.append)
    layers = tuple(f"model.layers.{i}" for i in range(3))
    assert graph.units == layers and any(m.startswith("units: ") for m in said)
    path = tmp_path / "g.json"
    graph.save(path)
    result = scheduler.solve_graph(path, "70%", time_limit_s=2)
    assert result.schedule.recompute_regions
    assert result.schedule.meta["units"]["paths"] == list(layers)
    result.schedule.save(tmp_path / "s.json")
    module = scheduler.apply(model, tmp_path / "s.json", batch)
    units = units_plan(module)
    assert units is not None and set(units.forwards) == set(layers)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no unit falls back
        same_step(model, module, lambda m: m(**batch).loss)
        peak = measure(module, batch, repeats=1, allocator=False).peak_bytes
    assert units.fallback_calls == 0 and units.planned_calls >= 2 * len(layers)
    assert peak <= result.budget_bytes
    default = scheduler.profile(model, batch, mode="fake", times="roofline", device_spec="cpu")
    assert default.units == layers
    from examples.mlp import build

    flat = scheduler.profile(*build(batch=8, dim=16, depth=2), mode="fake", times="roofline",
                             device_spec="cpu")
    assert flat.units == () and flat.nodes  # (no _no_split_modules: one graph by default)
    with pytest.raises(ValueError, match="units='model.nothing.*'"):
        scheduler.profile(model, batch, units="model.nothing.*")
