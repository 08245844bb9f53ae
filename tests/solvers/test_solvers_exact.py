"""Exact solvers against brute force: on random small graphs (chains and DAGs, small enough to
enumerate every schedule of the solver's space) and several budgets each, ``dp`` and ``cpsat``
return exactly the brute-force optimum of the simulator over the same space, and report
INFEASIBLE exactly when nothing in it fits.

Graphs come from `scheduler.testing.synthetic.random_graph` over fixed seeds (plain loops, not
hypothesis, so every run checks the same graphs). The not-slow part checks 35 graphs (20 for
dp, 15 for cpsat); the slow part 215 more (130 chains and 30 DAGs for dp, 55 for cpsat).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from conftest import budget_bytes, unscheduled_peak
from ortools.sat.python import cp_model

from scheduler.cost.simulate import simulate
from scheduler.ir.graph import CostGraph
from scheduler.ir.schedule import Schedule
from scheduler.solvers import FEASIBLE, INFEASIBLE, OPTIMAL, SolveResult, get_solver
from scheduler.solvers import cpsat as cpsat_module
from scheduler.solvers.bound import full_space_bound
from scheduler.solvers.brute import brute_force, count_schedules, schedules
from scheduler.solvers.certify import certify
from scheduler.solvers.config import SolverConfig
from scheduler.solvers.cpsat import (
    Incumbents,
    cpsat,
    cpsat_fine,
    fine_points,
    unit_points,
)
from scheduler.solvers.cpsat_model import CpsatModel
from scheduler.solvers.dp import (
    RegionTable,
    _search,  # (no public search over a given table: the check compares two tables)
    chain_cuts,
    crossing_counts,
    dp,
    min_feasible_bytes,
    save_candidates,
    table_for,
)
from scheduler.testing.synthetic import random_graph

FRACTIONS = (1.0, 0.85, 0.7, 0.55, 0.4)
#: generous: these graphs solve in milliseconds, so FEASIBLE means the solver gave up early
CPSAT_LIMIT_S = 30.0
REL = 1e-12


def _graph(kind: str, seed: int, *, max_nodes: int) -> CostGraph:
    """The graph of a seed: 4 .. max_nodes compute nodes, half the DAGs with denser skips."""
    n = 4 + seed % (max_nodes - 3)
    skip = 0.5 if kind == "dag" and seed % 2 else 0.3
    return random_graph(n, kind=kind, seed=seed, skip_prob=skip)


def _budgets(g: CostGraph, min_feasible: int) -> list[int]:
    """Fractions of the unscheduled peak, two budgets between the least feasible one and that
    peak, the least feasible budget exactly and one byte below it."""
    peak = g.measured_peak_bytes
    spread = max(0, peak - min_feasible)
    return sorted({int(f * peak) for f in FRACTIONS}
                  | {min_feasible + spread // 3, min_feasible + 2 * spread // 3,
                     min_feasible, min_feasible - 1}, reverse=True)


def _boundaries(result: SolveResult) -> set[int]:
    out, pos = set(), 0
    for r in result.schedule.regions:
        out.add(pos)
        pos += len(r.nodes)
    return out | {pos}


def _check_result(g: CostGraph, r: SolveResult, budget: int, points: list[int],
                  save_options: Any = None) -> None:
    """A result with a schedule: its estimate is the simulator's, it fits, and it lies in the
    space (boundaries at the points; save sets only those ``save_options`` offers)."""
    assert r.schedule is not None and r.estimate is not None, r
    assert r.estimate == simulate(g, r.schedule)
    assert r.estimate.peak_bytes <= budget, (r.estimate.peak_bytes, budget)
    assert _boundaries(r) <= set(points), (sorted(_boundaries(r)), points)
    pos = 0
    for reg in r.schedule.regions:
        start, pos = pos, pos + len(reg.nodes)
        if reg.save:
            assert save_options is not None, "a save set outside the space"
            assert reg.save in save_options(g, start, pos), (reg.save, start, pos)


def _explain(g: CostGraph, seed: int, budget: int, mine: SolveResult, ref: SolveResult) -> str:
    def show(r: SolveResult) -> str:
        est = r.estimate
        return (f"{r.status} recompute_s={est.recompute_s if est else None!r} "
                f"peak={est.peak_bytes if est else None} min_feasible={r.min_feasible_bytes}"
                + (f"\n{r.schedule.describe()}" if r.schedule else ""))
    return (f"{g.name} (seed {seed}), budget {budget}:\n{mine.solver}: {show(mine)}\n"
            f"brute: {show(ref)}")


def _save_failure(g: CostGraph, seed: int) -> Path:
    path = Path(f"/tmp/dp_fail_{seed}.json")
    path.write_text(json.dumps(g.to_dict()))
    return path


def _compare_dp(seed: int, g: CostGraph) -> int:
    """dp against brute force over dp's points, at every budget; returns budgets checked."""
    points = table_for(g)[0].points
    min_feasible = brute_force(g, 0, points=points,
                               save_options=save_candidates).min_feasible_bytes
    budgets = _budgets(g, min_feasible)
    for budget in budgets:
        ref = brute_force(g, budget, points=points, save_options=save_candidates)
        got = dp(g, budget)
        same = got.status == ref.status and (
            got.min_feasible_bytes == ref.min_feasible_bytes if ref.status == INFEASIBLE
            else got.estimate.recompute_s == pytest.approx(ref.estimate.recompute_s, rel=REL,
                                                           abs=0.0))
        if not same:
            path = _save_failure(g, seed)
            pytest.fail(f"dp disagrees with brute force (graph saved to {path}):\n"
                        + _explain(g, seed, budget, got, ref))
        if ref.status != INFEASIBLE:  # both proven over the space; status over the full one
            assert ref.space_optimal and got.space_optimal
            _check_result(g, ref, budget, points, save_candidates)
            _check_result(g, got, budget, points, save_candidates)
        else:
            assert got.schedule is None and got.estimate is None
    return len(budgets)


DP_FAST = [range(s, s + 10) for s in range(0, 20, 10)]  # 20 chains of 4..7 nodes
DP_SLOW = [range(s, s + 10) for s in range(20, 150, 10)]  # 130 chains of 4..7 nodes


@pytest.mark.parametrize("seeds", [*DP_FAST, *(pytest.param(r, marks=pytest.mark.slow)
                                                for r in DP_SLOW)],
                         ids=lambda r: f"chains{r.start}-{r.stop - 1}")
def test_dp_equals_brute_force_on_chains(seeds: range) -> None:
    for seed in seeds:
        g = _graph("chain", seed, max_nodes=7)
        assert table_for(g)[0].points == list(range(len(g.compute_nodes) + 1))
        _compare_dp(seed, g)


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_dp_table_without_long_keeps_loses_nothing(recorded_graph, name: str) -> None:
    """dp offers keep regions longer than one gap only where a one-gap keep piece is not
    separable; on the recorded graphs (GPT has such pieces at its end) the search over that
    table finds the same least recompute, with the same status, as over the table with every
    keep span, at budgets from 95% down to below the least feasible one."""
    g = recorded_graph(name)
    cuts = chain_cuts(g)
    small, full = RegionTable(g, cuts), RegionTable(g, cuts, long_keeps=True)
    assert len(small.entries) < len(full.entries)
    assert min_feasible_bytes(small) == min_feasible_bytes(full)
    peak = unscheduled_peak(g)
    for f in range(95, 15, -5):
        a, b = _search(small, peak * f // 100), _search(full, peak * f // 100)
        assert (a is None) == (b is None), f
        if a is not None:
            assert a[0] == pytest.approx(b[0], rel=REL, abs=0.0), f
            assert a[3] == b[3], f  # exact: an OPTIMAL claim either way


# -- cpsat ------------------------------------------------------------------------------------

def test_cpsat_out_of_time_returns_the_best_cheap_baseline() -> None:
    """When time runs out before CP-SAT finds a schedule that fits, cpsat answers with the
    best fitting warm start (FEASIBLE, never a false INFEASIBLE), simulated like any result."""
    g = random_graph(300, kind="dag", seed=3)
    sqrt = get_solver("sqrt")(g, 1 << 62)
    budget = sqrt.estimate.peak_bytes  # sqrt fits exactly
    fitting = [get_solver(n)(g, budget) for n in SolverConfig().cpsat_warm_starts]
    best = min((r for r in fitting if r.status != INFEASIBLE),
               key=lambda r: r.estimate.recompute_s)
    got = get_solver("cpsat")(g, budget, time_limit_s=1e-6)
    assert got.status == FEASIBLE
    assert got.estimate == simulate(g, got.schedule)
    assert got.estimate.recompute_s == best.estimate.recompute_s
    assert got.estimate.peak_bytes <= budget


def test_cpsat_answers_with_a_fitting_baseline_its_units_miss() -> None:
    """Where nothing on cpsat's unit points fits but a cheap baseline (cut elsewhere) does,
    cpsat returns the best fitting one as FEASIBLE, not INFEASIBLE (one unit:
    ``cpsat_max_units=1``)."""
    g = random_graph(24, kind="chain", seed=5)
    n = len(g.compute_nodes)
    every = get_solver("every_block")(g, 1 << 62)
    budget = every.estimate.peak_bytes
    whole = [simulate(g, Schedule.from_regions(g, [(0, n, p)])).peak_bytes
             for p in ("keep", "recompute")]
    assert min(whole) > budget  # one unit: neither of its two schedules fits
    one = SolverConfig(cpsat_max_units=1)
    assert unit_points(g, config=one) == [0, n]
    fitting = [r for r in (get_solver(b)(g, budget) for b in one.cpsat_warm_starts)
               if r.status != INFEASIBLE]
    got = cpsat(g, budget, time_limit_s=CPSAT_LIMIT_S, config=one)
    assert got.status == FEASIBLE
    assert got.estimate == simulate(g, got.schedule)
    assert got.estimate.peak_bytes <= budget
    assert got.estimate.recompute_s == min(r.estimate.recompute_s for r in fitting)


def _compare_cpsat(seed: int, g: CostGraph, *, fine: bool = False,
                   config: SolverConfig | None = None) -> None:
    """cpsat against brute force over `unit_points` (``fine``: cpsat_fine over `fine_points`),
    at every budget, with ``config``."""
    solve, space = (cpsat_fine, fine_points) if fine else (cpsat, unit_points)
    points = space(g)
    min_feasible = brute_force(g, 0, points=points).min_feasible_bytes
    for budget in _budgets(g, min_feasible):
        ref = brute_force(g, budget, points=points)
        got = solve(g, budget, time_limit_s=CPSAT_LIMIT_S, config=config)
        why = _explain(g, seed, budget, got, ref)
        assert (got.status == INFEASIBLE) == (ref.status == INFEASIBLE), why
        if ref.status == INFEASIBLE:
            assert got.schedule is None, why
            # where cpsat names the least feasible budget, it is the space's
            assert got.min_feasible_bytes in (None, ref.min_feasible_bytes), why
            continue
        _check_result(g, got, budget, points)
        if got.space_bound_s is not None:  # a proven bound: no schedule in the space beats it
            assert got.space_bound_s <= ref.estimate.recompute_s * (1 + REL), why
        if got.space_optimal:
            assert got.estimate.recompute_s == pytest.approx(
                ref.estimate.recompute_s, rel=REL, abs=0.0), why
        else:
            assert got.status == FEASIBLE, why
            assert got.solve_s >= 0.9 * CPSAT_LIMIT_S, "FEASIBLE before the time limit\n" + why
            assert got.estimate.recompute_s >= ref.estimate.recompute_s * (1 - REL), why


CPSAT_FAST = [("dag", range(1000, 1010)), ("chain", range(2000, 2005))]
CPSAT_SLOW = [("dag", range(s, s + 10)) for s in range(1010, 1050, 10)] + [
    ("chain", range(2005, 2020))]


@pytest.mark.parametrize("kind,seeds", CPSAT_FAST,
                         ids=lambda x: x if isinstance(x, str) else f"{x.start}-{x.stop - 1}")
def test_cpsat_equals_brute_force(kind: str, seeds: range) -> None:
    for seed in seeds:
        _compare_cpsat(seed, _graph(kind, seed, max_nodes=7))


@pytest.mark.slow
@pytest.mark.parametrize("kind,seeds", CPSAT_SLOW,
                         ids=lambda x: x if isinstance(x, str) else f"{x.start}-{x.stop - 1}")
def test_cpsat_equals_brute_force_on_more_graphs(kind: str, seeds: range) -> None:
    for seed in seeds:
        _compare_cpsat(seed, _graph(kind, seed, max_nodes=9))


# -- dp on DAGs, over its chain cuts ------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("seeds", [range(3000, 3030)], ids=lambda r: f"dags{r.start}-{r.stop - 1}")
def test_dp_equals_brute_force_on_dags(seeds: range) -> None:
    for seed in seeds:
        _compare_dp(seed, _graph("dag", seed, max_nodes=7))


# -- brute force itself -------------------------------------------------------------------------

def test_brute_force_enumerates_the_space() -> None:
    g = random_graph(6, seed=1)
    pts = list(range(7))
    all_spans = list(schedules(g, pts))
    assert len(all_spans) == count_schedules(g, pts) == 233  # F(2 * 5 + 3)
    assert len({tuple(s) for s in all_spans}) == len(all_spans)
    for spans in all_spans:
        assert not any(a[2] == b[2] == "keep" for a, b in zip(spans, spans[1:]))
    assert all_spans[0] == [(0, 6, "keep")]
    assert count_schedules(g, [0, 3, 6], ("recompute",)) == 2
    with pytest.raises(ValueError, match="233 schedules"):
        brute_force(g, 10**9, points=pts, max_schedules=100)
    with pytest.raises(ValueError, match="include 0 and n"):
        brute_force(g, 10**9, points=[0, 3])


def test_brute_solver_is_registered() -> None:
    g = random_graph(5, seed=3)
    r = get_solver("brute")(g, g.measured_peak_bytes)
    assert r.space_optimal and r.estimate.recompute_s == 0.0
    assert certify(g, r).status == OPTIMAL
    r = get_solver("brute")(g, 0)
    assert r.status == INFEASIBLE and r.schedule is None
    assert r.min_feasible_bytes == brute_force(g, 0, points=list(range(6))).min_feasible_bytes
    at = get_solver("brute")(g, r.min_feasible_bytes)
    assert at.space_optimal and at.estimate.peak_bytes == r.min_feasible_bytes
    with pytest.raises(ValueError, match="at most 12 compute nodes"):
        get_solver("brute")(random_graph(13, seed=0), 10**9)


def test_cpsat_units_cut_inside_blocks_where_as_cheap_as_between_them(recorded_graph) -> None:
    """On the recorded HF GPT-2 graph (ATen level: masks and position ids cross every block
    boundary) cpsat's units also end inside each transformer block, where no more storages
    cross than at a block boundary; that space reaches 80% of the unscheduled peak, which
    block-boundary units alone do not, and cpsat proves brute force's optimum over it."""
    g = recorded_graph("hf_gpt2")
    names = g.compute_nodes
    blocks = [g.node(x).block for x in names]
    points = unit_points(g)
    counts = crossing_counts(g)
    bounds = [c for c in range(1, len(names)) if blocks[c] != blocks[c - 1]]
    for b in ("transformer.h.0", "transformer.h.1"):
        inside = [p for p in points[1:-1] if blocks[p] == b and blocks[p - 1] == b]
        assert inside, (b, points)
        assert all(counts[p] <= max(counts[c] for c in bounds) for p in inside)
    budget = budget_bytes(g, 0.8)
    got = cpsat(g, budget, time_limit_s=CPSAT_LIMIT_S)
    assert got.space_optimal and got.estimate.peak_bytes <= budget
    assert got.estimate == simulate(g, got.schedule)
    _check_result(g, got, budget, points)
    assert len(points) <= 12  # (brute force over them: F(2 * 9 + 3) = 10946 schedules)
    ref = brute_force(g, budget, points=points)
    assert got.estimate.recompute_s == pytest.approx(ref.estimate.recompute_s, rel=REL, abs=0.0)
    coarse = [0, *[c for c in points[1:-1] if c in bounds or c < bounds[0]], len(names)]
    assert brute_force(g, budget, points=coarse).status == INFEASIBLE


def test_cpsat_out_of_time_answers_the_better_of_its_find_and_the_warm_start(
        monkeypatch: Any) -> None:
    """When CP-SAT runs out of time with a fitting schedule worse than the warm start, cpsat
    answers with the warm start (FEASIBLE), its bound lowered to the warm start's time;
    certified, its gap is to the full-space bound."""
    g = random_graph(40, kind="dag", seed=7)
    worse = Schedule.from_regions(g, [(0, len(g.compute_nodes), "recompute")])
    every = get_solver("every_block")(g, 1 << 62)
    budget = max(every.estimate.peak_bytes, simulate(g, worse).peak_bytes)
    warm = cpsat_module.warm_start(g, budget).schedule
    warm_s = simulate(g, warm).recompute_s
    assert simulate(g, worse).recompute_s > warm_s
    monkeypatch.setattr(cpsat_module, "solve_lazy", lambda *a, **k: (FEASIBLE, worse, warm_s * 2))
    got = cpsat(g, budget, time_limit_s=1.0)
    assert got.status == FEASIBLE and got.estimate == simulate(g, warm)
    assert got.space_bound_s == warm_s and not got.space_optimal
    assert got.lower_bound_s is None and got.gap is None
    full = full_space_bound(g, budget, time_limit_s=30.0)  # (proven: the relaxation's optimum)
    got = certify(g, got, config=SolverConfig(bound_s=30.0))
    assert got.lower_bound_s == full and got.gap == pytest.approx((warm_s - full) / warm_s)


def test_cpsat_incumbents_keep_the_best_schedule_that_fits() -> None:
    """Every improving CP-SAT solution is simulated; the best that fits is kept. Solved to
    optimality, the kept one is the optimum itself (which fits on this chain)."""
    g = random_graph(8, kind="chain", seed=4)
    points = unit_points(g)
    budget = brute_force(g, 0, points=points).min_feasible_bytes
    budget += (g.measured_peak_bytes - budget) // 2
    ref = brute_force(g, budget, points=points)
    model = CpsatModel(g, points, budget)
    seen = Incumbents(model, g, budget)
    solver = cp_model.CpSolver()
    assert solver.Solve(model.m, seen.callback()) == cp_model.OPTIMAL
    assert seen.best is not None
    assert seen.best[0] == pytest.approx(ref.estimate.recompute_s, rel=REL, abs=0.0)
    assert simulate(g, seen.best[1]).peak_bytes <= budget


@pytest.mark.parametrize("kind,seeds", [("dag", range(3000, 3012)), ("chain", range(3100, 3106))],
                         ids=lambda x: x if isinstance(x, str) else f"{x.start}-{x.stop - 1}")
def test_cpsat_fine_equals_brute_force(kind: str, seeds: range) -> None:
    """cpsat_fine over `fine_points` (a boundary after any saver) returns brute force's
    optimum over those points, and INFEASIBLE exactly when brute force does."""
    finer = 0
    for seed in seeds:
        g = _graph(kind, seed, max_nodes=8)
        assert set(unit_points(g)) <= set(fine_points(g))
        finer += len(fine_points(g)) > len(unit_points(g))
        _compare_cpsat(seed, g, fine=True)
    if kind == "dag":  # (on chains every position is a chain cut already)
        assert finer >= len(seeds) // 3  # the space is finer on a good share of them


@pytest.mark.parametrize("bound_steps", [60, 1])
def test_cpsat_equals_brute_force_when_searching_without_presolve_first(
        monkeypatch: Any, bound_steps: int) -> None:
    """Large models are first searched without CP-SAT's presolve, then as a bound model (a few
    memory constraints, no replay ones) hinted with the best answer that fits; forced on small
    graphs, even with one memory constraint kept, cpsat still returns brute force's optimum,
    a bound no higher, and INFEASIBLE exactly when brute force does."""
    steps: list[int | None] = []
    real = cpsat_module.CpsatModel

    def spy(*a: Any, **k: Any) -> Any:  # (which models the search builds)
        steps.append(k.get("steps"))
        return real(*a, **k)

    monkeypatch.setattr(cpsat_module, "CpsatModel", spy)
    config = SolverConfig(cpsat_large_model=0, cpsat_bound_steps=bound_steps)
    for seed in range(1000, 1004):
        _compare_cpsat(seed, _graph("dag", seed, max_nodes=7), config=config)
    assert bound_steps in steps  # (the bound model was searched)


def test_cpsat_objective_is_the_simulated_recompute_time() -> None:
    """With a schedule's cuts and policies fixed (and room for anything), the CP-SAT model's
    optimum is the simulator's recompute time for it, checkpoint costs included, to within
    the objective's rounding (2 ns a unit): on synthetic DAGs and chains, 20 random schedules
    each."""
    rnd = random.Random(5)
    for kind, seed in [("dag", 1), ("dag", 2), ("chain", 3)]:
        g = random_graph(40, kind=kind, seed=seed, block_size=3)
        assert g.checkpoint_call_s > 0 and g.checkpoint_saved_s > 0
        points = unit_points(g)
        for _ in range(20):
            model = CpsatModel(g, points, 2 ** 60)
            # regions of units with random policies; no cut between two keep regions
            cut = [False] + [rnd.random() < 0.4 for _ in model.rc[1:]]
            rc: list[bool] = []
            for u in range(len(model.rc)):
                rc.append(rnd.random() < 0.6 if u == 0 or cut[u] else rc[-1])
                if u and cut[u] and not rc[u] and not rc[u - 1]:
                    cut[u] = False
            for u, v in enumerate(rc):
                model.m.Add(model.rc[u] == int(v))
                if u:
                    model.m.Add(model.cut[u] == int(cut[u]))
            solver = cp_model.CpSolver()
            assert solver.Solve(model.m) == cp_model.OPTIMAL
            want = simulate(g, model.schedule(solver)).recompute_s
            assert abs(solver.ObjectiveValue() / 1e9 - want) <= 2e-9 * len(rc), (kind, seed)


def test_dp_sizes_its_table_by_a_count_not_a_clock(recorded_graph, monkeypatch) -> None:
    """`dp.affordable_cuts` reads no clock (a loaded machine once got 12 cuts on the MLP
    where an idle one got 17, and dp's answer changed), and the cuts grow with the seconds
    and shrink with the graph."""
    import scheduler.solvers.dp as dp_module

    class NoClock:
        def perf_counter(self) -> float:
            raise AssertionError("affordable_cuts read the clock")

    monkeypatch.setattr(dp_module, "time", NoClock())
    mlp, gpt = recorded_graph("mlp"), recorded_graph("gpt")
    cuts = [dp_module.affordable_cuts(mlp, s) for s in (0.01, 0.1, 1.0)]
    assert cuts == sorted(cuts) and cuts[0] < cuts[-1]
    assert dp_module.affordable_cuts(gpt, 0.1) < dp_module.affordable_cuts(mlp, 0.1)
