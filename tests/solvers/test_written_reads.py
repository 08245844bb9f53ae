"""Recompute regions the rewriter refuses are constraints every solver and baseline respects.

The rewriter refuses a recompute region that holds a node reading a value from outside the
region when that value is written in place at or after the region's start
(`regions.CheckpointedStep`; Hugging Face's ``shift_tokens_right`` in T5 and Whisper given
``labels``). Profiling records those reads (`CostGraph.written_reads`). Here, on small
synthetic graphs given such reads, torch-free: the rule is written out again from its
definition (`_refused`, by node names), every schedule of a small space is enumerated and
simulated independently of the solvers' own enumeration, and

* ``brute`` and ``dp`` find exactly the optimum over the allowed schedules of their space, and
  ``cpsat`` the optimum over its unit points;
* every solver and baseline returns only schedules the rule allows;
* the constraint binds: the unconstrained optimum breaks it at some budget (else the test
  would be vacuous).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations, product

import pytest

from scheduler.cost.simulate import simulate
from scheduler.ir.graph import CostGraph, CostGraphError, WrittenRead
from scheduler.ir.replays import allowed, check, legalize, recompute_limits
from scheduler.ir.schedule import KEEP, RECOMPUTE, Region, Schedule, ScheduleError
from scheduler.solvers import INFEASIBLE, get_solver
from scheduler.solvers.base import finish
from scheduler.solvers.cpsat import unit_points
from scheduler.solvers.dp import save_candidates, table_for
from scheduler.testing.synthetic import random_graph

REL = 1e-12


def _with_reads(g: CostGraph, reads: list[tuple[str, str, str]]) -> CostGraph:
    return replace(g, written_reads=tuple(WrittenRead(*r) for r in reads))


def _graph(seed: int) -> CostGraph:
    """A chain of 7 compute nodes where n5 reads n1, which n4 writes in place (a recompute
    region starting at n2, n3 or n4 may not hold n5), n3 reads n0, which n2 writes (one
    starting at n1 or n2 may not hold n3), and n6 reads an input of the step that n0 writes
    (one starting at n0 may not hold n6)."""
    g = random_graph(7, kind="chain", seed=seed)
    return _with_reads(g, [("n5", "n1", "n4"), ("n3", "n0", "n2"), ("n6", "input:x", "n0")])


def _refused(g: CostGraph, nodes: tuple[str, ...]) -> bool:
    """The rewriter's rule, from its definition: a recompute region over ``nodes`` holds a
    reader of a value outside it that is written at or after the region's first node."""
    order = [n.name for n in g.nodes]
    first = order.index(nodes[0])
    return any(w.reader in nodes and w.value not in nodes and order.index(w.writer) >= first
               for w in g.written_reads)


def _rewritable(g: CostGraph, schedule: Schedule) -> bool:
    def ok(regions: tuple[Region, ...] | list[Region]) -> bool:
        return all(not r.recompute or (not _refused(g, r.nodes) and ok(r.inner))
                   for r in regions)
    return ok(schedule.regions)


def _space(g: CostGraph, points: list[int], saves: bool) -> list[tuple[int, float, Schedule]]:
    """(peak, recompute, schedule) of every allowed schedule with boundaries at ``points``,
    keep or recompute (with ``saves``: each save set `save_candidates` offers), simulated."""
    names = g.compute_nodes
    inner = points[1:-1]
    out = []
    for k in range(len(inner) + 1):
        for cuts in combinations(inner, k):
            bounds = (0, *cuts, len(names))
            spans = list(zip(bounds, bounds[1:]))
            for pols in product((KEEP, RECOMPUTE), repeat=len(spans)):
                options = [save_candidates(g, a, b) if p == RECOMPUTE and saves
                           else [frozenset()] for (a, b), p in zip(spans, pols)]
                for sv in product(*options):
                    regions = [Region(p, tuple(names[a:b]), s)
                               for (a, b), p, s in zip(spans, pols, sv)]
                    if any(r.recompute and _refused(g, r.nodes) for r in regions):
                        continue
                    s = Schedule(regions)
                    est = simulate(g, s, timeline=False)
                    out.append((est.peak_bytes, est.recompute_s, s))
    return out


def _best(space: list[tuple[int, float, Schedule]], budget: int) -> float | None:
    fits = [t for p, t, _ in space if p <= budget]
    return min(fits) if fits else None


def _budgets(g: CostGraph, space: list[tuple[int, float, Schedule]]) -> list[int]:
    peaks = sorted({p for p, _, _ in space})
    return sorted({peaks[0] - 1, *peaks[:: max(1, len(peaks) // 6)], peaks[-1]})


def test_limits_are_the_rule() -> None:
    """`recompute_limits` / `allowed` say of every span exactly what the rule says."""
    for seed in range(4):
        g = _graph(seed)
        names = g.compute_nodes
        n = len(names)
        for a in range(n):
            for b in range(a + 1, n + 1):
                assert allowed(g, a, b) == (not _refused(g, tuple(names[a:b]))), (seed, a, b)
    assert recompute_limits(_graph(0)) == (6, 3, 3, 5, 5, 7, 7)


def test_graph_json_keeps_the_reads_and_old_files_load() -> None:
    g = _graph(0)
    back = CostGraph.from_dict(g.to_dict())
    assert back.written_reads == g.written_reads and back == g
    plain = random_graph(7, kind="chain", seed=0)
    assert "written_reads" not in plain.to_dict()  # graphs without them are written as before
    assert CostGraph.from_dict(plain.to_dict()).written_reads == ()
    bad = {**g.to_dict(), "written_reads": [["n5", "n1", "nowhere"]]}
    with pytest.raises(CostGraphError, match="written_reads\\[0\\].writer: unknown node"):
        CostGraph.from_dict(bad)
    with pytest.raises(CostGraphError, match="written_reads\\[0\\]"):
        CostGraph.from_dict({**g.to_dict(), "written_reads": [["n5", "n1"]]})


def test_validate_refuses_what_the_rewriter_refuses() -> None:
    g = _graph(0)
    bad = Schedule.from_regions(g, [(0, 2, KEEP), (2, 7, RECOMPUTE)])
    bad.validate(g)  # (the simulator prices it: solvers measure with such regions)
    with pytest.raises(ScheduleError, match="region 1 recomputes from 'n1', which node 'n4'"):
        bad.validate(g, rewritable=True)
    Schedule.from_regions(g, [(0, 3, KEEP), (3, 5, RECOMPUTE), (5, 7, KEEP)]).validate(
        g, rewritable=True)


@pytest.mark.parametrize("seed", range(4))
def test_brute_dp_cpsat_are_optimal_over_the_allowed_space(seed: int) -> None:
    g = _graph(seed)
    n = len(g.compute_nodes)
    every = list(range(n + 1))
    plain = _space(g, every, saves=False)
    dp_points = table_for(g)[0].points
    assert dp_points == every
    with_saves = _space(g, dp_points, saves=True)
    cp_points = unit_points(g)
    on_units = _space(g, cp_points, saves=False)
    for budget in _budgets(g, plain):
        for name, space in (("brute", plain), ("dp", with_saves), ("cpsat", on_units)):
            got = get_solver(name)(g, budget, **({"time_limit_s": 60.0} if name == "cpsat"
                                                 else {}))
            want = _best(space, budget)
            if want is None:
                assert got.status == INFEASIBLE and got.schedule is None, (name, budget)
                continue
            assert got.schedule is not None and _rewritable(g, got.schedule), (name, budget)
            assert got.estimate.peak_bytes <= budget
            assert got.estimate.recompute_s == pytest.approx(want, rel=REL, abs=0.0), \
                (name, budget, got.schedule.describe())


def test_the_constraint_binds() -> None:
    """Without the reads, the optimum at some budgets is a schedule the rule refuses: so the
    tests above would fail if a solver ignored them."""
    hit = 0
    for seed in range(4):
        g = _graph(seed)
        free = replace(g, written_reads=())
        for budget in _budgets(free, _space(free, list(range(8)), saves=False)):
            r = get_solver("brute")(free, budget)
            if r.schedule is not None and not _rewritable(g, r.schedule):
                hit += 1
    assert hit >= 3


SOLVERS = ["none", "every_block", "sqrt", "uniform:2", "uniform:3", "uniform:7", "greedy",
           "knapsack", "brute", "dp", "blocks", "blocks_nested", "cpsat", "cpsat_fine",
           "relax", "auto"]
#: the solvers that search only allowed regions (the baselines' cuts are moved afterwards)
NATIVE = ("brute", "dp", "blocks", "blocks_nested", "relax")


@pytest.mark.parametrize("seed", range(3))
def test_every_solver_returns_only_allowed_schedules(seed: int) -> None:
    g = _graph(seed)
    space = _space(g, list(range(8)), saves=False)
    for budget in _budgets(g, space):
        for name in SOLVERS:
            r = get_solver(name)(g, budget, **({} if name in ("brute",) or ":" in name
                                               else {"time_limit_s": 20.0}))
            if r.schedule is None:
                continue
            assert _rewritable(g, r.schedule), (name, budget, r.schedule.describe())
            if name in NATIVE:  # they search the allowed space: nothing to move afterwards
                assert "moved_cuts" not in r.schedule.meta, (name, budget)
            assert r.estimate == simulate(g, r.schedule)
            if r.status != INFEASIBLE:
                assert r.estimate.peak_bytes <= budget, (name, budget)


def test_a_refused_cut_moves_to_the_nearest_allowed_place() -> None:
    """A recompute region n2..n3 is refused (it holds n3, n0 is outside, n2 writes it): its
    start moves one node on, to n3 (the nearest allowed start; ending it before n3 is as near,
    and moving the start is preferred), and the rest is unchanged."""
    g = _graph(0)
    sched = Schedule.from_regions(g, [(0, 2, KEEP), (2, 4, RECOMPUTE), (4, 7, KEEP)])
    fixed, moves = legalize(g, sched)
    assert [(r.nodes[0], r.nodes[-1], r.policy) for r in fixed.regions] == [
        ("n0", "n2", KEEP), ("n3", "n3", RECOMPUTE), ("n4", "n6", KEEP)]
    assert moves == ["region 1 (n2 .. n3): start moved to n3"]
    check(g, fixed)
    # the shared path every solver's result takes: claims are dropped, what moved is said
    r = finish(g, 1 << 40, sched, solver="test", started=0.0, status="OPTIMAL",
               lower_bound_s=0.0)
    assert r.status == "FEASIBLE" and not r.space_optimal
    assert r.schedule.meta["moved_cuts"] == moves and _rewritable(g, r.schedule)


def test_nested_regions_are_checked_and_legalized() -> None:
    g = _graph(0)
    names = g.compute_nodes
    inner = (Region(KEEP, tuple(names[0:2])), Region(RECOMPUTE, tuple(names[2:6])))
    sched = Schedule([Region(RECOMPUTE, tuple(names[0:6]), inner=inner),
                      Region(KEEP, (names[6],))], fingerprint=g.fingerprint)
    with pytest.raises(ScheduleError, match="region 0.1 recomputes from 'n1'"):
        check(g, sched)
    fixed, moves = legalize(g, sched)
    assert moves and _rewritable(g, fixed) and fixed.nested
    fixed.validate(g, rewritable=True)
