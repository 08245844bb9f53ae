"""The simulator on nested schedules (`Region.inner`): a hand-computed chain, and the
equivalences that must hold on every recorded graph (a region nesting one keep region, or one
recompute region, over all its nodes is the flat region). Agreement with measured peaks is in
tests/test_nested_agree.py."""

from __future__ import annotations

import random
from typing import Any

import pytest
from _chain import chain
from conftest import RECORDED_GRAPHS

from scheduler.cost.simulate import simulate
from scheduler.ir.graph import CostGraph
from scheduler.ir.schedule import KEEP, RECOMPUTE, Region, Schedule

K = 1000  # bytes of each chain node's output


def _sched(g: CostGraph, regions: list[Region]) -> Schedule:
    s = Schedule(regions, fingerprint=g.fingerprint)
    s.validate(g)
    return s


@pytest.fixture(scope="module")
def g6() -> CostGraph:
    return chain([""] * 6, out_bytes=K, time_s=1e-3)


def _r(g: CostGraph, a: int, b: int, *inner: Region) -> Region:
    return Region(RECOMPUTE, tuple(g.compute_nodes[a:b]), inner=inner)


def _k(g: CostGraph, a: int, b: int) -> Region:
    return Region(KEEP, tuple(g.compute_nodes[a:b]))


def test_hand_computed_chain_two_inner_recompute_regions(g6: CostGraph) -> None:
    """recompute n0..n5 [recompute n0..n2 | recompute n3..n5] on the 6-node chain (node i
    saves node i-1's 1000-byte output, the loss reads n5's).

    Forward holds nothing but the current value (2000 at most: an output and its reader's).
    Backward, at step n5 (the gradient of n5's output, 1000, alive): the outer replay runs n0,
    n1, n2 (the first inner region as a checkpoint: it keeps nothing) and stops as it enters
    the second, packing that one's input, n2's output: 1000 + 1000 after it. The second inner
    region then replays n3 and n4 (n5 packs its saved input before it runs, so it does not):
    while n4's output is made, the gradient and the outputs of n2, n3, n4 are alive, 5000, the
    peak, and 4000 stay. At step n2 the first inner region replays n0, n1: 1000 + 2000.
    Node runs replayed: 3 (outer) + 2 + 2 = 7."""
    s = _sched(g6, [_r(g6, 0, 6, _r(g6, 0, 3), _r(g6, 3, 6))])
    e = simulate(g6, s)
    base = g6.base_bytes
    assert e.forward_peak_bytes - base == 2 * K
    assert e.peak_bytes - base == 5 * K
    assert e.recompute_s == pytest.approx(7e-3)
    replays = [(label, b - base) for label, b in e.timeline if label.startswith("recompute")]
    assert replays == [("recompute n0", 2 * K), ("recompute n3", 4 * K), ("recompute n0", 3 * K)]


def test_hand_computed_chain_inner_keep_region(g6: CostGraph) -> None:
    """recompute n0..n5 [recompute n0..n2 | keep n3..n5]: the outer replay (step n5) runs n0..n4
    and keeps what the keep region saves (outputs of n2, n3, n4: 1000 grad + 3000); the inner
    region replays at step n2 (n0, n1: 1000 grad + 2000). Replayed: 5 + 2 node runs."""
    s = _sched(g6, [_r(g6, 0, 6, _r(g6, 0, 3), _k(g6, 3, 6))])
    e = simulate(g6, s)
    replays = [(label, b - g6.base_bytes) for label, b in e.timeline
               if label.startswith("recompute")]
    assert replays == [("recompute n0", 4 * K), ("recompute n0", 3 * K)]
    assert e.recompute_s == pytest.approx(7e-3)
    assert e.forward_peak_bytes - g6.base_bytes == 2 * K


def test_a_node_replayed_by_three_levels_pays_three_times(g6: CostGraph) -> None:
    # n0..n3 [ n0..n3 [ keep n0..n1 | keep n2..n3 ] ]... the innermost region is replayed by
    # both ancestors and by itself: three depths, n3 is the last saver (it does not run)
    inner = _r(g6, 0, 4, _k(g6, 0, 2), _k(g6, 2, 4))
    s = _sched(g6, [_r(g6, 0, 4, _r(g6, 0, 4, inner)), _k(g6, 4, 6)])
    e = simulate(g6, s)
    # the outer two stop entering their only child (nothing runs); the innermost runs n0..n2
    assert e.recompute_s == pytest.approx(3e-3)
    s2 = _sched(g6, [_r(g6, 0, 4, _r(g6, 0, 2), _k(g6, 2, 4)), _k(g6, 4, 6)])
    # outer replay runs n0..n2 (n3 packs first), then the inner one n0 (n1 packs first)
    assert simulate(g6, s2).recompute_s == pytest.approx(4e-3)


def _random_flat(g: CostGraph, rnd: random.Random) -> list[Region]:
    names = g.compute_nodes
    n = len(names)
    cuts = sorted(rnd.sample(range(1, n), rnd.randint(0, min(6, n - 1))))
    bounds = [0, *cuts, n]
    return [Region(rnd.choice((KEEP, RECOMPUTE)), tuple(names[a:b]))
            for a, b in zip(bounds, bounds[1:])]


def _same(a: Any, b: Any) -> None:
    assert (a.peak_bytes, a.forward_peak_bytes) == (b.peak_bytes, b.forward_peak_bytes)


@pytest.mark.parametrize("name", [n for n, _ in RECORDED_GRAPHS])
def test_nesting_one_region_over_all_nodes_changes_no_peak(name: str, recorded_graph: Any
                                                           ) -> None:
    """A recompute region holding one keep region over all its nodes is the flat region (its
    nodes are all direct); one holding one recompute region over all its nodes replays
    nothing itself (it stops entering its child) and then the child as the flat region."""
    g = recorded_graph(name)
    rnd = random.Random(name)
    for _ in range(6):
        flat = _random_flat(g, rnd)
        if not any(r.recompute for r in flat):
            continue
        expected = simulate(g, _sched(g, flat))
        as_keep = [Region(RECOMPUTE, r.nodes, inner=(Region(KEEP, r.nodes),))
                   if r.recompute else r for r in flat]
        as_rec = [Region(RECOMPUTE, r.nodes, inner=(Region(RECOMPUTE, r.nodes),))
                  if r.recompute else r for r in flat]
        got_keep = simulate(g, _sched(g, as_keep))
        _same(got_keep, expected)
        assert got_keep.recompute_s == pytest.approx(
            expected.recompute_s, rel=1e-9, abs=1e-12)
        _same(simulate(g, _sched(g, as_rec)), expected)


def test_nested_schedules_simulate_on_every_recorded_graph(recorded_graph: Any) -> None:
    """Random two- and three-level schedules simulate; their forward peak is the flat one of
    their top regions (forward keeps only a top region's inputs)."""
    for name, _ in RECORDED_GRAPHS:
        g = recorded_graph(name)
        rnd = random.Random(name)
        for _ in range(4):
            flat = _random_flat(g, rnd)
            nested = [_nest(r, rnd, 2) if r.recompute else r for r in flat]
            a, b = simulate(g, _sched(g, flat)), simulate(g, _sched(g, nested))
            assert a.forward_peak_bytes == b.forward_peak_bytes, name
            assert b.recompute_s >= a.recompute_s - 1e-12


def _nest(r: Region, rnd: random.Random, depth: int) -> Region:
    n = len(r.nodes)
    if depth == 0 or n < 2:
        return r
    cuts = sorted(rnd.sample(range(1, n), rnd.randint(1, min(3, n - 1))))
    bounds = [0, *cuts, n]
    inner = []
    for a, b in zip(bounds, bounds[1:]):
        sub = Region(rnd.choice((KEEP, RECOMPUTE)), r.nodes[a:b])
        inner.append(_nest(sub, rnd, depth - 1) if sub.recompute else sub)
    return Region(RECOMPUTE, r.nodes, inner=tuple(inner))
