"""`max_batch` on the GPT and U-Net examples: the answer's plan measured at that size fits, and at
the next size up the least-peak plan measured does not (or the overhead limit is exceeded);
bad input; ``scheduler max-batch``. Budgets are set from measured peaks, in bytes."""

from __future__ import annotations

import json

import pytest
import torch
from _cli import run
from conftest import unscheduled_peak

import scheduler
from scheduler.budget import InfeasibleBudgetError

GPT = dict(block_size=16, n_layer=2, n_head=2, n_embd=32, vocab_size=64)
UNET = dict(channels=3, size=16, base=4, classes=2)


def gpt_factory(batch: int = 2):
    from examples.gpt import build

    return build(batch=batch, **GPT)


def unet_factory(batch: int = 2):
    from examples.unet import build

    return build(batch=batch, **UNET)


def least_peak_measured(factory, n: int) -> tuple[int, int]:
    """(predicted, measured) peak of the plan with the least predicted peak at size ``n``;
    measured by the allocator's count, which a real profile's prediction is of (kernels'
    scratch included)."""
    model, inputs = factory(batch=n)
    graph = scheduler.profile(model, inputs, repeats=1)
    try:
        result = scheduler.solve_graph(graph, 1, solver="dp")
    except InfeasibleBudgetError as e:
        result = scheduler.solve_graph(graph, e.min_feasible_bytes, solver="dp")
    module = scheduler.apply(model, result.schedule, inputs)
    return (result.estimate.peak_bytes,
            scheduler.measure(module, inputs, repeats=1).allocator_peak_bytes)


def measured_unscheduled_peak(factory, n: int) -> int:
    model, inputs = factory(batch=n)
    return scheduler.measure(model, inputs, repeats=1).peak_bytes


def check_answer(factory, budget: int) -> scheduler.MaxBatch:
    r = scheduler.max_batch(factory, budget=budget, solver="dp")
    usable = int(budget * 0.9)
    assert r.usable_bytes == usable and r.size >= 2 and r.dim == "batch"
    # the answer's plan, measured here on a fresh model, fits
    model, inputs = factory(batch=r.size)
    module = scheduler.apply(model, r.plan.schedule, inputs)
    measured = scheduler.measure(module, inputs, repeats=1).peak_bytes
    assert measured <= usable and r.measured_peak_bytes == measured
    assert r.plan.estimate.peak_bytes <= usable
    # one more: no plan fits; the least-peak plan, measured, exceeds the usable budget
    assert r.next.size == r.size + 1 and not r.next.fits
    assert "no schedule fits" in r.next.reason
    predicted, measured_next = least_peak_measured(factory, r.size + 1)
    assert predicted > usable and measured_next > usable
    return r


@pytest.mark.slow  # (profiles and solves many batch sizes)
def test_gpt_largest_batch_fits_and_the_next_does_not():
    # twice the unscheduled step at batch 2: checkpointing stretches past it
    budget = 2 * measured_unscheduled_peak(gpt_factory, 2)
    r = check_answer(gpt_factory, budget)
    assert r.plan.estimate.overhead > 0  # it took checkpointing to get there
    assert measured_unscheduled_peak(gpt_factory, r.size) > r.usable_bytes
    # the bracket: the profiles at 2 and 4 extrapolated close to the answer, so few sizes
    # were profiled beyond them
    assert r.predicted_size is not None and abs(r.predicted_size - r.size) <= 2
    assert len(r.probes) <= 5 and [p.size for p in r.probes][:2] == [2, 4]


@pytest.mark.slow
def test_unet_largest_batch_fits_and_the_next_does_not():
    budget = 2 * measured_unscheduled_peak(unet_factory, 2)
    check_answer(unet_factory, budget)


@pytest.mark.slow
def test_max_overhead_zero_is_the_largest_batch_without_checkpointing():
    budget = 2 * measured_unscheduled_peak(gpt_factory, 2)
    r = scheduler.max_batch(gpt_factory, budget=budget, max_overhead=0.0, solver="dp")
    assert r.plan.estimate.overhead == 0
    # without recompute the only plan is the unscheduled step: measured, it fits at the
    # answer and not one further, where the plan that fits needs recompute
    assert measured_unscheduled_peak(gpt_factory, r.size) <= r.usable_bytes
    assert measured_unscheduled_peak(gpt_factory, r.size + 1) > r.usable_bytes
    assert not r.next.fits and "overhead" in r.next.reason
    assert r.next.overhead is not None and r.next.overhead > 0


def test_nothing_fits_gives_size_zero():
    model, inputs = gpt_factory(batch=1)
    graph = scheduler.profile(model, inputs, repeats=1)
    least = simulate_least(graph)
    r = scheduler.max_batch(gpt_factory, budget=least // 2, solver="dp")
    assert r.size == 0 and r.plan is None and not r.next.fits and r.next.size == 1
    assert "no schedule fits" in r.summary()


def simulate_least(graph) -> int:
    try:
        scheduler.solve_graph(graph, 1, solver="dp")
    except InfeasibleBudgetError as e:
        return e.min_feasible_bytes
    return unscheduled_peak(graph)


def no_size(seed: int = 0):
    return gpt_factory(batch=2)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(budget=0), r"bad budget 0: it must be positive"),
    (dict(budget="8G"), r"bad budget '8G'"),
    (dict(budget=0.5), r"bad budget 0\.5"),
    (dict(budget="1MB", headroom=1.0), r"headroom must be a fraction in \[0, 1\)"),
    (dict(budget="1MB", max_overhead=-0.1), r"max_overhead must be a fraction >= 0.*-0\.1"),
    (dict(budget="1MB", solver="magic"), r"unknown solver 'magic'"),
    (dict(budget="1MB", dim="block"), r"factory 'gpt_factory' takes no keyword 'block'"),
])
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        scheduler.max_batch(gpt_factory, **kwargs)


def test_factory_without_the_size_keyword_names_it_and_the_fix():
    with pytest.raises(ValueError, match=r"'no_size' takes no keyword 'batch' \(its "
                                         r"parameters: seed\); give it one.*dim="):
        scheduler.max_batch(no_size, budget="1MB")


@pytest.mark.slow  # (profiles each size as one rank, and solves twice more)
def test_per_rank_the_answer_is_the_largest_size_solve_fits_per_rank():
    """With ``parallel``, the sizes are planned for one rank, as `solve(parallel=...)` plans
    them: at the answer solve fits the usable budget per rank, one more it cannot; the answer
    is predicted only (not measured), and says so."""
    budget = int(1.2 * measured_unscheduled_peak(gpt_factory, 2))
    r = scheduler.max_batch(gpt_factory, budget=budget, parallel="fsdp2:4+adamw")
    assert r.size >= 1 and r.measured is None and r.measured_peak_bytes is None
    assert r.parallel == "FSDP2 over 4 ranks (nccl, adamw state)"
    assert r.plan.graph.meta["parallel"] == r.parallel and r.plan.units.paths
    assert "not measured" in r.summary() and "per rank of FSDP2 over 4 ranks" in r.summary()
    model, inputs = gpt_factory(batch=r.size)
    plan = scheduler.solve(model, inputs, budget=r.usable_bytes, parallel="fsdp2:4+adamw")
    assert plan.estimate.peak_bytes <= r.usable_bytes
    assert plan.units.paths == r.plan.units.paths
    model, inputs = gpt_factory(batch=r.size + 1)
    with pytest.raises(InfeasibleBudgetError):
        scheduler.solve(model, inputs, budget=r.usable_bytes, parallel="fsdp2:4+adamw")
    # the plan runs the model: its gradients are those of the same model unplanned
    model, inputs = gpt_factory(batch=r.size)
    reference, _ = gpt_factory(batch=r.size)
    reference.load_state_dict(r.plan.module.state_dict())
    for m in (r.plan.module, reference):
        torch.manual_seed(1)  # (the same dropout masks)
        m(*inputs).sum().backward()
    for (name, a), b in zip(r.plan.module.named_parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad), name
    with pytest.raises(ValueError, match=r"fsdp3"):
        scheduler.max_batch(gpt_factory, budget=budget, parallel="fsdp3")


def test_cli_max_batch(tmp_path):
    spec = tmp_path / "models.py"
    spec.write_text("from examples.gpt import build as _b\n\n"
                    f"def small(batch=2):\n    return _b(batch=batch, **{GPT!r})\n")
    budget = 2 * measured_unscheduled_peak(gpt_factory, 2)
    path = tmp_path / "out.json"
    code, out, err = run(["max-batch", f"{spec}:small", "--budget", str(budget),
                          "--solver", "dp", "--json", str(path)])
    assert code == 0, err
    data = json.loads(path.read_text())
    assert data["size"] >= 2 and data["measured_peak_bytes"] <= data["usable_bytes"]
    assert f"largest batch: {data['size']}" in out
    code, out, err = run(["max-batch", f"{spec}:small", "--budget", "1MB", "--dim", "seq"])
    assert code == 2 and out == ""
    assert err.strip().startswith("scheduler: error: factory 'small' takes no keyword 'seq'")
    code, _, err = run(["max-batch", f"{spec}:small", "--budget", "1MB",
                        "--max-overhead", "lots"])
    assert code == 2 and "expected a fraction" in err
    code, out, err = run(["max-batch", f"{spec}:small", "--budget", "1MB",
                          "--parallel", "fsdp2:x"])
    assert code == 2 and out == "" and "fsdp2:x" in err
