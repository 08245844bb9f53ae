"""Autocast's cache of parameter casts in the profile and in `scheduler.measure`.

Under ``torch.autocast`` the cast of each parameter (a leaf that requires grad) is cached until
the outermost autocast block exits: the bf16 copy of a weight lives through the whole step,
whatever a checkpoint drops, and a checkpoint's replay finds it there. The profile holds those
casts in the base (`capture.record`); `measure` starts its measured steps from an empty cache
so that both of its counts see them. The references here are the model's own parameters and
the allocator's count of the model's own step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import scheduler
from scheduler.cost.simulate import simulate
from scheduler.ir.graph import CostGraph
from scheduler.ir.schedule import Schedule
from scheduler.quantities import format_bytes
from scheduler.solvers import get_solver
from scheduler.solvers.base import finish


def gpt() -> tuple[nn.Module, tuple[torch.Tensor]]:
    from examples.gpt import build

    model, (idx, _) = build(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64,
                            batch=2, seed=0)
    return model, (idx,)


def cast_bytes(model: nn.Module) -> int:
    """Bytes of the bf16 casts autocast makes of ``model``'s parameters on the CPU: those of
    its Linear layers (layer norms and embeddings run in float32), each parameter once (the
    language model head's weight is the token embedding's)."""
    params = {id(p): p for m in model.modules() if isinstance(m, nn.Linear)
              for p in m.parameters(recurse=False)}
    return sum(p.numel() * 2 for p in params.values())


@pytest.fixture(scope="module")
def profiled() -> tuple[nn.Module, tuple[torch.Tensor], CostGraph]:
    model, inputs = gpt()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model, inputs, scheduler.profile(model, inputs, mode="real", repeats=1)


def test_the_casts_autocast_caches_are_held_in_the_base(profiled: tuple,
                                                        tmp_path: Path) -> None:
    model, inputs, g = profiled
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert g.meta["autocast_cache"]["bytes"] == cast_bytes(model) > 0
    assert g.param_bytes == params
    assert g.base_bytes == params + inputs[0].numel() * 8 + cast_bytes(model)
    # a node saves a cast from the base, named after its parameter
    sources = {s.source for n in g.nodes for s in n.saved if s.storage is None}
    assert "param:transformer.h.0.attn.c_attn.weight (autocast cast)" in sources
    path = tmp_path / "g.json"
    g.save(path)
    again = CostGraph.load(path)
    assert simulate(again, Schedule.none(again)).peak_bytes == simulate(
        g, Schedule.none(g)).peak_bytes


def test_unscheduled_prediction_is_the_allocators_count_under_autocast(profiled: tuple
                                                                       ) -> None:
    """In a training loop's steady state: the steps before, in the same autocast block, left
    their casts in the cache. The allocator's count of the model's own step saw none of them
    (they were there before the step began): 19% under the prediction here. Where the CPU has
    no native bf16 kernels (AVX2), bf16 ops take another path, and the prediction was 4,096 B
    above the allocator's count there (never below it): the bound is looser on such CPUs."""
    model, inputs, g = profiled
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scheduler.measure(model, inputs, repeats=1)  # (fills the cache)
        m = scheduler.measure(model, inputs, repeats=1)
    predicted = simulate(g, Schedule.none(g)).peak_bytes
    assert m.peak_bytes <= predicted
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():  # (native bf16 kernels: AVX-512 BF16)
        assert abs(predicted - m.allocator_peak_bytes) <= 0.005 * m.allocator_peak_bytes, (
            predicted, m.allocator_peak_bytes)
    else:  # an AVX2 CPU (2026-12-03, AMD EPYC): 4,096 B (1.2%) above, cause not found
        assert 0 <= predicted - m.allocator_peak_bytes <= 0.02 * m.allocator_peak_bytes, (
            predicted, m.allocator_peak_bytes)


def test_a_fake_profile_holds_the_same_casts(profiled: tuple) -> None:
    model, inputs, _ = profiled
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g = scheduler.profile(model, inputs, mode="fake", repeats=1)
    assert g.meta["autocast_cache"]["bytes"] == cast_bytes(model)


def test_no_autocast_holds_nothing(profiled: tuple) -> None:
    model, inputs, _ = profiled
    g = scheduler.profile(model, inputs, mode="fake", repeats=1)
    assert "autocast_cache" not in g.meta
    assert g.base_bytes == sum(p.numel() * 4 for p in model.parameters()) + inputs[0].numel() * 8


def _step(module: nn.Module, inputs: tuple[torch.Tensor], *, fresh: bool = True,
          backward_inside: bool = True, **autocast: bool) -> tuple[torch.Tensor, list]:
    """Loss and gradients of one step under bf16 autocast (``autocast``: its other
    arguments), random ops drawn after seed 0. ``fresh``: from an empty autocast cache (an
    autocast block's first step), else from the cache the caller's block holds;
    ``backward_inside``: backward inside the autocast block, else after it (PyTorch's
    recommendation: checkpoint's replay then enters an autocast of its own)."""
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(0)
    if fresh:
        torch.clear_autocast_cache()
    with torch.autocast("cpu", dtype=torch.bfloat16, **autocast):
        loss = module(*inputs).float().mean()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    grads = [p.grad for p in module.parameters()]
    for p in module.parameters():
        p.grad = None
    return loss.detach(), grads


def _same(got: tuple[torch.Tensor, list], want: tuple[torch.Tensor, list]) -> None:
    assert torch.equal(got[0], want[0])
    assert len(got[1]) == len(want[1])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def _saving_blocks(g: CostGraph) -> Schedule:
    """Each block recomputed, every node of it that allocates saved; the rest kept."""
    spans, names, i = [], g.compute_nodes, 0
    while i < len(names):
        j, block = i, g.node(names[i]).block
        while j < len(names) and g.node(names[j]).block == block:
            j += 1
        save = [n for n in names[i:j] if g.allocates(n)] if block else ()
        spans.append((i, j, "recompute", save) if block else (i, j, "keep"))
        i = j
    return Schedule.from_regions(g, spans, solver="test")


@pytest.mark.parametrize("how", ["fresh", "warm", "backward outside", "cache off"])
def test_a_save_set_replays_under_autocast_as_the_model_runs(profiled: tuple, how: str
                                                             ) -> None:
    """A save set caches its nodes' ops for the replay and matches the replay's ops to
    forward's by op and count. Autocast dispatches no cast of a parameter that its cache
    holds, so forward and the replay need not dispatch the same casts: from an empty cache
    forward casts each weight and the replay (same block) finds them cached; from a warm
    cache (the block's second step) forward finds them; with backward after the block each
    replay enters an autocast of its own with an empty cache. Each of these once handed the
    replay the wrong saved tensor (an error, or wrong values where shapes agree). The
    reference is the unmodified model's step under the same autocast."""
    model, inputs, g = profiled
    schedule = _saving_blocks(g)
    assert sum(len(r.save) for r in schedule.recompute_regions) >= 4
    from examples.gpt import build

    fresh = build(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64, batch=2,
                  seed=0)[0]
    kw: dict = {"cache off": {"cache_enabled": False},
                "backward outside": {"backward_inside": False}}.get(how, {})
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=how != "cache off"):
        module = scheduler.apply(model, schedule, inputs)  # (traced in the autocast it runs)
    if how == "warm":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _step(module, inputs)  # (the block's first step fills the cache)
            got = _step(module, inputs, fresh=False)
            _step(fresh, inputs)
            want = _step(fresh, inputs, fresh=False)
    else:
        got, want = _step(module, inputs, **kw), _step(fresh, inputs, **kw)
    _same(got, want)


def test_a_save_set_under_autocast_is_kept_and_fits_its_prediction(profiled: tuple
                                                                     ) -> None:
    """A solver's save sets on a graph profiled under autocast are kept (`finish` once dropped
    them), and a schedule that saves every allocating node of each block measures (by the
    tensors' count, from an empty cache) within its simulated peak."""
    model, inputs, g = profiled
    assert g.meta["autocast"] == [["cpu", "bfloat16"]]
    schedule = _saving_blocks(g)
    # (finish once dropped the save sets of a graph profiled under autocast)
    kept = finish(g, 1 << 62, schedule, solver="test", started=0.0).schedule
    assert [(r.nodes, r.save) for r in kept.regions] == [
        (r.nodes, r.save) for r in schedule.regions]
    assert "save_sets_dropped" not in kept.meta
    predicted = simulate(g, schedule).peak_bytes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        module = scheduler.apply(model, schedule, inputs)
        m = scheduler.measure(module, inputs, repeats=1, allocator=False)
    assert m.peak_bytes <= predicted


def test_an_infeasible_budget_under_autocast_names_the_cache_and_the_way_out(
        profiled: tuple) -> None:
    """Below what the cached casts leave room for, the error says how many bytes the cache
    holds (the model's own Linear parameters' bf16 casts) and names ``cache_enabled=False``;
    without autocast it says nothing of it."""
    model, inputs, g = profiled
    with pytest.raises(scheduler.InfeasibleBudgetError) as caught:
        scheduler.solve_graph(g, g.base_bytes // 2, time_limit_s=5)
    message = str(caught.value)
    held = format_bytes(cast_bytes(model))
    assert f"{held} are the casts of parameters" in message
    assert "cache_enabled=False" in message
    plain = scheduler.profile(model, inputs, mode="fake", repeats=1)
    with pytest.raises(scheduler.InfeasibleBudgetError) as caught:
        scheduler.solve_graph(plain, plain.base_bytes // 2, time_limit_s=5)
    assert "cache_enabled" not in str(caught.value)


def test_autocast_with_its_cache_off_is_another_signature(profiled: tuple) -> None:
    """A plan solved with autocast's cache on and run with it off (or the other way round)
    runs at a memory it was not solved for (the casts freed by checkpoints, or held all
    step): the call is traced again for it, with a warning that names the cache."""
    model, inputs, g = profiled
    with torch.autocast("cpu", dtype=torch.bfloat16):
        module = scheduler.apply(model, _saving_blocks(g), inputs)
    with pytest.warns(RuntimeWarning, match=r"autocast .*'cache', 'off'"):
        got = _step(module, inputs, cache_enabled=False)
    assert module.forward.traces == 2
    from examples.gpt import build

    fresh = build(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64, batch=2,
                  seed=0)[0]
    _same(got, _step(fresh, inputs, cache_enabled=False))
