"""How `chain`'s table measures its entries (`measure`): each region option after each entry
state, in as few simulations of the whole step as the jobs' overlap allows, the simulator's
own numbers (`region_costs`)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..cost.simulate import region_costs
from ..ir.graph import CostGraph
from ..ir.schedule import KEEP, Region, Schedule

if TYPE_CHECKING:
    from .chaintable import ChainTable, State

__all__ = ["Entry", "measure"]


@dataclass(frozen=True)
class Entry:
    """One region option's costs after one entry state: its local peak (base included), the
    bytes it holds while later regions run, its recompute time, the loss region's local peak
    when it is the last region, and whether the simulator found it separable."""

    local: int
    held: int
    time_s: float
    tail_local: int
    exact: bool


def _kept_held(table: ChainTable) -> list[frozenset[int]]:
    """Per boundary, the tracked anchors crossing it that regions before hold where
    every region before is a keep region over one gap (as `_simulate` fills the gaps)."""
    out = [frozenset()]
    for j in range(1, len(table.points)):
        out.append(table.leave(j - 1, j, 0, (KEEP, out[-1]))[1])
    return out


def _free_at(table: ChainTable, pool: dict[State, list[int]], ends: list[int], left: list[State],
             w: int, kept: list[frozenset[int]], scan: int = 64) -> int | None:
    """A simulation of ``pool`` (taken out of it) that is free at boundary ``w`` with
    the tracked anchors there held as keep regions from the start would leave them (what
    a filler starting at ``w`` expects), or None; ``scan`` candidates at most (fewer
    simulations, not other numbers, hang on it)."""
    for ks in pool.values():
        for i in range(len(ks) - 1, -1, -1):
            k = ks[i]
            if ends[k] <= w:
                st = _kept_to(table, left[k], ends[k], w)
                if (frozenset() if st is None else st[1]) == kept[w]:
                    return ks.pop(i)
            scan -= 1
            if scan <= 0:
                return None
    return None


def _kept_to(table: ChainTable, q: State, a: int, b: int) -> State:
    """The state at boundary ``b`` after state ``q`` at ``a`` and keep regions over the
    gaps between."""
    for j in range(a, b):
        q = table.leave(j, j + 1, 0, q)
    return q


def _filler(table: ChainTable, a: int, q: State, kept: list[frozenset[int]]
            ) -> list[tuple[int, int, int]]:
    """Regions (boundary, boundary, option) ending at boundary ``a`` that leave ``q``
    after keep regions over single gaps before them (what `_simulate` puts there): the
    ones starting latest (a breadth-first walk from each earlier boundary in turn; the
    first path found)."""
    for w in range(a - 1, -1, -1):
        reach: dict[int, dict[State, list]] = {w: {None if w == 0 else (KEEP, kept[w]): []}}
        for j in range(w, a):
            for st, path in reach.get(j, {}).items():
                for b in table.starts[j]:
                    if b > a:
                        break
                    for o in range(len(table.options[j, b])):
                        reach.setdefault(b, {}).setdefault(table.leave(j, b, o, st),
                                                           path + [(j, b, o)])
        if q in reach.get(a, {}):
            return reach[a][q]
    raise AssertionError(f"no path leaves state {q} at boundary {a}")


def measure(table: ChainTable, graph: CostGraph) -> None:
    """Every entry of ``table`` (``table.entries``), in few simulations: each job (a region
    option after an entry state) is an interval of boundaries. Taken by start, a job goes
    into a simulation whose jobs so far leave its state where it starts (with keep regions
    over the gaps since), with nothing before it; else into one free where the regions
    that lead to its state (`_filler`) start, in the state they expect there; else into a
    new one. Jobs of one simulation do not disturb each other where the composition is
    exact, which is what ``table.exact`` checks."""
    kept = _kept_held(table)
    fillers: dict[tuple[int, State], list] = {}
    jobs = []
    for (a, b), opts in sorted(table.options.items()):
        for o in range(len(opts)):
            for q in table.states[a]:
                if q is not None and (a, q) not in fillers:
                    fillers[a, q] = _filler(table, a, q, kept)
                jobs.append((a, b, o, q, [] if q is None else fillers[a, q]))
    jobs.sort(key=lambda j: (j[0], j[1], j[2], repr(j[3])))
    sims: list[list] = []
    free: list[tuple[int, int]] = []  # (the end of its last job, simulation index)
    left: list[State] = []  # per simulation, the state its last job leaves
    ends: list[int] = []  # per simulation, where its last job ends
    pool: dict[State, list[int]] = {}  # simulations free at `cur`, by their state there
    cur = 0
    for a, b, o, q, fill in jobs:
        if a > cur:  # (keep regions over the gaps since: `_simulate`)
            moved: dict[State, list[int]] = {}
            for st, ks in pool.items():
                moved.setdefault(_kept_to(table, st, cur, a), []).extend(ks)
            while free and free[0][0] <= a:
                end, k = heapq.heappop(free)
                moved.setdefault(_kept_to(table, left[k], end, a), []).append(k)
            pool, cur = moved, a
        ks = pool.get(q)
        k = None
        if ks:  # one whose jobs so far leave this job's state: no regions before it
            k, fill = ks.pop(), []
        elif fill:  # else one free where the filler starts, in the state it expects
            k = _free_at(table, pool, ends, left, fill[0][0], kept)
        if k is None:
            k = len(sims)
            sims.append([])
            left.append(None)
            ends.append(0)
        sims[k].append(((a, b, o, q), fill))
        left[k], ends[k] = table.leave(a, b, o, q), b
        heapq.heappush(free, (b, k))
    for placed in sims:
        _simulate(table, graph, placed)


def _simulate(table: ChainTable, graph: CostGraph, placed: list) -> None:
    pts, names = table.points, graph.compute_nodes
    items: list[tuple[int, int, str, frozenset[str], object]] = []
    for job, fill in placed:
        a, b, o, _ = job
        for s, e, fo in fill:
            items.append((s, e, *table.options[s, e][fo], None))
        items.append((a, b, *table.options[a, b][o], job))
    items.sort(key=lambda x: x[0])
    regions, jobs_at = [], {}
    at = 0
    index = table.index

    def kept(upto: int) -> None:  # one keep region per gap between boundaries, as the DP
        # composes them (who owns a storage is the regions' accounting: `RegionCost`)
        j = index[at]
        while pts[j] < upto:
            regions.append(Region(KEEP, tuple(names[pts[j]:pts[j + 1]])))
            j += 1

    for a, b, p, save, job in items:
        kept(pts[a])
        if job is not None:
            jobs_at[job] = len(regions)
        regions.append(Region(p, tuple(names[pts[a]:pts[b]]), save))
        at = pts[b]
    kept(table.n)
    table.simulations += 1
    schedule = Schedule(regions, fingerprint=graph.fingerprint)
    _, costs = region_costs(graph, schedule, timeline=False, last_owned=table.tracked)
    last = len(pts) - 1
    before = [True]  # (whether every region before each was separable)
    for c in costs:
        before.append(before[-1] and c.separable)
    for job, j in jobs_at.items():
        c = costs[j]
        table.entries[job] = Entry(
            c.local_peak_bytes, c.held_bytes, c.recompute_s,
            costs[-1].local_peak_bytes if job[1] == last else 0, before[j + 1])
