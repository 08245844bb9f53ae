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

__all__ = ["Entry", "measure", "pack"]


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


def _fillers(table: ChainTable, kept: list[frozenset[int]]
             ) -> dict[tuple[int, State], list[tuple[int, int, int]]]:
    """Per boundary ``a`` and state ``q`` there: regions (boundary, boundary, option) ending
    at ``a`` that leave ``q`` after keep regions over single gaps before them (what
    `_simulate` puts there), the ones starting latest. One pass over the transitions: the
    latest start reaching a state is the latest of its predecessors' (a predecessor in the
    state keep regions leave it starts there itself); ties go to the first found."""
    # best[j][q]: (start, i, o, the state at i, whether the path starts at i)
    best: list[dict[State, tuple[int, int, int, State, bool]]] = [{}]
    for j in range(1, len(table.points)):
        here: dict[State, tuple[int, int, int, State, bool]] = {}
        for i, o in table.ends[j]:
            start_q = None if i == 0 else (KEEP, kept[i])
            for q in table.states[i]:
                if q == start_q:
                    cand = (i, i, o, q, True)
                elif q in best[i]:
                    cand = (best[i][q][0], i, o, q, False)
                else:
                    continue
                st = table.leave(i, j, o, q)
                if st not in here or here[st][0] < cand[0]:
                    here[st] = cand
        best.append(here)
    out: dict[tuple[int, State], list[tuple[int, int, int]]] = {}
    for a in range(1, len(table.points)):
        for q in table.states[a]:
            path, j, st = [], a, q
            while True:
                if st not in best[j]:
                    raise AssertionError(f"no path leaves state {q} at boundary {a}")
                _, i, o, prev, first = best[j][st]
                path.append((i, j, o))
                if first:
                    break
                j, st = i, prev
            out[a, q] = path[::-1]
    return out


def pack(table: ChainTable) -> list[list]:
    """The simulations that measure every entry of ``table`` (`measure` runs them), as few
    as the jobs' overlap allows: each job (a region
    option after an entry state) is an interval of boundaries. Taken by start, a job goes
    into a simulation whose jobs so far leave its state where it starts (with keep regions
    over the gaps since), with nothing before it; else into one free where the regions
    that lead to its state (`_fillers`) start, in the state they expect there; else into a
    new one. Jobs of one simulation do not disturb each other where the composition is
    exact, which is what ``table.exact`` checks."""
    kept = _kept_held(table)
    fillers = _fillers(table, kept)
    jobs = []
    for (a, b), opts in sorted(table.options.items()):
        for o in range(len(opts)):
            for q in table.states[a]:
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
    return sims


def measure(table: ChainTable, graph: CostGraph, sims: list[list]) -> None:
    """Every entry of ``table`` (``table.entries``), from the simulations `pack` planned."""
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
