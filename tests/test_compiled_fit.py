"""`compiled_fit.fit_compiled`: the search for the fastest plan whose compiled step measures
within the budget, with the compile-and-measure step stood in for by a known function of the
plan (the eager cost model's peak times a factor: what inductor's buffers do, in the worst
and best cases measured), so that every answer is checked against that function itself and
against the plans the solver gives at every target (a brute-force sweep). The real
measurement is tested in tests/test_compile.py (slow: it compiles)."""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from typing import Any

import pytest
import torch

import scheduler
from scheduler.budget import InfeasibleBudgetError
from scheduler.compiled_fit import (
    COMPILED_PEAK,
    CompiledPeakWarning,
    fit_compiled,
    fit_compiled_form,
)
from scheduler.cost.compiled_form import flop_saves_meta
from scheduler.cost.simulate import simulate
from scheduler.ir.schedule import Schedule
from scheduler.plan import solve_graph
from scheduler.quantities import format_bytes
from scheduler.run_watch import CompiledRunWarning, EagerRunWarning, WarnCompiledRun, WarnEagerRun
from scheduler.testing.synthetic import random_graph

GRAPH = random_graph(16, kind="chain", seed=1)
UNSCHEDULED = simulate(GRAPH, Schedule.none(GRAPH)).peak_bytes


class Measured:
    """``result -> (its schedule, factor x its predicted peak)``, counting the calls."""

    def __init__(self, factor: float) -> None:
        self.factor, self.calls = factor, 0

    def __call__(self, result: Any) -> tuple[Any, int]:
        self.calls += 1
        return result.schedule, self.peak(result.schedule)

    def peak(self, schedule: Schedule) -> int:
        return int(self.factor * simulate(GRAPH, schedule).peak_bytes)


def solve_at(target: int) -> Any:
    return solve_graph(GRAPH, target, solver="dp", time_limit_s=10)


def fit(budget: int, measured: Measured, **kw: Any) -> Any:
    return fit_compiled(budget, budget, UNSCHEDULED, solve_at, measured, **kw)


def sweep(budget: int, measured: Measured, n: int = 30) -> list[tuple[float, int]]:
    """``(recompute, measured peak)`` of the solver's plan at ``n`` targets up to the
    unscheduled peak (brute force over targets, not over schedules)."""
    out = []
    for i in range(1, n + 1):
        try:
            r = solve_at(int(UNSCHEDULED * i / n))
        except InfeasibleBudgetError:
            continue
        out.append((r.estimate.recompute_s, measured.peak(r.schedule)))
    return out


def test_a_plan_measured_as_predicted_is_the_solvers_plan_after_one_compile() -> None:
    budget = int(0.7 * UNSCHEDULED)
    measured = Measured(1.0)
    got = fit(budget, measured)
    ref = solve_at(budget)
    assert measured.calls == 1
    assert got.result.schedule.regions == ref.schedule.regions
    assert got.peak_bytes == measured.peak(ref.schedule) <= budget
    assert got.result.schedule.meta[COMPILED_PEAK] == got.peak_bytes


@pytest.mark.parametrize("fraction", [0.65, 0.75, 0.85])
def test_a_compiled_step_above_the_prediction_is_solved_again_below_the_budget(
        fraction: float) -> None:
    budget = int(fraction * UNSCHEDULED)
    measured = Measured(1.12)
    assert measured.peak(solve_at(budget).schedule) > budget  # (the eager plan would not fit)
    got = fit(budget, measured)
    assert measured.peak(got.result.schedule) == got.peak_bytes <= budget
    assert 2 <= measured.calls <= 4
    assert got.tries[0].target_bytes == budget and got.tries[0].peak_bytes > budget
    # no plan the solver gives at any target is faster and measures within the budget by
    # more than the search's stopping margin (2%)
    better = [rc for rc, peak in sweep(budget, measured)
              if peak <= 0.98 * budget and rc < got.result.estimate.recompute_s - 1e-12]
    assert not better, (better, got.tries)


class Inverted(Measured):
    """A compiled peak that falls as the predicted one rises: twice ``around`` less the
    prediction (recomputing more raises it, as plans did compiled on the GPT example)."""

    def __init__(self, around: int) -> None:
        super().__init__(1.0)
        self.around = around

    def peak(self, schedule: Schedule) -> int:
        return 2 * self.around - simulate(GRAPH, schedule).peak_bytes


def test_where_recomputing_more_raises_the_compiled_peak_the_search_turns_up() -> None:
    budget = int(0.7 * UNSCHEDULED)
    measured = Inverted(int(1.03 * budget))
    assert measured.peak(solve_at(budget).schedule) > budget  # (the plan at the budget)
    assert any(peak <= budget for _, peak in sweep(budget, measured))  # (one above it fits)
    got = fit(budget, measured)
    assert got.peak_bytes == measured.peak(got.result.schedule) <= budget
    targets = [t.target_bytes for t in got.tries]
    assert targets[0] == budget and targets[1] < budget < targets[-1], targets
    assert measured.calls <= 4


def test_memory_the_compiled_step_leaves_unused_buys_a_faster_plan() -> None:
    budget = int(0.7 * UNSCHEDULED)
    measured = Measured(0.8)
    at_budget = solve_at(budget)
    got = fit(budget, measured)
    assert measured.peak(got.result.schedule) == got.peak_bytes <= budget
    assert got.result.estimate.recompute_s < at_budget.estimate.recompute_s
    # (solved at a higher target, it records the budget it was measured against)
    assert got.result.schedule.budget_bytes == budget < got.result.budget_bytes
    assert got.result.estimate.peak_bytes > budget  # (eagerly it would not fit: run compiled)


def test_no_plan_within_the_budget_raises_naming_the_least_measured_peak() -> None:
    budget = int(0.7 * UNSCHEDULED)
    measured = Measured(3.0)
    with pytest.raises(InfeasibleBudgetError, match="measure_compiled=False") as info:
        fit(budget, measured, compiles=3)
    assert measured.calls <= 3
    assert info.value.budget_bytes == budget
    assert info.value.min_feasible_bytes > budget
    # a measured peak: 3x a predicted one, so at least 3x the least peak of any schedule
    with pytest.raises(InfeasibleBudgetError) as floor:
        solve_at(1)
    assert info.value.min_feasible_bytes >= 3 * floor.value.min_feasible_bytes


def least_predicted_peak() -> int:
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_at(1)
    return info.value.min_feasible_bytes


def test_below_every_predicted_peak_the_least_plan_is_compiled_and_kept_where_it_fits() -> None:
    floor = least_predicted_peak()
    budget = int(0.9 * floor)  # (no plan's eager prediction fits)
    measured = Measured(0.8)
    got = fit(budget, measured)
    assert got.peak_bytes == measured.peak(got.result.schedule) <= budget
    assert got.result.estimate.peak_bytes > budget
    assert got.tries[0].target_bytes == floor


def test_below_every_predicted_peak_a_least_plan_measured_over_raises_naming_it() -> None:
    floor = least_predicted_peak()
    measured = Measured(1.0)
    with pytest.raises(InfeasibleBudgetError, match="measure_compiled=False") as info:
        fit(int(0.5 * floor), measured)
    assert measured.calls == 1  # (the least plan, once: nothing lower to solve at)
    assert info.value.min_feasible_bytes == measured.peak(solve_at(floor).schedule)


def test_a_budget_with_no_least_plan_named_is_the_solvers_own_error() -> None:
    def no_floor(target: int) -> Any:
        raise InfeasibleBudgetError("nothing at all", budget_bytes=target, min_feasible_bytes=None)

    with pytest.raises(InfeasibleBudgetError, match="nothing at all"):
        fit_compiled(100, 100, UNSCHEDULED, no_floor, Measured(1.0))


def test_a_plan_met_again_is_not_measured_again() -> None:
    budget = int(0.75 * UNSCHEDULED)
    measured = Measured(1.12)
    got = fit(budget, measured, compiles=4)
    assert measured.calls == len({(t.predicted_peak_bytes, t.recompute_s) for t in got.tries})


def test_compiles_must_be_positive() -> None:
    with pytest.raises(ValueError, match="compiles must be >= 1, got 0"):
        fit(UNSCHEDULED, Measured(1.0), compiles=0)


def mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (torch.nn.Linear(32, 32), torch.nn.GELU())]
    return torch.nn.Sequential(*layers), (torch.randn(256, 32),)


def test_solve_refuses_a_measure_compiled_that_is_no_bool() -> None:
    model, inputs = mlp()
    with pytest.raises(ValueError, match="measure_compiled must be True or False, got 'yes'"):
        scheduler.solve(model, inputs, budget="80%", execution="compiled",
                        measure_compiled="yes")  # type: ignore[arg-type]


def test_a_fake_profiled_plan_for_compile_warns_that_its_peak_is_not_measured() -> None:
    model, inputs = mlp()
    with pytest.warns(CompiledPeakWarning, match="profiled on fake tensors"):
        plan = scheduler.solve(model, inputs, budget="80%", execution="compiled", mode="fake",
                               time_limit_s=5)
    assert plan.compiled_peak_bytes is None
    assert "the peak is the eager step's" in plan.summary()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompiledPeakWarning)
        scheduler.solve(model, inputs, budget="80%", execution="compiled", mode="fake",
                        time_limit_s=5, measure_compiled=False)


class Forms:
    """``solve_at(target, whole)`` for `fit_compiled_form`: the solver's plan, marked when in
    its whole form (with a node saving only its FLOP ops, as a form has: another step than the
    plan as solved), with the forms measured at ``form_factor`` x their predicted peak and the
    plans as solved at 1.0; counts the solves of each."""

    def __init__(self, form_factor: float) -> None:
        self.form_factor = form_factor
        self.solves = {True: 0, False: 0}

    def solve_at(self, target: int, whole: bool) -> Any:
        self.solves[whole] += 1
        res = solve_at(target)
        form = flop_saves_meta([GRAPH.compute_nodes[0]]) if whole else {}
        return dataclasses.replace(res, schedule=dataclasses.replace(
            res.schedule, meta={**res.schedule.meta, "whole": whole, **form}))

    def measure(self, result: Any) -> tuple[Any, int]:
        factor = self.form_factor if result.schedule.meta["whole"] else 1.0
        return result.schedule, int(factor * simulate(GRAPH, result.schedule).peak_bytes)


def test_a_form_measured_within_the_budget_is_kept_without_trying_the_plans_as_solved() -> None:
    budget = int(0.7 * UNSCHEDULED)
    forms = Forms(0.9)
    got = fit_compiled_form(budget, forms.solve_at(budget, True), UNSCHEDULED, forms.solve_at,
                            forms.measure)
    assert got.result.schedule.meta["whole"] and got.peak_bytes <= budget
    assert forms.solves[False] == 0


def test_where_no_form_measures_within_the_budget_the_plans_as_solved_are_fitted() -> None:
    budget = int(0.7 * UNSCHEDULED)
    forms = Forms(10.0)  # (no form measures within)
    said: list[str] = []
    got = fit_compiled_form(budget, forms.solve_at(budget, True), UNSCHEDULED, forms.solve_at,
                            forms.measure, progress=said.append)
    assert not got.result.schedule.meta["whole"]
    ref = fit(budget, Measured(1.0))  # (the search over the plans as solved alone)
    assert got.result.schedule.regions == ref.result.schedule.regions
    assert got.peak_bytes == ref.peak_bytes <= budget
    assert any("as solved" in line for line in said)


def test_where_neither_measures_within_the_error_names_the_lower_least_peak() -> None:
    floor = least_predicted_peak()
    budget = int(0.5 * floor)
    forms = Forms(1.5)
    with pytest.raises(InfeasibleBudgetError) as info:
        fit_compiled_form(budget, forms.solve_at(floor, True), UNSCHEDULED, forms.solve_at,
                          forms.measure)
    # (the plans as solved measured at their prediction: the least is the floor's plan)
    assert info.value.min_feasible_bytes == simulate(GRAPH, solve_at(floor).schedule).peak_bytes


def test_where_the_plan_replaying_no_flop_op_measures_within_it_is_kept_after_one_compile(
) -> None:
    budget = int(0.95 * UNSCHEDULED)
    forms = Forms(0.9)
    calls: list[Any] = []

    def measure(result: Any) -> tuple[Any, int]:
        calls.append(result)
        return forms.measure(result)

    got = fit_compiled_form(budget, forms.solve_at(int(0.7 * UNSCHEDULED), True), UNSCHEDULED,
                            forms.solve_at, measure)
    assert len(calls) == 1 and got.peak_bytes <= budget
    assert got.result.schedule.regions == solve_at(UNSCHEDULED).schedule.regions
    assert got.result.schedule.meta[COMPILED_PEAK] == got.peak_bytes
    # (where it measures over the budget, the search goes on from the first target)
    forms = Forms(0.9)
    calls.clear()
    low = int(0.7 * UNSCHEDULED)
    got = fit_compiled_form(low, forms.solve_at(low, True), UNSCHEDULED, forms.solve_at, measure)
    assert got.peak_bytes <= low and len(calls) > 1


def test_a_plan_fitted_for_compile_warns_once_when_it_runs_eagerly_and_never_compiled() -> None:
    hook = WarnEagerRun(3 << 20, 2 << 20, 1 << 20)
    net = torch.nn.Linear(4, 4)
    net.register_forward_pre_hook(hook)
    x = torch.randn(2, 4)
    compiled = torch.compile(net, backend="eager", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # (torch's own, said once a process where an earlier test left inductor's caches off)
        warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
        compiled(x)  # (traced: the hook finds itself compiling)
    assert not hook.warned
    with pytest.warns(EagerRunWarning) as caught:
        net(x)
        net(x)
    assert len(caught) == 1
    text = str(caught[0].message)
    assert all(s in text for s in ("3.00 MiB", "2.00 MiB", "1.00 MiB", "torch.compile(plan.module)",
                                   'execution="eager"')), text
    assert pickle.loads(pickle.dumps(net))(x).shape == (2, 4)  # (the hook pickles)


def test_an_eager_plan_compiled_whole_warns_once_with_no_graph_break(monkeypatch) -> None:
    """A plan solved eagerly, its module compiled whole: said once (after the graph, at its
    first run; dynamo reorders the call, so no graph break), never eagerly; a plan solved for
    compiled execution carries no such hook."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    from examples.mlp import build

    monkeypatch.setattr("scheduler.run_watch._SAID", set())
    model, inputs = build(batch=128, dim=16, depth=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = scheduler.solve(model, inputs, budget="80%", time_limit_s=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan.module(*inputs).sum().backward()  # (eager: nothing said)
    dynamo.reset()
    counters.clear()
    compiled = torch.compile(plan.module, backend="eager")
    with pytest.warns(CompiledRunWarning) as caught:
        for _ in range(3):
            loss = compiled(*inputs)
            assert torch.equal(loss, plan.module(*inputs))
    said = [w for w in caught if issubclass(w.category, CompiledRunWarning)]
    assert len(said) == 1 and not counters["graph_break"]  # (others: torch's own, say)
    assert counters["stats"]["unique_graphs"] == 1  # (nor a recompile when it was said)
    text = str(said[0].message)
    assert 'execution="compiled"' in text and format_bytes(plan.schedule.budget_bytes) in text
    assert pickle.loads(pickle.dumps(plan.module)) is not None  # (the hook pickles)
    dynamo.reset()
    hooks = plan.module._forward_pre_hooks.values()
    assert sum(isinstance(h, WarnCompiledRun) for h in hooks) == 1
    module = scheduler.apply(model, plan.schedule, inputs)  # (applied from the schedule too)
    assert sum(isinstance(h, WarnCompiledRun) for h in module._forward_pre_hooks.values()) == 1
    compiled_schedule = Schedule(plan.schedule.regions, budget_bytes=plan.budget_bytes,
                                 meta={"execution": "compiled"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = scheduler.apply(model, compiled_schedule, inputs)
    assert not any(isinstance(h, WarnCompiledRun) for h in module._forward_pre_hooks.values())
