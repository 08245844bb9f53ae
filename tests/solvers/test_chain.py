"""``chain`` (exact DP over the chain of unit calls) against brute force over its space."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.cost.simulate import simulate
from scheduler.ir.graph import CostGraph
from scheduler.ir.schedule import Schedule
from scheduler.solvers import INFEASIBLE, OPTIMAL, SolverConfig, get_solver
from scheduler.solvers.chain import ChainTable, chain, table_of
from scheduler.solvers.chaintable import TableTooLarge
from scheduler.testing.synthetic import random_graph

from _chain_brute import simulated

DATA = Path(__file__).resolve().parents[1] / "data"


def _units_graph(kind: str, seed: int, block: int, calls: int) -> CostGraph:
    """A random graph in blocks of ``block`` nodes, the middle ``calls`` of them units (one
    block of the model's own code before and after)."""
    g = random_graph(block * (calls + 2), kind=kind, seed=seed, block_size=block)
    return replace(g, units=tuple(f"blocks.{i}" for i in range(1, calls + 1)))


def _llama() -> CostGraph:
    """A 2-layer Hugging Face Llama (width 32, sequence 64) profiled in units (fake,
    roofline h100): rotary tables and the mask shared by the calls, metadata asserts."""
    return CostGraph.load(DATA / "units_llama2.json")


def _llama_bf16() -> CostGraph:
    """The same Llama (width 32, batch 2 x 64) in bfloat16, profiled in units (fake,
    roofline h100): each norm casts its input to float32 and saves the copy, so that nothing
    saves the call's input or the attention half's sum (anchors that are not secured)."""
    return CostGraph.load(DATA / "units_llama2_bf16.json")


def _check(graph: CostGraph, *, exact: bool = True, budgets: int = 12,
           table: ChainTable | None = None) -> None:
    """At budgets spread over the space's simulated peaks (and below the least): chain finds
    brute force's least recompute time, its schedule simulated within the budget, OPTIMAL
    (gap 0) where its table composes exactly; never OPTIMAL with a worse time."""
    table = table or table_of(graph)
    assert table.exact == exact
    space = simulated(graph, table)
    peaks = sorted({p for p, _, _ in space})
    chosen = peaks[:: max(1, len(peaks) // budgets)] + [peaks[-1], peaks[0] - 1]
    for budget in chosen:
        best = min((t for p, t, _ in space if p <= budget), default=None)
        r = chain(graph, budget)
        if r.schedule is not None:
            est = simulate(graph, r.schedule)
            assert est == r.estimate and est.peak_bytes <= budget
        if r.status == OPTIMAL:
            assert r.gap == 0.0 and r.schedule.meta["space"]
            assert r.estimate.recompute_s == pytest.approx(best, rel=1e-9, abs=1e-12)
        if exact:
            if best is None:
                assert r.status == INFEASIBLE and r.min_feasible_bytes == peaks[0]
            else:
                assert r.status == OPTIMAL


@pytest.mark.parametrize("seed", [0, 4, 8])
def test_equals_brute_force_on_unit_chains(seed: int) -> None:
    _check(_units_graph("chain", seed, 3, 2))


def test_equals_brute_force_on_three_unit_calls() -> None:
    _check(_units_graph("chain", 12, 2, 3))


def test_equals_brute_force_on_hf_llama_units_with_anchors(monkeypatch) -> None:
    """Two of each call's 20 cuts (brute force cannot walk them all): one early in the
    attention half and one after the attention's sum, so that the call's input, needed
    again at the residual add, crosses two boundaries (an anchor) where the old rule of one
    crossing storage left no boundary."""
    import scheduler.solvers.chain as chain_module
    import scheduler.solvers.chaincuts as chaincuts
    import scheduler.solvers.chaintable as chaintable

    g = _llama()
    every = chaintable.unit_cuts
    first = every(g, *table_of(g).calls[0])
    assert len(first) == 20

    def two(graph, start, stop, tracked=0):
        cuts = every(graph, start, stop, tracked)
        return [cuts[0], cuts[8]]

    monkeypatch.setattr(chaintable, "unit_cuts", two)
    table = chaintable.ChainTable(g)
    _, pos = chaincuts.positions_of(g)
    shared = chaincuts.shared_inputs(g)
    inner = table.points[1:-1]
    anchors = [sid for sid, (p, uses) in pos.items() if sid not in shared and uses
               and sum(p < c <= uses[-1] for c in inner) >= 2]
    assert anchors and table.exact
    monkeypatch.setattr(chain_module, "table_of", lambda graph, **kw: table)
    _check(g, table=table)


def test_tracked_anchors_equal_brute_force_on_a_bf16_llama(monkeypatch) -> None:
    """In bfloat16 no unit cut of the default space falls inside the attention half (its
    one cut per call is after the half's sum); with ``chain_tracked=2`` two cuts inside it
    (brute force cannot walk all 31), which the call's input crosses with nothing saving it:
    a tracked anchor, whose holder the entry states carry. The DP's optimum is brute
    force's at a dozen budgets, OPTIMAL."""
    import scheduler.solvers.chain as chain_module
    import scheduler.solvers.chaintable as chaintable

    g = _llama_bf16()
    every = chaintable.unit_cuts
    call = table_of(g).calls[0]
    assert len(every(g, *call)) == 1 and len(every(g, *call, 2)) == 31

    def two(graph, start, stop, tracked=0):
        cuts = every(graph, start, stop, tracked)
        return [cuts[1], cuts[8]]

    monkeypatch.setattr(chaintable, "unit_cuts", two)
    table = chaintable.ChainTable(g, tracked=2)
    first_input = next(sid for sid, st in g.storages.items() if st.producer == "embedding")
    assert first_input in table.tracked and table.exact
    assert any(q is not None and q[1] for qs in table.states.values() for q in qs)
    monkeypatch.setattr(chain_module, "table_of", lambda graph, **kw: table)
    _check(g, table=table)


@pytest.mark.parametrize("graph, tracked, points", [
    ("fp32", 0, 45), ("fp32", 2, 67), ("bf16", 2, 67)])
def test_composition_equals_simulate_on_random_schedules_of_the_hf_llama(
        graph: str, tracked: int, points: int) -> None:
    """Random paths through the 2-layer Llama's whole table (every cut per call, anchors
    among them, tracked ones with ``chain_tracked=2``; every region option after the state
    the path leaves): their composed peak and time, the DP's sums, against `simulate`,
    which measured each entry in another context (the table packs non-overlapping jobs
    into one simulation). (It found recompute regions saving their own output composed 512
    bytes low where a recompute region followed: those options are out of the space,
    `ChainTable`.)"""
    import random

    g = _llama() if graph == "fp32" else _llama_bf16()
    table = table_of(g, tracked=tracked)
    assert table.exact and len(table.points) == points
    assert bool(table.tracked) == bool(tracked)
    rng = random.Random(0)
    last = len(table.points) - 1
    for _ in range(200):
        a, q, held, peak, t, spans = 0, None, 0, 0, 0.0, []
        while a < last:
            b = rng.choice(table.starts[a])
            o = rng.randrange(len(table.options[a, b]))
            e = table.entries[a, b, o, q]
            peak = max(peak, held + e.local)
            held += e.held
            t += e.time_s
            if b == last:
                peak = max(peak, held + e.tail_local)
            spans.append((table.points[a], table.points[b], *table.options[a, b][o]))
            q, a = table.leave(a, b, o, q), b
        est = simulate(g, Schedule.from_regions(g, spans))
        assert est.peak_bytes == peak
        assert est.recompute_s == pytest.approx(t, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("seed, block", [(0, 3), (16, 3), (6, 4)])
def test_skips_across_calls_are_tracked(seed: int, block: int) -> None:
    """A DAG whose skip connections cross two boundaries (one or two at once): the table
    tracks them (the accounting's property of their last reader, whether a region before
    holds them in the entry states) and the DP's optimum is brute force's, OPTIMAL."""
    g = _units_graph("dag", seed, block, 2)
    assert table_of(g).tracked
    _check(g)


def test_inexact_compositions_are_never_claimed() -> None:
    """A DAG whose entries the simulator finds not separable composes inexactly: chain
    still answers with simulated schedules but claims nothing."""
    g = _units_graph("dag", 30, 2, 3)
    assert table_of(g).chained
    _check(g, exact=False)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["chain", "dag"]), seed=st.integers(0, 10_000),
       shape=st.sampled_from([(2, 2), (3, 2)]), frac=st.floats(0, 1))
def test_property_random_unit_chains(kind: str, seed: int, shape: tuple[int, int],
                                     frac: float) -> None:
    """Over random unit chains and budgets: what chain returns fits under simulate, and
    OPTIMAL is brute force's optimum over the space; on an exact table it always is."""
    g = _units_graph(kind, seed, *shape)
    table = table_of(g)
    space = simulated(g, table)
    lo, hi = min(p for p, _, _ in space), max(p for p, _, _ in space)
    budget = int(lo + frac * (hi - lo))
    best = min(t for p, t, _ in space if p <= budget)
    r = chain(g, budget)
    if r.schedule is not None:  # (never one that does not fit)
        assert r.status != INFEASIBLE and simulate(g, r.schedule).peak_bytes <= budget
    if r.status == OPTIMAL or table.exact:
        assert r.status == OPTIMAL
        assert r.estimate.recompute_s == pytest.approx(best, rel=1e-9, abs=1e-12)


def _least(g: CostGraph) -> int:
    return chain(g, 0).min_feasible_bytes  # type: ignore[return-value]


def _kept(g: CostGraph) -> int:
    return simulate(g, Schedule.none(g)).peak_bytes



def test_auto_answers_with_chain_where_asked_and_is_never_worse() -> None:
    """With ``chain_first`` auto answers with chain's proven schedule; by default chain's
    schedule is one candidate, so auto's recomputes no more than chain's."""
    g = _llama()
    least = _least(g)
    budget = least + (_kept(g) - least) // 2
    alone = chain(g, budget)
    r = get_solver("auto")(g, budget, config=SolverConfig(chain_first=True))
    assert r.solver == "chain" and r.status == OPTIMAL and r.fits
    assert r.schedule.regions == alone.schedule.regions
    d = get_solver("auto")(g, budget, time_limit_s=5)
    assert d.fits and d.estimate.recompute_s <= alone.estimate.recompute_s * (1 + 1e-9)


def test_auto_past_its_deadline_answers_the_chains_schedule_and_runs_nothing_else(
        monkeypatch) -> None:
    """Where the chain (which no clock stops) leaves none of the limit, auto answers its
    schedule at once: no other solver starts past the deadline (on 126 Llama-3-8B-shaped
    layers the rest ran seconds past it)."""
    import scheduler.solvers.auto as auto_module

    g = _llama()
    least = _least(g)
    budget = least + (_kept(g) - least) // 2
    alone = chain(g, budget)
    real = auto_module.get_solver

    def only_chain(name: str):
        assert name == "chain", f"{name} ran past the deadline"
        return real(name)

    monkeypatch.setattr(auto_module, "get_solver", only_chain)
    r = get_solver("auto")(g, budget, time_limit_s=1e-9)
    assert r.solver == "chain" and r.fits
    assert r.schedule.regions == alone.schedule.regions


@pytest.mark.parametrize("which", ["fp32", "bf16"])
def test_the_default_table_is_the_richest_within_its_work(which: str) -> None:
    """``chain_tracked=None``: the most tracked anchors whose table plans at most
    ``chain_work`` node-simulations (each level's plan built on its own), 0 whatever it
    takes; and a table refused for its size is one whose plan is larger (the refusal from
    its options alone is a lower bound)."""
    g = _llama() if which == "fp32" else _llama_bf16()
    n = len(g.compute_nodes)
    planned = [ChainTable(g, tracked=t, measured=False).planned for t in range(3)]
    assert planned[0] < planned[1] < planned[2]  # (each level a larger table here)
    works = sorted({0, *(p * n for p in planned), *(p * n - 1 for p in planned)})
    for work in works:
        expect = max([t for t in range(3) if planned[t] * n <= work], default=0)
        table = table_of(g, tracked=None, work=work)
        assert table.tracked_cuts == expect, work
        assert table.simulations == planned[expect]  # (measured: its plan ran)
    for t in (1, 2):
        for most in sorted({0, planned[t] // 2, planned[t] - 1, planned[t]}):
            if most < planned[t]:
                with pytest.raises(TableTooLarge):
                    ChainTable(g, tracked=t, measured=False, most_simulations=most)
            else:
                assert ChainTable(g, tracked=t, measured=False,
                                  most_simulations=most).planned == planned[t]


def test_needs_units() -> None:
    with pytest.raises(ValueError, match="units"):
        chain(random_graph(6, seed=0), 10**9)


def test_deterministic() -> None:
    """Two loads of one graph (no shared cache), one budget: the same schedule."""
    a, b = _llama(), _llama()
    least = _least(a)
    budget = least + (_kept(a) - least) // 3
    ra, rb = chain(a, budget), chain(b, budget)
    assert ra.schedule is not None and ra.schedule.regions == rb.schedule.regions
    assert ra.estimate == rb.estimate and ra.status == rb.status == OPTIMAL


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1,
                         max_size=8), min_size=1, max_size=6))
def test_the_dps_fronts_are_pareto_fronts_with_the_first_of_equals(
        raw: list[list[tuple[int, int]]]) -> None:
    """The DP's merge of candidate chunks (each a front sorted by held, as the DP makes them)
    keeps exactly the points no other point beats in both held and key, and of equal points
    the first to come: against a brute force over every pair, on small integers (many
    ties)."""
    import numpy as np

    import scheduler.solvers.chain as chain_module

    chunks, points = [], []
    for c, pairs in enumerate(raw):
        front = []  # (a front: held ascending, key strictly descending)
        for h, k in sorted(set(pairs)):
            if not front or k < front[-1][1]:
                front = [p for p in front if p[0] < h] + [(h, k)]
        held = np.array([h for h, _ in front], np.int64)
        key = np.array([k for _, k in front], np.float64)
        chunks.append((held, key, -key, 7 * c, np.arange(len(front)), (c, c, c)))
        points += [(h, k, c, i) for i, (h, k) in enumerate(front)]
    f = chain_module._pareto(chunks)
    want = [p for n, p in enumerate(points)
            if not any((q[0] <= p[0] and q[1] <= p[1] and (q[0], q[1]) != (p[0], p[1]))
                       or ((q[0], q[1]) == (p[0], p[1]) and m < n)
                       for m, q in enumerate(points))]
    got = [(int(h), float(k), int(s) // 7, int(i))
           for h, k, s, i in zip(f.held, f.key, f.src, f.idx)]
    assert sorted(got) == sorted(want)
    assert list(f.held) == sorted(f.held) and all(f.other == -f.key)
    assert [f.span[int(s)] for s in f.span_of] == [(c, c, c) for _, _, c, _ in got]
