"""What every region of the block DP's space costs, from a few simulations (`BlockTable`).

The space (`blockdp`): regions start and end at stage boundaries (`blocks.find_blocks`); a
region is one stage kept, or a run of at most ``max_span`` stages recomputed; at save level k
a recompute region saves, in each of its stages, its kind's k slowest allocating node
positions (by the kind's median time; all it has when fewer), k from 0 to ``save_top``. As
in `dp`, an entry is a region's local peak ``L``, the bytes ``H`` it holds while
later regions run, its recompute time ``T``, the loss region's local peak when it is the last
region, and whether all of them were separable, for each state the region before it leaves
(`dp.ENTRY_STATES`).

**Time** is exact per position: a region's recompute time is its own (`simulate` adds no term
that depends on other regions), and it is the sum over its stages, each counted in full but
the last, which is replayed only up to its last saver and carries the checkpoint call. Three
simulations per save level give every stage's time as a one-stage region (``one``) and as the
first of a two-stage region (``pair``): ``full = pair - one(next)``.

**Memory** is shifted from two positions. Stages of one kind are identical, so a region over
a run of stages with one sequence of kinds, one option and one entry state differs from
another position with the same sequence only by
the gradients the later stages' backward left alive when its own backward starts: a
schedule-independent ``G(b)`` of the point ``b`` where it ends (`gradient_steps`, summed). Its
forward local peak ``F`` and backward one ``B`` are the same everywhere, so ``L = max(F, B +
G(b))``. The table measures ``L`` at the positions with the least and the most ``G`` (and at
the end of the graph, where the loss region's peak also counts) and reads ``F`` and ``B`` off
the two (`_Line`); every position between is then exact. ``H`` must agree at both positions.
Where a measurement breaks this (two L that no ``max(F, B + G)`` gives, or H differing), the
entry is marked inexact, and the DP claims nothing for schedules that use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from statistics import median

from ..cost.simulate import gradient_steps, region_costs, storage_readers
from ..ir.graph import CostGraph
from ..ir.replays import recompute_limits
from ..ir.schedule import KEEP, RECOMPUTE, Region, Schedule
from .blocks import Blocks
from .deadline import check
from .dp import ENTRY_STATES, POLICIES

__all__ = ["INNER_SPANS", "BlockTable", "Entry", "TooLarge", "build_schedule"]

#: with ``nested``: the sizes (in stages) of the inner recompute regions a recompute region of
#: more stages may hold (the rest of it, at its end, an inner keep region)
INNER_SPANS = (1, 2, 3, 4, 6, 8)

#: an option: (policy, save set, inner regions as (first stage, stop stage, policy) relative
#: to the region's first stage; () for a flat region)
Option = tuple[str, frozenset[str], tuple[tuple[int, int, str], ...]]


def build_schedule(graph: CostGraph, items: list[tuple], *, check: bool = True,
                   names: list[str] | None = None, **info: object) -> Schedule:
    """A schedule from ``(start, stop, policy[, save[, inner]])`` items over
    ``graph.compute_nodes`` (``names``, where the caller has them), ``inner`` as ``(start,
    stop, policy)`` spans; validated unless ``check`` is False (the table's own schedules,
    which `region_costs` validates)."""
    names = graph.compute_nodes if names is None else names
    regions = []
    for start, stop, p, *rest in items:
        save = rest[0] if rest else ()
        inner = tuple(Region(q, tuple(names[x:y])) for x, y, q in
                      (rest[1] if len(rest) > 1 else ()))
        regions.append(Region(p, tuple(names[start:stop]), frozenset(save), inner=inner))
    schedule = Schedule(regions, fingerprint=graph.fingerprint, **info)  # type: ignore[arg-type]
    if check:
        schedule.validate(graph)
    return schedule


CACHED = ENTRY_STATES[2]


class TooLarge(ValueError):
    """A `BlockTable` would run more simulations than it was allowed (``max_simulations``);
    ``planned`` says how many. Raised before any simulation runs."""

    def __init__(self, planned: int, most: int):
        super().__init__(f"the block table needs about {planned} simulations, more than the "
                         f"{most} allowed")
        self.planned = planned


@dataclass(frozen=True)
class Entry:
    """One region's costs (see the module docstring)."""

    local: int
    held: int
    time_s: float
    tail_local: int
    exact: bool


@dataclass(frozen=True)
class _Line:
    """``L(G) = max(f, b + G)`` read off two measurements ``(G1, L1)``, ``(G2, L2)``."""

    f: float
    b: float
    ok: bool

    @classmethod
    def through(cls, g1: int, l1: int, g2: int, l2: int) -> _Line:
        if g1 > g2:
            g1, l1, g2, l2 = g2, l2, g1, l1
        if l2 == l1:  # the forward peak rules at both (and between)
            return cls(l1, float("-inf"), True)
        if l2 - l1 == g2 - g1:  # the backward peak rules at both
            return cls(float("-inf"), l1 - g1, True)
        if l1 < l2 < l1 + (g2 - g1):  # forward at G1, backward at G2
            return cls(l1, l2 - g2, True)
        return cls(max(l1, l2), float("-inf"), False)

    def at(self, g: int) -> int:
        return int(max(self.f, self.b + g))


class BlockTable:
    """Entries of every region of the space over ``blocks``' stages; ``options[a, m]`` lists
    the (policy, save set) of regions over stages ``a .. a+m-1``, ``entries[a, m, o, q]``
    their costs after state ``q`` (None for the first stage). ``simulations`` counts the
    simulations it ran. It keeps no reference to the graph."""

    def __init__(self, graph: CostGraph, blocks: Blocks, *, max_span: int, save_top: int,
                 nested: bool = False, mixed: bool = False, max_simulations: int | None = None):
        """``max_simulations``: raise `TooLarge` before simulating anything when the table
        would take more (counted from the stages, not timed)."""
        names = graph.compute_nodes
        self._names = names
        self.stages = blocks.stages
        self.points = blocks.points
        self.max_span = max_span
        self.simulations = 0
        S = len(self.stages)
        kinds = [s.kind for s in self.stages]
        tops = _save_positions(graph, blocks, save_top)
        self.levels = [len(tops[k]) for k in kinds]
        self.crossing = _crossing_producers(graph, self.points)
        self.options: dict[tuple[int, int], list[Option]] = {}
        limits = recompute_limits(graph)
        for a in range(S):
            for m in range(1, min(max_span, S - a) + 1):
                if not mixed and len(set(kinds[a:a + m])) > 1:
                    break  # (runs of mixed kinds: more measurements; needed with `fine`)
                if m > 1 and self.points[a + m] > limits[self.points[a]]:
                    break  # (refused, as every longer run: across a unit's calls, `replays`)
                recs: list[Option] = [(RECOMPUTE, self._save(names, tops, a, a + m, k), ())
                                      for k in range(max(self.levels[a:a + m]) + 1)]
                if nested:
                    recs += [(RECOMPUTE, frozenset(), _inner(m, r)) for r in INNER_SPANS
                             if r < m]
                self.options[a, m] = ([(KEEP, frozenset(), ())] if m == 1 else []) + recs
        #: (a, m, o) of the options the rewriter would refuse (`ir.replays`): measured like the
        #: rest (the table's entries share measurements), never chosen (`blockdp`)
        self.refused = {(a, m, o) for (a, m), opts in self.options.items()
                        for o in range(len(opts)) if not _rewritable(limits, self.spans(a, m, o))}
        self.states = {a: (None,) if a == 0 else POLICIES + (
            (CACHED,) if any(self.crossing[a] in o[1] for o in self.options[a - 1, 1]) else ())
            for a in range(S)}
        g = _gradients_before(graph, self.points)
        self.entries: dict[tuple[int, int, int, str | None], Entry] = {}
        groups: dict[tuple, list[int]] = {}
        for (a, m), opts in self.options.items():
            for o in range(len(opts)):
                for q in self.states[a]:
                    groups.setdefault((tuple(kinds[a:a + m]), o, q, a == 0), []).append(a)
        ends = {key: _ends(starts, len(key[0]), g) for key, starts in groups.items()}
        if max_simulations is not None:
            # (the times' 3 per save level, and at most the two ends of each group and the
            # starts that end the graph)
            planned = 3 * (max(self.levels) + 1) + sum(
                len({lo, hi} | {a for a in starts if a + len(key[0]) == S})
                for (key, starts), (lo, hi) in zip(groups.items(), ends.values()))
            if planned > max_simulations:
                raise TooLarge(planned, max_simulations)
        one, full = self._times(graph, tops)
        for key, starts in groups.items():
            run, o, q, _ = key
            m = len(run)
            lo, hi = ends[key]
            measured = self._measure_pair(graph, hi, lo, m, o, q)
            for a in {lo, hi} | {a for a in starts if a + m == S}:
                if a not in measured:
                    measured[a] = self._measure(graph, a, m, o, q)
            (l1, h1, _, e1, _), (l2, h2, _, e2, _) = measured[lo], measured[hi]
            line = _Line.through(g[lo + m], l1, g[hi + m], l2)
            if not (line.ok and h1 == h2):  # (a pair's one simulation splits the stages
                # between otherwise than the DP does: measured apart, as every other start is)
                measured.update({a: self._measure(graph, a, m, o, q) for a in (lo, hi)})
                (l1, h1, _, e1, _), (l2, h2, _, e2, _) = measured[lo], measured[hi]
                line = _Line.through(g[lo + m], l1, g[hi + m], l2)
            exact = e1 and e2 and line.ok and h1 == h2
            keep = self.options[starts[0], m][o][0] == KEEP
            nest = bool(self.options[starts[0], m][o][2])
            k = 0 if nest else o - 1 if m == 1 else o  # the save level
            for a in starts:
                # a nested region's time: measured at ``lo``, shifted by the flat region's
                # difference (exact where the stages' times are equal; `blockdp` checks)
                t = 0.0 if keep else _flat(one, full, k, a, m)
                if nest:
                    t = measured[lo][4] + t - _flat(one, full, k, lo, m)
                if a in measured:
                    local, held, tail, ex, t_meas = measured[a]
                    t = t_meas if nest else t
                    self.entries[a, m, o, q] = Entry(local, held, t, tail, ex and exact)
                else:
                    self.entries[a, m, o, q] = Entry(line.at(g[a + m]), max(h1, h2), t, 0,
                                                     exact)

    def leaves(self, a: int, m: int, o: int) -> str:
        """The state a region over stages ``a .. a+m-1`` with option ``o`` leaves."""
        p, save, _ = self.options[a, m][o]
        if p == RECOMPUTE and self.crossing[a + m] in save:
            return CACHED
        return p

    def spans(self, a: int, m: int, o: int) -> tuple:
        """The region as a `build_schedule` item: (start, stop, policy, save, inner)."""
        p, save, inner = self.options[a, m][o]
        pts = self.points
        return (pts[a], pts[a + m], p, save,
                tuple((pts[a + x], pts[a + y], q) for x, y, q in inner))

    def _save(self, names: list[str], tops: dict[int, list[int]], a: int, b: int, k: int
              ) -> frozenset[str]:
        """The save set at level ``k`` of a region over stages ``a .. b-1``: in each stage,
        its kind's ``k`` slowest positions (all it has, when fewer)."""
        return frozenset(names[self.stages[s].start + off] for s in range(a, b)
                         for off in tops[self.stages[s].kind][:k])

    def _run(self, graph: CostGraph, spans: list[tuple]) -> list:
        check("the block table")  # (thousands of simulations: a solve's shared deadline)
        self.simulations += 1
        # (validated once, by region_costs: a simulation is a few ms, and checking the
        # graph's fingerprint and node list twice was a fifth of it)
        return region_costs(graph, build_schedule(graph, spans, check=False,
                                                  names=self._names), timeline=False)[1]

    def _measure(self, graph: CostGraph, a: int, m: int, o: int, q: str | None
                 ) -> tuple[int, int, int, bool, float]:
        """(local, held, tail local, separable, time) of the region, measured with the simulator:
        before it one region leaving ``q``, after it everything kept (as `dp` does)."""
        n = len(graph.compute_nodes)
        item = self.spans(a, m, o)
        start, stop = item[0], item[1]
        spans: list[tuple] = []
        if start > 0:
            spans.append((0, start, RECOMPUTE, {self.crossing[a]}) if q == CACHED
                         else (0, start, q))
        spans.append(item)
        if stop < n:
            spans.append((stop, n, KEEP))
        return _read(self._run(graph, spans), 1 if start > 0 else 0)

    def _measure_pair(self, graph: CostGraph, hi: int, lo: int, m: int, o: int,
                      q: str | None) -> dict[int, tuple[int, int, int, bool, float]]:
        """`_measure` of the region at ``hi`` and at ``lo`` in one simulation, when a stage
        at least lies between them (a region leaving ``q`` fills the gap; what follows a
        region is kept, or recomputed from its output on, which holds that output as long);
        else nothing."""
        if hi + m >= lo or q is None:
            return {}
        n = len(graph.compute_nodes)
        pts = self.points

        def before(x: int, y: int) -> tuple:
            return (x, y, RECOMPUTE, {self.crossing[lo]}) if q == CACHED and y == pts[lo] \
                else (x, y, RECOMPUTE, {self.crossing[hi]}) if q == CACHED else (x, y, q)

        spans = ([before(0, pts[hi])] if hi > 0 else []) + [self.spans(hi, m, o)]
        j_hi = len(spans) - 1
        spans += [before(pts[hi + m], pts[lo]), self.spans(lo, m, o)]
        j_lo = len(spans) - 1
        if pts[lo + m] < n:
            spans.append((pts[lo + m], n, KEEP))
        costs = self._run(graph, spans)
        return {hi: _read(costs, j_hi), lo: _read(costs, j_lo)}

    def _times(self, graph: CostGraph, tops: dict[int, list[int]]
               ) -> tuple[list[list[float]], list[list[float]]]:
        """Per save level k-1 (index) and stage: its recompute time as a one-stage region
        (``one``) and as a stage replayed in full before another (``full``)."""
        names = graph.compute_nodes
        S = len(self.stages)
        one, full = [], []

        def region(s: int, stop: int, k: int) -> tuple:
            return (self.points[s], self.points[stop], RECOMPUTE,
                    self._save(names, tops, s, stop, k))

        for k in range(max(self.levels) + 1):
            costs = self._run(graph, [region(s, s + 1, k) for s in range(S)])
            o = [c.recompute_s for c in costs[:S]]
            pair = [0.0] * S
            for r in (0, 1):
                spans, firsts = [], []
                s = 0
                while s < S:
                    if (s - r) % 2 == 0 and s + 1 < S:
                        firsts.append((len(spans), s))
                        spans.append(region(s, s + 2, k))
                        s += 2
                    else:
                        spans.append((self.points[s], self.points[s + 1], KEEP))
                        s += 1
                costs = self._run(graph, spans)
                for i, s0 in firsts:
                    pair[s0] = costs[i].recompute_s
            one.append(o)
            full.append([pair[s] - o[s + 1] if s + 1 < S else 0.0 for s in range(S)])
        return one, full


def _read(costs: list, j: int) -> tuple[int, int, int, bool, float]:
    """(local, held, tail local, separable, time) of region ``j`` of a simulation's costs."""
    c = costs[j]
    return (c.local_peak_bytes, c.held_bytes, costs[-1].local_peak_bytes,
            c.separable and all(x.separable for x in costs[:j]), c.recompute_s)


def _save_positions(graph: CostGraph, blocks: Blocks, save_top: int) -> dict[int, list[int]]:
    """Per kind: offsets within its stages of its ``save_top`` slowest allocating nodes, by
    the kind's median time (ties by position)."""
    names = graph.compute_nodes
    members: dict[int, list[int]] = {}
    for s in blocks.stages:
        members.setdefault(s.kind, []).append(s.start)
    out = {}
    for kind, starts in members.items():
        width = next(s.stop - s.start for s in blocks.stages if s.kind == kind)
        ranked = sorted((-median(graph.node(names[a + off]).time_s for a in starts), off)
                        for off in range(width) if graph.allocates(names[starts[0] + off]))
        out[kind] = [off for _, off in ranked[:save_top]]
    return out


def _crossing_producers(graph: CostGraph, points: list[int]) -> list[str | None]:
    """Per point: the producer of the activation crossing it (None at the ends or when none
    does)."""
    names = graph.compute_nodes
    n = len(names)
    idx = {x: i for i, x in enumerate(names)}
    readers = storage_readers(graph)
    out: list[str | None] = [None] * len(points)
    for sid, st in graph.storages.items():
        p = idx.get(st.producer, n)
        last = max((idx.get(r, n) for r in (*st.savers, *readers[sid])), default=p)
        for i, c in enumerate(points):
            if 0 < c < n and p < c <= last:
                out[i] = st.producer
    return out


def _gradients_before(graph: CostGraph, points: list[int]) -> list[int]:
    """Per point b: the net bytes that the backward steps before the first backward step of a
    node before b leave alive (`gradient_steps`): what the stages from b on leave to the
    region ending at b when its backward starts. Schedule-independent."""
    idx = {x: i for i, x in enumerate(graph.compute_nodes)}
    n = len(idx)
    steps = gradient_steps(graph)
    net = [0, *accumulate(s[2] for s in steps)]
    first: dict[int, int] = {}  # point index -> first step of a node before it
    for i, (node, _, _) in enumerate(steps):
        p = idx.get(node or "", n)
        for j, b in enumerate(points):
            if p < b and j not in first:
                first[j] = i
    return [net[first.get(j, len(steps))] for j in range(len(points))]


def _ends(starts: list[int], m: int, g: list[int]) -> tuple[int, int]:
    """The starts of a group with the least and the most gradient bytes after it (``lo``,
    ``hi``): where its regions are measured."""
    return (min(starts, key=lambda a: (g[a + m], a)), max(starts, key=lambda a: (g[a + m], a)))


def _flat(one: list[list[float]], full: list[list[float]], k: int, a: int, m: int) -> float:
    """The recompute time of a flat region over stages ``a .. a+m-1`` at save level k."""
    return sum(full[k][a:a + m - 1]) + one[k][a + m - 1]


def _inner(m: int, r: int) -> tuple[tuple[int, int, str], ...]:
    """Inner regions of a region of ``m`` stages: recompute regions of ``r`` stages, then the
    rest (``r`` stages or fewer, at least one) kept."""
    spans = [(x, min(x + r, m)) for x in range(0, m, r)]
    return tuple((x, y, RECOMPUTE if y < m else KEEP) for x, y in spans)


def _rewritable(limits: tuple[int, ...], item: tuple) -> bool:
    """Whether the rewriter runs a `BlockTable.spans` item's recompute regions
    (`replays.recompute_limits`)."""
    start, stop, p, _, inner = item
    return p != RECOMPUTE or stop <= limits[start] and all(
        y <= limits[x] for x, y, q in inner if q == RECOMPUTE)
