"""The full schedule space of small graphs, enumerated: the reference that the full-space bound
and every OPTIMAL or INFEASIBLE claim on small graphs are checked against.

The full space is every schedule `Schedule` can express on one level: region boundaries after
any compute node, each region ``keep`` or ``recompute``, and any save set of a recompute
region. `full_space` simulates each one itself (with `brute.schedules` as the enumerator), so
that brute force's own search is checked against it, not against its own cache.
"""

from __future__ import annotations

import itertools

from scheduler.cost.simulate import simulate
from scheduler.ir.graph import CostGraph
from scheduler.ir.schedule import KEEP, RECOMPUTE, Region, Schedule
from scheduler.solvers.brute import schedules
from scheduler.testing.synthetic import random_graph

__all__ = ["every_save_set", "full_space", "small_graph", "space_budgets", "space_optimum"]


def every_save_set(g: CostGraph, start: int, stop: int) -> list[frozenset[str]]:
    """Every save set of a region: any subset of its nodes that allocate."""
    nodes = [x for x in g.compute_nodes[start:stop] if g.allocates(x)]
    return [frozenset(c) for k in range(len(nodes) + 1)
            for c in itertools.combinations(nodes, k)]


def full_space(g: CostGraph) -> list[tuple[int, float]]:
    """(simulated peak bytes, recompute seconds) of every schedule of the full space."""
    names = g.compute_nodes
    out = []
    for spans in schedules(g, list(range(len(names) + 1)), (KEEP, RECOMPUTE), every_save_set):
        regions = [Region(policy, tuple(names[a:b]), frozenset(save))
                   for a, b, policy, save in spans]
        est = simulate(g, Schedule(regions))
        out.append((est.peak_bytes, est.recompute_s))
    return out


def space_optimum(space: list[tuple[int, float]], budget: int) -> float | None:
    """The least recompute time in ``space`` among schedules that fit ``budget`` (None: none
    fits)."""
    return min((t for p, t in space if p <= budget), default=None)


def small_graph(seed: int) -> CostGraph:
    """A synthetic graph of 3 to 6 compute nodes (a chain for even seeds, a DAG for odd ones),
    small enough that `full_space` enumerates every save set."""
    kind = "dag" if seed % 2 else "chain"
    return random_graph(3 + seed % 4, kind=kind, seed=seed, block_size=2,
                        skip_prob=0.5 if seed % 4 == 1 else 0.3)


def space_budgets(space: list[tuple[int, float]]) -> list[int]:
    """Budgets that tell the space's schedules apart: about eight of its distinct peaks, the
    least and the largest among them, and one byte below the least (nothing fits there)."""
    peaks = sorted({p for p, _ in space})
    return sorted({*peaks[::max(1, len(peaks) // 8)], peaks[0] - 1, peaks[-1]})
