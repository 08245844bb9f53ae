"""The region table of `chain`: every region option of the unit calls, after every entry
state, measured with the simulator (`ChainTable`), between the boundaries `chaincuts`
finds; see `chain` for the space and why its entries compose exactly.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass
from statistics import median

from ..cost.simulate import region_costs
from ..ir.graph import CostGraph
from ..ir.replays import recompute_limits, unit_calls
from ..ir.schedule import KEEP, RECOMPUTE, Region, Schedule
from .base import graph_cache
from .blocks import graph_layout, stage_signature
from .chaincuts import (chained, positions_of, saver_positions, shared_inputs,
                        spans_anchor, unit_cuts)
from .config import SolverConfig

__all__ = ["ChainTable", "Entry", "State", "applies", "table_of", "unit_cuts"]

#: an entry state: the policy of the region before a boundary (None before the first
#: region); no option caches what crosses its end, so the policy says all
State = str | None
#: a region option: (policy, save set)
Option = tuple[str, frozenset[str]]


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


def applies(graph: CostGraph) -> bool:
    """Whether ``chain`` solves ``graph``: it has units, called at least once."""
    return bool(graph.units) and bool(unit_calls(graph))


class ChainTable:
    """The space's boundaries (``points``), its region options (``options[a, b]`` for
    boundary indices ``a < b``) and their costs after each entry state (``entries[a, b, o,
    q]``), measured with the simulator; ``kinds``: per call, its kind; ``simulations``: how
    many were run. It keeps no reference to the graph."""

    def __init__(self, graph: CostGraph, *, save_top: int = SolverConfig.save_top):
        names = graph.compute_nodes
        n = len(names)
        self.n = n
        self.save_top = save_top
        self.simulations = 0
        calls = unit_calls(graph)
        self.calls = [(a, b) for _, a, b in calls]
        inside = {i for a, b in self.calls for i in range(a, b)}
        fixed = frozenset(names[i] for i in range(n) if i not in inside)
        at = graph_layout(graph)
        sigs = [(b - a, stage_signature(graph, a, b, fixed, layout=at)) for a, b in self.calls]
        kind_of: dict[tuple, int] = {}
        self.kinds = [kind_of.setdefault(s, len(kind_of)) for s in sigs]
        members: dict[int, list[int]] = defaultdict(list)
        for i, k in enumerate(self.kinds):
            members[k].append(i)
        # per kind: its cuts (relative), held by every call of the kind
        rel_cuts: dict[int, list[int]] = {}
        for k, calls_k in members.items():
            sets = [set(unit_cuts(graph, *self.calls[i])) for i in calls_k]
            rel_cuts[k] = sorted(set.intersection(*sets))
            # (a cut some call lacks may leave another's storage crossing two: `chained`
            # then says so, and nothing is claimed)
        pts = {0, n}
        for i, (a, b) in enumerate(self.calls):
            pts.update({a, b, *(a + c for c in rel_cuts[self.kinds[i]])})
        self.points = sorted(pts)
        at = {p: j for j, p in enumerate(self.points)}
        limits = recompute_limits(graph)
        _, pos = positions_of(graph)
        # spans: (a, b) boundary indices -> options; `owner[a, b]`: (call index or None)
        self.options: dict[tuple[int, int], list[Option]] = {}
        self.owner: dict[tuple[int, int], int | None] = {}
        self.kind_spans: dict[tuple[int, int], tuple[int, int, int]] = {}
        call_at = 0
        for ci, (a, b) in enumerate(self.calls):
            if a > call_at:  # the model's own code before the call: kept
                self.options[at[call_at], at[a]] = [(KEEP, frozenset())]
                self.owner[at[call_at], at[a]] = None
            call_at = b
            k = self.kinds[ci]
            inner = [j for j in range(at[a], at[b] + 1)]
            made = {sid: pu for sid, pu in pos.items() if a <= pu[0] < b}  # (made here)
            for x in range(len(inner)):
                for y in range(x + 1, len(inner)):
                    ja, jb = inner[x], inner[y]
                    pa, pb = self.points[ja], self.points[jb]
                    opts: list[Option] = [(KEEP, frozenset())] if y == x + 1 else []
                    if pb <= limits[pa] and not spans_anchor(
                            made, pa, pb, self.points[ja + 1:jb]):
                        opts += [(RECOMPUTE, frozenset(names[a + off] for off in offs))
                                 for offs in _save_sets(graph, [self.calls[i] for i in
                                                                members[k]],
                                                        pa - a, pb - a, save_top)]
                    if opts:
                        self.options[ja, jb] = opts
                        self.owner[ja, jb] = ci
                        self.kind_spans[ja, jb] = (k, pa - a, pb - a)
        if call_at < n:
            self.options[at[call_at], at[n]] = [(KEEP, frozenset())]
            self.owner[at[call_at], at[n]] = None
        # the producers whose storages cross each boundary
        crossers: dict[int, frozenset[str]] = {}
        for j, c in enumerate(self.points):
            crossers[j] = frozenset(
                graph.storages[sid].producer for sid, (p, uses) in pos.items()
                if p < c <= (uses[-1] if uses else -1)) if 0 < c < n else frozenset()
        # the composition is exact where what crosses a boundary is made by the region just
        # before it or is a secured anchor (`chained`)
        self.chained = chained(self.points, pos, shared_inputs(graph),
                               saver_positions(graph))
        # no recompute region caches what crosses its end: whether it then holds it depends
        # on the next region's policy, which no entry state says (random paths through the
        # 2-layer Llama's table composed 512 bytes below `simulate` with those options)
        for (ja, jb), opts in list(self.options.items()):
            self.options[ja, jb] = [(p, save) for p, save in opts
                                    if p == KEEP or not save & crossers[jb]]
        self.ends: dict[int, list[tuple[int, int]]] = defaultdict(list)  # b -> [(a, o)]
        self.starts: dict[int, list[int]] = defaultdict(list)  # a -> [b]
        for (a, b), opts in sorted(self.options.items()):
            self.starts[a].append(b)
            for o in range(len(opts)):
                self.ends[b].append((a, o))
        self.states: dict[int, list[State]] = {0: [None]}
        for j in range(1, len(self.points)):
            seen: dict[State, None] = {}
            for a, o in self.ends[j]:
                seen[self.leaves(self.options[a, j][o])] = None
            self.states[j] = list(seen)
        self.entries: dict[tuple[int, int, int, State], Entry] = {}
        self._measure_all(graph)

    @staticmethod
    def leaves(option: Option) -> State:
        """The state a region with ``option`` leaves for the next one: its policy (what
        crosses its end is kept or dropped with it; none is cached, see above)."""
        return option[0]

    @property
    def exact(self) -> bool:
        """Whether the composition is exact: what crosses each boundary is made just before
        it or is a secured anchor (`chained`), and every entry was separable where it was
        measured."""
        return self.chained and all(e.exact for e in self.entries.values())

    def spans(self) -> list[tuple[int, int]]:
        return sorted(self.options)

    # -- measurement ------------------------------------------------------------------------
    def _filler(self, a: int, q: State) -> tuple[int, int] | None:
        """A region (start boundary, option) ending at boundary ``a`` that leaves ``q``: the
        one starting latest, then the first option."""
        best = None
        for s, o in self.ends[a]:
            if self.leaves(self.options[s, a][o]) == q and (best is None or s > best[0]):
                best = (s, o)
        return best

    def _measure_all(self, graph: CostGraph) -> None:
        """Every entry, in as few simulations as do not overlap: each job (a region option
        after an entry state, with the region before that leaves the state) is an interval
        of positions; intervals are packed into simulations by the classic partition (by
        start, each into the simulation free soonest), as many as the deepest overlap.
        Jobs of one simulation do not disturb each other where the composition is exact,
        which is what `exact` checks."""
        jobs = []
        for (a, b), opts in sorted(self.options.items()):
            for o in range(len(opts)):
                for q in self.states[a]:
                    fill = None if q is None else self._filler(a, q)
                    jobs.append((a if fill is None else fill[0], b, o, a, q, fill))
        jobs.sort(key=lambda j: (j[0], j[1], j[2], j[3], repr(j[4])))
        sims: list[list] = []
        free: list[tuple[int, int]] = []  # (the end of its last job, simulation index)
        for lo, b, o, a, q, fill in jobs:
            if free and free[0][0] <= lo:
                _, k = heapq.heappop(free)
            else:
                k = len(sims)
                sims.append([])
            sims[k].append(((a, b, o, q), fill))
            heapq.heappush(free, (b, k))
        for placed in sims:
            self._simulate(graph, placed)

    def _simulate(self, graph: CostGraph, placed: list) -> None:
        pts, names = self.points, graph.compute_nodes
        items: list[tuple[int, int, str, frozenset[str], object]] = []
        for job, fill in placed:
            a, b, o, _ = job
            if fill is not None:
                s, fo = fill
                items.append((s, a, *self.options[s, a][fo], None))
            items.append((a, b, *self.options[a, b][o], job))
        items.sort(key=lambda x: x[0])
        regions, jobs_at = [], {}
        at = 0
        def kept(upto: int) -> None:  # one keep region per gap between boundaries, as the DP
            # composes them (who owns a storage is the regions' accounting: `RegionCost`)
            j = pts.index(at)
            while pts[j] < upto:
                regions.append(Region(KEEP, tuple(names[pts[j]:pts[j + 1]])))
                j += 1

        for a, b, p, save, job in items:
            kept(pts[a])
            if job is not None:
                jobs_at[job] = len(regions)
            regions.append(Region(p, tuple(names[pts[a]:pts[b]]), save))
            at = pts[b]
        kept(self.n)
        self.simulations += 1
        schedule = Schedule(regions, fingerprint=graph.fingerprint)
        _, costs = region_costs(graph, schedule, timeline=False)
        last = len(pts) - 1
        for job, j in jobs_at.items():
            c = costs[j]
            self.entries[job] = Entry(
                c.local_peak_bytes, c.held_bytes, c.recompute_s,
                costs[-1].local_peak_bytes if job[1] == last else 0,
                c.separable and all(x.separable for x in costs[:j]))


def _save_sets(graph: CostGraph, calls: list[tuple[int, int]], x: int, y: int,
               top: int) -> list[tuple[int, ...]]:
    """Save sets of a recompute region over relative positions ``[x, y)`` of a kind's calls,
    as positions relative to a call's start: none, its slowest allocating node, ..., its
    ``top`` slowest, by the kind's median time (ties by position)."""
    times = _kind_times(graph, calls)
    ranked = sorted((-times[off], off) for off in range(x, y) if times[off] is not None)
    offs = [off for _, off in ranked[:top]]
    return [tuple(offs[:k]) for k in range(len(offs) + 1)]


def _kind_times(graph: CostGraph, calls: list[tuple[int, int]]) -> list[float | None]:
    """Per position relative to a call's start: the median time over ``calls`` of the node
    there, None where the node allocates nothing (no save set holds it); once per kind
    (`base.graph_cache`)."""
    cache = graph_cache(graph, "chain kind times")
    key = tuple(calls)
    if key not in cache:
        names = graph.compute_nodes
        a0, b0 = calls[0]
        cache[key] = [median(graph.node(names[a + off]).time_s for a, _ in calls)
                      if graph.allocates(names[a0 + off]) else None
                      for off in range(b0 - a0)]
    return cache[key]


def table_of(graph: CostGraph, *, save_top: int = SolverConfig.save_top) -> ChainTable:
    """The chain table of ``graph`` (cached beside it, `base.graph_cache`)."""
    cache = graph_cache(graph, "chain tables")
    if save_top not in cache:
        cache[save_top] = ChainTable(graph, save_top=save_top)
    return cache[save_top]
