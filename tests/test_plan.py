"""`parse_budget`, `solve_graph`, `InfeasibleBudgetError`, and `solve` / `Plan` / `apply` end to
end on the MLP example with the ``greedy`` baseline (the exact solvers are tested with their own
files)."""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings

import pytest
import torch
from _chain import chain
from conftest import budget_bytes, unscheduled_peak

import scheduler
import scheduler.capture.profile
from scheduler import InfeasibleBudgetError, Plan, parse_budget, solve_graph
from scheduler.compiled_fit import COMPILED_PEAK
from scheduler.run_watch import EagerRunWarning
from scheduler.cost.simulate import simulate
from scheduler.ir.schedule import Schedule
from scheduler.solvers import (
    FEASIBLE,
    INFEASIBLE,
    OPTIMAL,
    UnknownSolverError,
    get_solver,
)
from scheduler.solvers.brute import brute_force
from scheduler.quantities import format_bytes

BASELINES = ["none", "every_block", "sqrt", "greedy", "knapsack"]
BLOCKS = ["", "h.0", "h.0", "h.1", "h.1", "h.2", "h.2", "h.3", "h.3", ""]


# ------------------------------------------------------------------------------ parse_budget


@pytest.mark.parametrize(("budget", "expected"), [
    (123_456, 123_456),
    (1, 1),
    ("6GiB", 6 * 2**30),
    ("512MB", 512_000_000),
    ("1.5e9", 1_500_000_000),
    (1.5e9, 1_500_000_000),  # a float above 1 is bytes
    ("2048", 2048),
    (" 100 KiB ", 102_400),
    (0.6, 600),  # fractions of the unconstrained peak (1000 here)
    (1.0, 1000),
    ("0.25", 250),
    ("60%", 600),
    ("100%", 1000),
    ("12.5 %", 125),
    (0.0015, 1),  # rounded down
])
def test_parse_budget_accepts(budget, expected):
    assert parse_budget(budget, 1000) == expected


@pytest.mark.parametrize(("budget", "match"), [
    (-1, r"bad budget -1: it must be positive"),
    (0, r"bad budget 0:"),
    (0.0, r"bad budget 0\.0:"),
    (-0.5, r"bad budget -0\.5:"),
    ("0%", r"bad budget '0%': a percentage must be in"),
    ("150%", r"bad budget '150%'"),
    ("-5%", r"bad budget '-5%'"),
    ("abc", r"bad budget 'abc'; expected .*'6GiB'.*'60%'"),
    ("6G", r"bad budget '6G'"),
    (float("nan"), r"bad budget nan: it must be a positive finite number"),
    (float("inf"), r"bad budget inf"),
    ("nan", r"bad budget 'nan'"),
    (True, r"bad budget True: a bool is not a budget"),
    (None, r"bad budget None"),
    (0.0001, r"less than one byte"),
])
def test_parse_budget_rejects_with_the_value_and_the_forms(budget, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_budget(budget, 1000)
    if "less than" not in match:
        assert "fraction of the unconstrained predicted peak" in str(info.value)


# ------------------------------------------------------------------------------ solve_graph


def test_solve_graph_fractions_refer_to_the_unscheduled_simulated_peak():
    graph = chain(BLOCKS)
    result = solve_graph(graph, "100%", solver="none")
    assert result.budget_bytes == unscheduled_peak(graph)
    assert result.status == FEASIBLE
    result = solve_graph(graph, 0.8, solver="every_block")
    assert result.budget_bytes == budget_bytes(graph, 0.8)
    assert result.estimate == simulate(graph, result.schedule)
    assert result.estimate.peak_bytes <= result.budget_bytes


@pytest.mark.parametrize("solver", ["greedy", "uniform:2", "none", "every_block", "knapsack"])
def test_solve_graph_results_fit_and_match_simulate(solver):
    graph = chain(BLOCKS)
    result = solve_graph(graph, "100%", solver=solver)
    assert result.status in (FEASIBLE, OPTIMAL)
    assert result.estimate.peak_bytes <= result.budget_bytes == unscheduled_peak(graph)
    assert result.schedule.solver == solver
    assert result.estimate == simulate(graph, result.schedule)


def test_solve_graph_headroom_holds_back_part_of_the_budget():
    graph = chain(BLOCKS)
    result = solve_graph(graph, 9000, solver="greedy", headroom=0.25)
    assert result.budget_bytes == 6750
    assert result.estimate.peak_bytes <= 6750
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="headroom"):
            solve_graph(graph, 9000, solver="greedy", headroom=bad)


def test_solve_graph_unknown_solver():
    with pytest.raises(UnknownSolverError, match="valid solvers: .*greedy"):
        solve_graph(chain(BLOCKS), "50%", solver="magic")


@pytest.mark.parametrize("solver", ["greedy", "none", "uniform:2"])
def test_infeasible_budget_names_the_smallest_known_feasible_one(solver):
    graph = chain(BLOCKS, out_bytes=[1000, 3000, 500, 2000, 1000, 4000, 800, 1200, 900, 600])
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_graph(graph, 1500, solver=solver)
    e = info.value
    assert isinstance(e, ValueError)
    assert e.budget_bytes == 1500
    m = e.min_feasible_bytes
    assert m > 1500
    assert str(m) in str(e) and format_bytes(m) in str(e)
    # it is the least peak over the baselines: one of them fits it, none fits a byte less
    assert any(get_solver(b)(graph, m).status == FEASIBLE for b in BASELINES)
    assert all(get_solver(b)(graph, m - 1).status == INFEASIBLE for b in BASELINES)


def test_infeasible_with_headroom_names_the_budget_before_headroom():
    graph = chain(BLOCKS)
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_graph(graph, 1500, solver="greedy", headroom=0.5)
    m = info.value.min_feasible_bytes
    # each baseline's lowest-peak choice (what it returns when nothing fits)
    least = min(get_solver(b)(graph, 1).estimate.peak_bytes for b in BASELINES)
    assert m == math.ceil(least / 0.5)

    def fits(budget: int) -> list[str]:
        ok = []
        for b in BASELINES:
            try:
                solve_graph(graph, budget, solver=b, headroom=0.5)
                ok.append(b)
            except InfeasibleBudgetError:
                pass
        return ok

    assert fits(m) and not fits(m - 2)  # the suggestion works, and is the least that does


def test_a_solver_that_misses_a_budget_a_baseline_fits_says_which():
    graph = chain(BLOCKS)
    every_block = get_solver("every_block")(graph, 10**9).estimate.peak_bytes
    with pytest.raises(InfeasibleBudgetError, match="'every_block' baseline's fits it"):
        solve_graph(graph, every_block, solver="none")


def test_infeasible_with_auto_names_the_exact_minimum():
    """The least budget auto names is brute force's least peak over every schedule of keep
    and recompute regions (10 nodes: every boundary enumerated), and at it auto recomputes
    no more than brute force's optimum there."""
    graph = chain(BLOCKS, out_bytes=[1000, 3000, 500, 2000, 1000, 4000, 800, 1200, 900, 600])
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_graph(graph, 1500, solver="auto")
    m = info.value.min_feasible_bytes
    points = list(range(len(graph.compute_nodes) + 1))
    assert m == brute_force(graph, 0, points=points).min_feasible_bytes
    ref = brute_force(graph, m, points=points)
    got = solve_graph(graph, m, solver="auto")
    assert got.estimate.peak_bytes <= m
    assert got.estimate.recompute_s <= ref.estimate.recompute_s * (1 + 1e-12), (got, ref)
    with pytest.raises(InfeasibleBudgetError):
        solve_graph(graph, m - 1, solver="auto")


# ------------------------------------------------------------------------------ solve, Plan, apply


@pytest.fixture(scope="module")
def mlp():
    from examples.mlp import build

    # dim=64 so that activations, not parameters, dominate the peak and 70% is reachable
    return build(batch=256, dim=64, depth=4)


@pytest.fixture(scope="module")
def plan(mlp) -> Plan:
    model, inputs = mlp
    return scheduler.solve(model, inputs, budget="70%", solver="greedy", repeats=1)


def grads(module, inputs):
    loss = module(*inputs).mean()
    return torch.autograd.grad(loss, [p for p in module.parameters()])


def test_solve_plan_module_computes_the_same(mlp, plan):
    model, inputs = mlp
    assert isinstance(plan, Plan)
    assert plan.module is not model
    assert torch.equal(plan.module(*inputs), model(*inputs))  # (the traced step: grad on)
    for a, b in zip(grads(plan.module, inputs), grads(model, inputs)):
        assert torch.equal(a, b)
    assert plan.module.state_dict().keys() == model.state_dict().keys()


def test_solve_plan_estimate_is_simulate_and_fits(plan):
    assert plan.budget_bytes == budget_bytes(plan.graph, 0.7)
    assert plan.estimate == simulate(plan.graph, plan.schedule)
    assert plan.estimate.peak_bytes <= plan.budget_bytes
    assert plan.status == FEASIBLE and plan.result.status == FEASIBLE
    assert plan.schedule.recompute_regions  # 70% needs some recompute
    assert plan.gap is None  # a baseline proves nothing
    text = plan.summary() + repr(plan)
    for fragment in ("greedy", "FEASIBLE", format_bytes(plan.budget_bytes)):
        assert fragment in text



def test_solve_summary_says_over_which_space_it_is_optimal(mlp):
    """dp proves its optimum over chain cuts; the plan is OPTIMAL only when the full-space
    bound reaches it, else FEASIBLE, naming the space it is optimal over and the gap."""
    model, inputs = mlp
    plan = scheduler.solve(model, inputs, budget=0.7, solver="dp")
    assert plan.result.space_optimal and plan.gap is not None
    text = plan.summary()
    if plan.status == OPTIMAL:
        assert plan.gap == 0.0 and "dp: OPTIMAL over the full schedule space" in text
    else:
        assert plan.status == FEASIBLE and plan.gap > 0
        assert f"dp: FEASIBLE (optimal over {plan.schedule.meta['space']}), " \
               f"gap {plan.gap:.1%}" in text


def test_plan_save_and_apply_round_trip(mlp, plan, tmp_path):
    model, inputs = mlp
    path = tmp_path / "schedule.json"
    plan.save(path)
    loaded = Schedule.load(path)
    assert loaded.regions == plan.schedule.regions
    assert loaded.fingerprint == plan.graph.fingerprint
    assert loaded.estimate["peak_bytes"] == plan.estimate.peak_bytes
    module = scheduler.apply(model, path, inputs)
    assert torch.equal(module(*inputs), model(*inputs))  # (the traced step: grad on)
    for a, b in zip(grads(module, inputs), grads(model, inputs)):
        assert torch.equal(a, b)


def test_solve_rejects_a_bad_budget_or_solver_before_profiling(mlp, monkeypatch):
    model, inputs = mlp

    def boom(*args, **kwargs):
        raise AssertionError("traced before the arguments were checked")

    monkeypatch.setattr(scheduler.capture.profile, "trace", boom)
    with pytest.raises(ValueError, match="bad budget '150%'"):
        scheduler.solve(model, inputs, budget="150%", solver="greedy")
    with pytest.raises(UnknownSolverError, match="'magic'"):
        scheduler.solve(model, inputs, budget="50%", solver="magic")


def test_solve_infeasible_raises_with_the_minimum(mlp):
    model, inputs = mlp
    with pytest.raises(InfeasibleBudgetError) as info:
        scheduler.solve(model, inputs, budget="5%", solver="greedy", repeats=1)
    assert info.value.min_feasible_bytes > info.value.budget_bytes


def test_a_saved_plan_for_compile_over_its_budget_eagerly_warns_when_applied_and_run(mlp, plan,
                                                                                     tmp_path):
    """A schedule fitted by its compiled step's measured peak (its saved eager estimate over
    its budget) warns, once, when the module `apply` builds runs eagerly; the same schedule
    for eager execution, or within its budget, does not."""
    model, inputs = mlp
    path = tmp_path / "schedule.json"
    plan.save(path)
    loaded = Schedule.load(path)
    peak = loaded.estimate["peak_bytes"]
    compiled = dataclasses.replace(loaded, budget_bytes=peak - 1024, meta={
        **loaded.meta, "execution": "compiled", COMPILED_PEAK: peak - 4096})
    module = scheduler.apply(model, compiled, inputs)
    with pytest.warns(EagerRunWarning) as caught:
        module(*inputs)
        module(*inputs)
    assert len(caught) == 1 and format_bytes(peak) in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerRunWarning)
        for quiet in (dataclasses.replace(compiled, meta=loaded.meta),
                      dataclasses.replace(compiled, budget_bytes=peak)):
            scheduler.apply(model, quiet, inputs)(*inputs)
    assert not model._forward_pre_hooks  # (the user's model is not touched)


def test_solve_and_apply_of_its_saved_plan_warn_against_the_budget_after_headroom(
        mlp, monkeypatch, tmp_path):
    """A plan fitted for compile with headroom: the eager-run warning of `solve`'s module and
    the one of the module `apply` builds from its saved schedule are the same, naming the
    budget the schedule records (the user's, less the headroom), not the user's own."""
    model, inputs = mlp
    # compiling stood in for: every plan's step "measures" 1 KiB compiled, so the fit keeps
    # the form of the plan replaying no FLOP op
    monkeypatch.setattr(sys.modules["scheduler.plan"], "compile_and_measure",
                        lambda module, inputs, loss_fn=None, dynamic=None: (module, 1024))
    plan = scheduler.solve(model, inputs, budget="80%", solver="greedy", repeats=1,
                           execution="compiled", headroom=0.1)
    target = int(plan.budget_bytes * 0.9)
    assert plan.schedule.budget_bytes == target
    # (its eager prediction lies between the two budgets: only the one after headroom warns)
    assert target < plan.estimate.peak_bytes <= plan.budget_bytes, plan.estimate
    messages = []
    plan.save(tmp_path / "plan.json")
    for module in (plan.module, scheduler.apply(model, tmp_path / "plan.json", inputs)):
        with pytest.warns(EagerRunWarning) as caught:
            module(*inputs)
        messages.append(str(caught[0].message))
    assert messages[0] == messages[1]
    assert f"over the budget {format_bytes(target)}" in messages[0]
    assert format_bytes(plan.budget_bytes) not in messages[0]
