"""Brute force over `chain`'s space: every schedule the table's boundaries and options make,
simulated one by one (the reference the chain DP is checked against)."""

from __future__ import annotations

from collections.abc import Iterator

from scheduler.cost.simulate import simulate
from scheduler.ir.graph import CostGraph
from scheduler.ir.schedule import KEEP, Region, Schedule
from scheduler.solvers.chain import ChainTable


def schedules(graph: CostGraph, table: ChainTable) -> Iterator[Schedule]:
    """Every schedule of the space, adjacent keep regions merged, each once."""
    names = graph.compute_nodes
    last = len(table.points) - 1
    seen: set[tuple] = set()

    def walk(a: int, acc: list[tuple]) -> Iterator[list[tuple]]:
        if a == last:
            yield acc
            return
        for (x, b), opts in sorted(table.options.items()):
            if x != a:
                continue
            for p, save in opts:
                yield from walk(b, [*acc, (table.points[a], table.points[b], p, save)])

    for spans in walk(0, []):
        merged: list[list] = []
        for a, b, p, save in spans:
            if merged and p == KEEP and merged[-1][2] == KEEP:
                merged[-1][1] = b
            else:
                merged.append([a, b, p, save])
        key = tuple((a, b, p, tuple(sorted(s))) for a, b, p, s in merged)
        if key in seen:
            continue
        seen.add(key)
        yield Schedule([Region(p, tuple(names[a:b]), frozenset(s)) for a, b, p, s in merged],
                       fingerprint=graph.fingerprint)


def simulated(graph: CostGraph, table: ChainTable) -> list[tuple[int, float, Schedule]]:
    """(simulated peak, recompute time, schedule) of every schedule of the space."""
    out = []
    for s in schedules(graph, table):
        est = simulate(graph, s, timeline=False)
        out.append((est.peak_bytes, est.recompute_s, s))
    return out
