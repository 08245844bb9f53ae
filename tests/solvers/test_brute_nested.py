"""Brute force over nested schedules (`solvers.brute_nested`): its space counted by hand on a
tiny case, equal to `brute`'s at depth 1, every schedule distinct and valid, and on a chain of
blocks nesting reaches a peak below the least flat one (the point of nesting)."""

from __future__ import annotations

import warnings

import pytest
from _chain import chain

from scheduler.cost.simulate import simulate
from scheduler.ir.schedule import Schedule
from scheduler.solvers.base import FEASIBLE, INFEASIBLE
from scheduler.solvers.brute import brute_force, count_schedules
from scheduler.solvers.brute_nested import brute_force_nested, count_nested, nested_schedules
from scheduler.solvers.certify import certify
from scheduler.solvers.cpsat_space import snap
from scheduler.solvers.repair import repair


def _blocks(k: int) -> tuple[object, list[int]]:
    """A chain of ``k`` two-node blocks between two un-blocked nodes, and its block bounds."""
    g = chain(["", *[f"h.{i}" for i in range(k) for _ in range(2)], ""])
    n = len(g.compute_nodes)
    return g, sorted({0, *range(1, n, 2), n})


def test_the_space_of_two_nodes_counted_by_hand() -> None:
    """Points 0, 1, 2. One region: keep; recompute flat; recompute holding (keep, recompute),
    (recompute, keep) or (recompute, recompute): 5. Two regions: keep+recompute,
    recompute+keep, recompute+recompute (keep+keep is one keep region; the one-node regions
    cannot nest): 3. Deeper levels add nothing (no point inside a one-node region)."""
    g = chain(["", ""])
    assert count_nested(g, [0, 1, 2], 1) == 2 + 3  # flat: keep, recompute; the 3 pairs
    assert count_nested(g, [0, 1, 2], 2) == 8
    assert count_nested(g, [0, 1, 2], 3) == 8


@pytest.mark.parametrize("k", [2, 3])
def test_depth_one_is_the_flat_brute_force(k: int) -> None:
    g, pts = _blocks(k)
    assert count_nested(g, pts, 1) == count_schedules(g, pts)
    floor = brute_force(g, 0, points=pts).min_feasible_bytes
    assert brute_force_nested(g, 0, points=pts, depth=1).least_peak_bytes == floor
    for extra in (0, 500, 1000, 3000):
        flat = brute_force(g, floor + extra, points=pts)
        got = brute_force_nested(g, floor + extra, points=pts, depth=1).result
        assert got.estimate.recompute_s == pytest.approx(flat.estimate.recompute_s, rel=1e-12)
        assert got.estimate.peak_bytes <= floor + extra


def test_every_schedule_is_valid_and_distinct() -> None:
    g, pts = _blocks(3)
    seen = set()
    for s in nested_schedules(g, pts, 3):
        s.validate(g)
        key = tuple(s.regions)
        assert key not in seen, s.describe()
        seen.add(key)
    assert len(seen) == count_nested(g, pts, 3)
    assert max(s.depth for s in nested_schedules(g, pts, 3)) == 3


def test_nesting_reaches_below_the_least_flat_peak_on_a_chain() -> None:
    """The 8-node chain of three blocks (each node 1000 bytes, saved by the next): the least
    flat peak over the block bounds is 5000 bytes over the base, the least with one level of
    nesting 4000; at 4999 only a nested schedule fits."""
    g, pts = _blocks(3)
    base = g.base_bytes
    flat = brute_force_nested(g, 0, points=pts, depth=1)
    nested = brute_force_nested(g, 0, points=pts, depth=2)
    assert (flat.least_peak_bytes - base, nested.least_peak_bytes - base) == (5000, 4000)
    assert nested.least_peak.depth == 2
    assert simulate(g, nested.least_peak).peak_bytes == nested.least_peak_bytes
    budget = flat.least_peak_bytes - 1
    assert brute_force(g, budget, points=pts).status == INFEASIBLE
    got = brute_force_nested(g, budget, points=pts, depth=2)
    assert got.result.status == FEASIBLE and got.result.space_optimal
    assert got.result.schedule.depth == 2 and got.result.estimate.peak_bytes <= budget
    # no schedule of the space that fits recomputes less
    fits = [simulate(g, s) for s in nested_schedules(g, pts, 2)]
    least = min(e.recompute_s for e in fits if e.peak_bytes <= budget)
    assert got.result.estimate.recompute_s == least


def test_infeasible_names_the_least_peak() -> None:
    g, pts = _blocks(2)
    got = brute_force_nested(g, 10, points=pts, depth=2)
    assert got.result.status == INFEASIBLE
    assert got.result.min_feasible_bytes == got.least_peak_bytes
    assert isinstance(got.least_peak, Schedule) and got.least_peak.fingerprint == g.fingerprint


def test_bad_arguments_are_named() -> None:
    g, pts = _blocks(2)
    with pytest.raises(ValueError, match=r"depth must be at least 1"):
        list(nested_schedules(g, pts, 0))
    with pytest.raises(ValueError, match=r"points must .*include 0 and n"):
        count_nested(g, [1, 2], 2)
    with pytest.raises(ValueError, match=r"would simulate \d+ schedules, more than "
                                         r"max_schedules=10"):
        brute_force_nested(g, 10**9, points=pts, depth=2, max_schedules=10)


def test_certify_leaves_a_nested_result_as_its_solver_proved_it() -> None:
    """Below the flat floor the full-space bound (over flat schedules) has nothing to say
    about a nested schedule: no bound, no warning, the space optimum kept as FEASIBLE."""
    g, pts = _blocks(3)
    budget = brute_force_nested(g, 0, points=pts, depth=1).least_peak_bytes - 1
    result = brute_force_nested(g, budget, points=pts, depth=2).result
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = certify(g, result, time_limit_s=5)
    assert got.certified and got.status == FEASIBLE and got.lower_bound_s is None
    assert got.space_optimal and got.schedule == result.schedule


def test_flat_only_helpers_refuse_a_nested_schedule() -> None:
    g, pts = _blocks(2)
    nested = next(s for s in nested_schedules(g, pts, 2) if s.nested)
    with pytest.raises(ValueError, match=r"repair changes flat schedules; this one nests"):
        repair(g, nested, 10**9, 1.0)
    with pytest.raises(ValueError, match=r"cpsat's space is flat: a nested schedule"):
        snap(nested, pts)
