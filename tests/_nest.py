"""Random nested schedules over a graph's compute nodes, for the tests (torch-free)."""

from __future__ import annotations

import random

from scheduler.ir.graph import CostGraph
from scheduler.ir.schedule import KEEP, RECOMPUTE, Region, Schedule


def split(nodes: tuple[str, ...], rnd: random.Random, k_max: int = 3) -> list[tuple[str, ...]]:
    """``nodes`` cut into 1..k_max+1 random contiguous runs."""
    n = len(nodes)
    if n < 2:
        return [nodes]
    cuts = sorted(rnd.sample(range(1, n), rnd.randint(1, min(k_max, n - 1))))
    bounds = [0, *cuts, n]
    return [nodes[a:b] for a, b in zip(bounds, bounds[1:])]


def nest(nodes: tuple[str, ...], rnd: random.Random, depth: int) -> Region:
    """A recompute region over ``nodes`` with random inner regions, ``depth`` levels deep at
    most (some inner recompute regions nest again)."""
    if depth <= 1 or len(nodes) < 2:
        return Region(RECOMPUTE, nodes)
    inner = []
    for part in split(nodes, rnd):
        if rnd.random() < 0.5:
            inner.append(Region(KEEP, part))
        else:
            inner.append(nest(part, rnd, depth - 1 if rnd.random() < 0.7 else 1))
    return Region(RECOMPUTE, nodes, inner=tuple(inner))


def random_nested(g: CostGraph, rnd: random.Random, depth: int = 3) -> Schedule:
    """Random top-level regions (up to 7), each recompute one nested at random."""
    names = tuple(g.compute_nodes)
    regions = []
    for part in split(names, rnd, 6):
        if rnd.random() < 0.35:
            regions.append(Region(KEEP, part))
        else:
            regions.append(nest(part, rnd, depth))
    s = Schedule(regions, fingerprint=g.fingerprint)
    s.validate(g)
    return s
