"""The block DP on Hugging Face models built from configs (random weights, no download):
their layers read tensors the prefix made (mask, rotary cos/sin), which `pinning` pins so
that layer boundaries become cuts. Fake profiles (roofline times on the CPU spec) but for the
real measurement."""

from __future__ import annotations

import os
import random
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch

import scheduler
from scheduler.capture.trace import default_loss_recipe
from scheduler.cost.simulate import simulate
from scheduler.ir.schedule import KEEP, RECOMPUTE, Schedule
from scheduler.plan import solve_graph
from scheduler.solvers.base import FEASIBLE, INFEASIBLE, OPTIMAL
from scheduler.solvers.blockdp import (_merged, _work_of, blocks_of, floor_bytes, route_of, search,
                                       table_of)
from scheduler.solvers.blocktable import build_schedule
from scheduler.solvers.pinning import pin

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "capture"))
from _fake_cases import FAKE, example, llama

tf = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LAYERS = 4


def _vit() -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    cfg = tf.ViTConfig(image_size=32, patch_size=4, num_channels=3, hidden_size=32,
                       num_hidden_layers=LAYERS, num_attention_heads=2, intermediate_size=64,
                       num_labels=5, attn_implementation="eager")
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, 5, (2,), generator=torch.Generator().manual_seed(2))
    return tf.ViTForImageClassification(cfg).train(), {"pixel_values": pixels, "labels": labels}


GPT2 = {"batch": 2, "seq_len": 64, "n_layer": LAYERS, "n_head": 2, "n_embd": 32, "vocab_size": 64}
MODELS = {
    "llama": llama(layers=LAYERS, seq=64),
    "llama_sdpa": llama(layers=LAYERS, seq=64, attn="sdpa"),
    "gpt2": example("hf_gpt2", **GPT2),
    "vit": _vit,
}
_GRAPHS: dict[str, Any] = {}


def graph(name: str) -> Any:
    if name not in _GRAPHS:
        model, inputs = MODELS[name]()
        _GRAPHS[name] = scheduler.profile(model, inputs, **FAKE, units=None)
    return _GRAPHS[name]


@pytest.mark.parametrize("name", list(MODELS))
def test_blocks_found_one_per_layer(name: str) -> None:
    g = graph(name)
    chain = blocks_of(g).chain
    assert len(chain) == LAYERS, blocks_of(g).describe()
    assert blocks_of(g).repeats


@pytest.mark.parametrize("name", ["llama", "llama_sdpa", "gpt2"])
def test_shared_inputs_are_pinned_on_a_copy(name: str) -> None:
    g = graph(name)
    before = dict(g.storages)
    route = route_of(g)
    assert route is not None and route.changed and route.graph is not g
    assert g.storages == before  # the caller's graph is not changed
    assert route.graph.fingerprint == g.fingerprint
    pinned = [sid for sid, st in route.graph.storages.items() if st != g.storages[sid]]
    assert pinned and all(route.anchor in route.graph.storages[s].savers for s in pinned)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("frac", [0.5, 0.7])
def test_blocks_fits_on_the_original_graph(name: str, frac: float) -> None:
    g = graph(name)
    budget = int(frac * simulate(g, Schedule.none(g)).peak_bytes)
    r = solve_graph(g, budget, solver="blocks", time_limit_s=20)
    assert r.status != INFEASIBLE
    assert simulate(g, r.schedule).peak_bytes <= budget  # re-simulated on the original
    if route_of(g) is not None and route_of(g).changed:
        assert r.schedule.meta.get("pinned")
        assert r.status == FEASIBLE and not r.space_optimal


def _random_schedule(g: Any, rng: random.Random) -> Schedule:
    """Regions at random positions (not only cuts), random policies and save sets."""
    n = len(g.compute_nodes)
    points = sorted({0, n, *rng.sample(range(1, n), rng.randint(1, 12))})
    spans = []
    for a, b in pairwise(points):
        if rng.random() < 0.5:
            spans.append((a, b, KEEP))
        else:
            nodes = g.compute_nodes[a:b]
            save = {x for x in nodes if g.allocates(x) and rng.random() < 0.2}
            spans.append((a, b, RECOMPUTE, save))
    return Schedule.from_regions(g, spans)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_pinned_peak_bounds_the_original(name: str) -> None:
    """The soundness argument of `pinning`: for any schedule, the pinned copy's simulated
    peak is at least the original's (here: 60 random schedules)."""
    g = graph(name)
    pinned = pin(g).graph
    rng = random.Random(0)
    for _ in range(60):
        s = _random_schedule(g, rng)
        assert simulate(g, s).peak_bytes <= simulate(pinned, s).peak_bytes


def _loss_and_grads(module: torch.nn.Module, inputs: Any) -> tuple[Any, list]:
    torch.manual_seed(7)  # dropout
    out = module(**inputs) if isinstance(inputs, dict) else module(*inputs)
    loss = default_loss_recipe(out)(out)  # the loss `scheduler.measure` uses
    params = [p for p in module.parameters() if p.requires_grad]
    return loss.detach(), torch.autograd.grad(loss, params)


def test_gpt2_blocks_plan_measured_fits_and_computes_the_same() -> None:
    """A real profile and measurement on CPU: the `blocks` plan at 60% of the unscheduled
    peak runs with measured peak <= budget, loss and gradients equal to the model's."""
    model, inputs = example("hf_gpt2", **GPT2)()
    plan = scheduler.solve(model, inputs, budget="60%", solver="blocks", mode="real",
                           repeats=1)
    assert plan.status != INFEASIBLE
    assert plan.schedule.meta.get("pinned")
    measured = scheduler.measure(plan.module, inputs, repeats=1)
    assert measured.peak_bytes <= plan.budget_bytes, (measured.peak_bytes, plan.budget_bytes)
    loss_a, grads_a = _loss_and_grads(plan.module, inputs)
    loss_b, grads_b = _loss_and_grads(model, inputs)
    assert torch.equal(loss_a, loss_b)
    assert len(grads_a) == len(grads_b)
    for a, b in zip(grads_a, grads_b):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def units_8b_shaped() -> Any:
    """The units graph of a Llama-3-8B-shaped model (8 layers, sequence 2048) built on the
    meta device, fake profile: the shapes where the block table's costs went wrong."""
    cfg = tf.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8,
                         attn_implementation="sdpa")
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16).train()
    ids = torch.empty((1, 2048), dtype=torch.long, device="meta")
    plan = scheduler.solve(model, {"input_ids": ids, "labels": ids}, budget=1.0,
                           units="auto", mode="fake", times="roofline", device_spec="h100")
    assert plan.graph.units
    return plan.graph


@pytest.mark.parametrize("fine", [False, True])
def test_units_block_table_composes_exactly(units_8b_shaped: Any, fine: bool) -> None:
    """On a graph with units, every entry of the block table composes exactly (the two ends
    of a kind measured apart where one simulation of both splits the stages otherwise: before,
    the fine table's all-kept step was composed 2.8% above the simulator's peak), the DP's
    composed peaks are within 0.1% of the simulator's at three budgets, and no run across a
    unit's calls is measured (the rewriter refuses them): only one-stage options outside
    units."""
    work, _ = _work_of(units_8b_shaped)
    table = table_of(work, fine=fine)
    assert all(e.exact for e in table.entries.values())
    assert all(m == 1 for _, m, _ in table.refused)
    unscheduled = simulate(work, Schedule.none(work)).peak_bytes
    least = floor_bytes(table)
    assert least < unscheduled
    for budget in (unscheduled, (least + unscheduled) // 2, least):
        found = search(table, budget)
        assert found is not None, budget
        _, steps, composed, exact = found
        schedule = build_schedule(work, _merged(table, steps))
        peak = simulate(work, schedule).peak_bytes
        assert exact and abs(composed - peak) <= 0.001 * peak, (budget, composed, peak)


def test_auto_answers_everything_kept_where_it_fits(units_8b_shaped: Any) -> None:
    """A budget the unscheduled step fits: nothing recomputed, OPTIMAL at once."""
    g = units_8b_shaped
    budget = simulate(g, Schedule.none(g)).peak_bytes
    r = solve_graph(g, budget, time_limit_s=20)
    assert r.status == OPTIMAL and r.estimate.recompute_s == 0 and r.estimate.peak_bytes <= budget
    assert all(reg.policy == KEEP for reg in r.schedule.regions)
    assert r.solve_s < 2
