"""Certifying is a step of its own, and it remembers nothing.

`certify.certify` judges a result against the full-space bound it solves then (or is given);
no solver leaves anything on the graph for a later one to read. So solving the same graph and
budget twice, in another order and with other solvers in between (``relax``, whose better
bound used to be remembered for the others, among them), gives the same status, gap and lower
bound. Every OPTIMAL claim on the small graphs is checked against brute force over the full
space.

The bound's solve is given time enough to prove the relaxation's optimum (the same value
however often it is solved): a bound stopped by a short time limit may stop anywhere.
"""

from __future__ import annotations

import pytest
from _full_space import full_space, small_graph, space_budgets, space_optimum
from conftest import budget_bytes

from scheduler.ir.graph import CostGraph
from scheduler.solvers import FEASIBLE, INFEASIBLE, OPTIMAL, SolverConfig, get_solver
from scheduler.solvers.base import SolveResult
from scheduler.solvers.certify import certify

#: time enough for the bound's solve to prove the relaxation's optimum on these graphs
PROVEN = SolverConfig(bound_s=120.0)


def _judged(g: CostGraph, solver: str, budget: int) -> SolveResult:
    return certify(g, get_solver(solver)(g, budget), config=PROVEN)


def _verdict(r: SolveResult) -> tuple:
    return (r.status, r.gap, r.lower_bound_s,
            None if r.estimate is None else r.estimate.recompute_s)


@pytest.mark.parametrize("name,share", [pytest.param("mlp", 0.9, marks=pytest.mark.slow),
                                        ("hf_gpt2", 0.9)])
def test_same_verdict_in_any_order_on_recorded_graphs(recorded_graph, name: str,
                                                      share: float) -> None:
    """cpsat then dp, relax (which proves its optimum, the best bound there is), then dp and
    cpsat again: the same verdicts, on graphs whose bound CP-SAT proves in seconds. On the
    MLP the relaxation's optimum is relax's schedule, so cpsat and dp there are FEASIBLE
    with its gap."""
    g = recorded_graph(name)
    budget = budget_bytes(g, share)
    before = dict(vars(g))
    first = {s: _judged(g, s, budget) for s in ("cpsat", "dp")}
    relaxed = get_solver("relax")(g, budget)
    assert relaxed.status == OPTIMAL
    second = {s: _judged(g, s, budget) for s in ("dp", "cpsat")}
    for s in first:
        assert _verdict(first[s]) == _verdict(second[s]), s
    assert first["cpsat"].status != INFEASIBLE and first["cpsat"].certified
    assert first["cpsat"].lower_bound_s <= relaxed.estimate.recompute_s * (1 + 1e-9)
    if name == "mlp":
        for r in first.values():
            assert r.status == FEASIBLE and r.space_optimal and r.gap > 0.1
    assert vars(g).keys() == before.keys()  # (no solver state on the graph)
    assert all(vars(g)[k] is v for k, v in before.items())


@pytest.mark.parametrize("seeds", [range(0, 6), pytest.param(range(6, 12),
                                                              marks=pytest.mark.slow)],
                         ids=lambda r: f"{r.start}-{r.stop - 1}")
def test_same_verdict_in_any_order_on_small_graphs(seeds: range) -> None:
    """On small synthetic graphs, at budgets brute force tells apart: dp, cpsat and brute,
    then relax and auto, then the three again in the other order, give the same verdicts;
    whatever is OPTIMAL has the full space's brute-force optimum, and every bound lies at or
    below it."""
    solvers = ("dp", "cpsat", "brute")
    claims = checked = 0
    for seed in seeds:
        g = small_graph(seed)
        space = full_space(g)
        for budget in space_budgets(space):
            opt = space_optimum(space, budget)
            first = {s: _judged(g, s, budget) for s in solvers}
            between = [get_solver("relax")(g, budget), get_solver("auto")(g, budget)]
            second = {s: _judged(g, s, budget) for s in reversed(solvers)}
            for s in solvers:
                assert _verdict(first[s]) == _verdict(second[s]), (seed, budget, s)
            for r in [*first.values(), *between]:
                if r.status == INFEASIBLE:
                    continue
                assert opt is not None
                checked += 1
                t = r.estimate.recompute_s
                if r.lower_bound_s is not None:
                    assert r.lower_bound_s <= opt * (1 + 1e-9) + 1e-15, (seed, budget, r.solver)
                if r.status == OPTIMAL:
                    claims += 1
                    assert t == pytest.approx(opt, rel=1e-6, abs=1e-15), (seed, budget, r.solver)
    assert checked >= 60 and claims >= checked // 2, (checked, claims)


def test_an_uncertified_result_claims_only_its_own_space() -> None:
    """Straight from a solver whose space is not the full one, a result is FEASIBLE with no
    full-space bound, however optimal over its space; certified, it is judged; a baseline's
    result, which claims nothing, is left as it is."""
    g = small_graph(4)
    budget = g.measured_peak_bytes
    raw = get_solver("dp")(g, budget)
    assert raw.status == FEASIBLE and raw.space_optimal and raw.certifiable
    assert raw.lower_bound_s is None and raw.gap is None and not raw.certified
    judged = certify(g, raw, config=PROVEN)
    assert judged.certified and judged.lower_bound_s is not None
    assert judged.gap == judged.schedule.gap and judged.status == judged.schedule.status
    baseline = get_solver("every_block")(g, budget)
    assert not baseline.certifiable
    kept = certify(g, baseline, config=PROVEN)
    assert (kept.status, kept.gap, kept.lower_bound_s) == (baseline.status, None, None)
