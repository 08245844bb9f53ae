"""The region table of `chain`: every region option of the unit calls, after every entry
state, measured with the simulator (`ChainTable`), between the boundaries `chaincuts`
finds; see `chain` for the space and why its entries compose exactly.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from itertools import accumulate
from statistics import median

from ..cost.simulate import storage_readers
from ..ir.graph import CostGraph
from ..ir.replays import recompute_limits, unit_calls
from ..ir.schedule import KEEP, RECOMPUTE
from .base import graph_cache
from .blocks import graph_layout, stage_signature
from .chaincuts import (MAX_TRACKED, positions_of, saver_positions, shared_inputs,
                        spans_anchor, tracked_anchors, unit_cuts)
from . import chainpack
from .chainpack import Entry
from .config import SolverConfig

__all__ = ["ChainTable", "Entry", "State", "TableTooLarge", "applies", "table_of", "unit_cuts"]

#: an entry state: the policy of the region before a boundary (no option caches what crosses
#: its end, so the policy says all of that) and the tracked anchors crossing it that a region
#: before holds (`chaincuts.tracked_anchors`); None before the first region
State = tuple[str, frozenset[int]] | None
#: a region option: (policy, save set)
Option = tuple[str, frozenset[str]]


def applies(graph: CostGraph) -> bool:
    """Whether ``chain`` solves ``graph``: it has units, called at least once."""
    return bool(graph.units) and bool(unit_calls(graph))


class TableTooLarge(Exception):
    """A `ChainTable` would take more simulations than it was allowed."""


class ChainTable:
    """The space's boundaries (``points``), its region options (``options[a, b]`` for
    boundary indices ``a < b``) and their costs after each entry state (``entries[a, b, o,
    q]``), measured with the simulator; ``kinds``: per call, its kind; ``simulations``: how
    many were run; ``planned``: how many measuring it takes. It keeps no reference to the
    graph.

    With ``measured=False`` the constructor plans the simulations and runs none (`measure`
    does); with ``most_simulations``, it raises `TableTooLarge` as soon as the table is
    known to need more (its options alone, before its states and plan, where they do: a
    simulation holds one option per gap between boundaries)."""

    def __init__(self, graph: CostGraph, *, save_top: int = SolverConfig.save_top,
                 tracked: int = 0, measured: bool = True,
                 most_simulations: int | None = None):
        if not 0 <= tracked <= MAX_TRACKED:
            raise ValueError(f"chain_tracked={tracked!r}: the tracked anchors a unit cut may "
                             f"have crossing it are 0 to {MAX_TRACKED}")
        names = graph.compute_nodes
        n = len(names)
        self.n = n
        self.save_top = save_top
        self.tracked_cuts = tracked
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
            sets = [set(unit_cuts(graph, *self.calls[i], tracked)) for i in calls_k]
            rel_cuts[k] = sorted(set.intersection(*sets))
            # (a cut some call lacks may leave another's storage crossing two: it is then
            # tracked, or, past `MAX_TRACKED` at one boundary, nothing is claimed)
        pts = {0, n}
        for i, (a, b) in enumerate(self.calls):
            pts.update({a, b, *(a + c for c in rel_cuts[self.kinds[i]])})
        self.points = sorted(pts)
        at = self.index = {p: j for j, p in enumerate(self.points)}
        limits = recompute_limits(graph)
        _, pos = positions_of(graph)
        # spans: (a, b) boundary indices -> options; `owner[a, b]`: (call index or None)
        self.options: dict[tuple[int, int], list[Option]] = {}
        self.owner: dict[tuple[int, int], int | None] = {}
        self.kind_spans: dict[tuple[int, int], tuple[int, int, int]] = {}
        call_at = 0
        sets_of: dict[tuple[int, int, int], list[tuple[int, ...]]] = {}
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
                        if (k, pa - a, pb - a) not in sets_of:  # (the same for the kind)
                            sets_of[k, pa - a, pb - a] = _save_sets(
                                graph, [self.calls[i] for i in members[k]], pa - a, pb - a,
                                save_top)
                        opts += [(RECOMPUTE, frozenset(names[a + off] for off in offs))
                                 for offs in sets_of[k, pa - a, pb - a]]
                    if opts:
                        self.options[ja, jb] = opts
                        self.owner[ja, jb] = ci
                        self.kind_spans[ja, jb] = (k, pa - a, pb - a)
        if call_at < n:
            self.options[at[call_at], at[n]] = [(KEEP, frozenset())]
            self.owner[at[call_at], at[n]] = None
        # the producers whose storages cross each boundary
        crossing_producers: list[set[str]] = [set() for _ in self.points]
        for sid, (p, uses) in pos.items():
            j = bisect_right(self.points, p)  # (the first boundary after its making)
            while uses and j < len(self.points) and self.points[j] <= uses[-1]:
                if self.points[j] < n:
                    crossing_producers[j].add(graph.storages[sid].producer)
                j += 1
        crossers = dict(enumerate(map(frozenset, crossing_producers)))
        # the composition is exact where what crosses a boundary is made by the region just
        # before it, is a secured anchor, or is tracked (`tracked_anchors`): in the entry
        # states, whether a region before holds it; at most `MAX_TRACKED` per boundary
        tracked = tracked_anchors(self.points, pos, shared_inputs(graph),
                                  saver_positions(graph))
        self.crossing = [frozenset(sid for sid in tracked if pos[sid][0] < c <= pos[sid][1][-1])
                         for c in self.points]
        self.chained = all(len(x) <= MAX_TRACKED for x in self.crossing)
        if not self.chained:  # (too many states: nothing tracked, nothing claimed)
            tracked = frozenset()
            self.crossing = [frozenset()] * len(self.points)
        self.tracked = tracked
        index = {x: i for i, x in enumerate(names)}
        readers = storage_readers(graph)
        self._made = {sid: pos[sid][0] for sid in tracked}
        self._readers = {sid: sorted(index[r] for r in readers[sid] if r in index)
                         for sid in tracked}
        self._savers = {sid: saver_positions(graph).get(sid, []) for sid in tracked}
        self._saving = [i for i, x in enumerate(names) if graph.node(x).saved]
        self._holds: dict[tuple[int, int, int], frozenset[int]] = {}
        self._undominated: dict[tuple[int, int, State], list[int]] = {}
        # no recompute region caches what crosses its end: whether it then holds it depends
        # on the next region's policy, which no entry state says (random paths through the
        # 2-layer Llama's table composed 512 bytes below `simulate` with those options)
        for (ja, jb), opts in list(self.options.items()):
            self.options[ja, jb] = [(p, save) for p, save in opts
                                    if p == KEEP or not save & crossers[jb]]
        if most_simulations is not None:
            over = [0] * (len(self.points) + 1)  # options over each gap, as differences
            for (ja, jb), opts in self.options.items():
                over[ja] += len(opts)
                over[jb] -= len(opts)
            if max(accumulate(over)) > most_simulations:
                raise TableTooLarge(f"more than {most_simulations} simulations")
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
                for q in self.states[a]:
                    seen[self.leave(a, j, o, q)] = None
            self.states[j] = list(seen)
        self.entries: dict[tuple[int, int, int, State], Entry] = {}
        self._plan: list[list] | None = chainpack.pack(self)
        self.planned = len(self._plan)
        if most_simulations is not None and self.planned > most_simulations:
            raise TableTooLarge(f"{self.planned} simulations, more than {most_simulations}")
        if measured:
            self.measure(graph)

    def measure(self, graph: CostGraph) -> None:
        """Run the planned simulations (`chainpack.pack`) that fill ``entries`` (once; the
        constructor does, unless ``measured=False``)."""
        if self._plan is not None:
            chainpack.measure(self, graph, self._plan)
            self._plan = None

    def leave(self, a: int, b: int, o: int, q: State) -> tuple[str, frozenset[int]]:
        """The state region option ``o`` over boundaries ``[a, b)`` entered in ``q`` leaves
        for the next region: its policy (what crosses its end is kept or dropped with it;
        none is cached, see above), and the tracked anchors crossing ``b`` that it or a
        region before holds."""
        held = self._held_by(a, b, o)
        if q is not None and q[1]:
            held = (held | q[1]) & self.crossing[b]
        return self.options[a, b][o][0], held

    def undominated(self, a: int, b: int, q: State) -> list[int]:
        """The options over ``[a, b)`` after state ``q`` that no other option leaving the
        same state beats or equals in every cost (local peak, held bytes, recompute time,
        the loss region's peak after it): a path through a dominated one does no better
        with any region after it. Of equal ones the first stays (deterministic)."""
        key = (a, b, q)
        if key not in self._undominated:
            cands = [(o, self.entries[a, b, o, q], self.leave(a, b, o, q))
                     for o in range(len(self.options[a, b]))]
            self._undominated[key] = [
                o for o, e, st in cands
                if not any(st2 == st and _le(e2, e) and (o2 < o or not _le(e, e2))
                           for o2, e2, st2 in cands if o2 != o)]
        return self._undominated[key]

    def _held_by(self, a: int, b: int, o: int) -> frozenset[int]:
        """The tracked anchors crossing boundary ``b`` that region option ``o`` over ``[a,
        b)`` holds for backward, as the simulator has it: a keep region where one of its
        nodes saves the anchor; a recompute region where it reads the anchor, made before
        it, and saves anything at all (a checkpoint keeps its inputs for its replay)."""
        key = (a, b, o)
        if key not in self._holds:
            pa, pb = self.points[a], self.points[b]
            keep = self.options[a, b][o][0] == KEEP
            saves = bisect_left(self._saving, pa) < bisect_left(self._saving, pb)
            self._holds[key] = frozenset(
                sid for sid in self.crossing[b]
                if (_within(self._savers[sid], pa, pb) if keep else
                    saves and self._made[sid] < pa and _within(self._readers[sid], pa, pb)))
        return self._holds[key]

    @property
    def exact(self) -> bool:
        """Whether the composition is exact: what crosses each boundary is made just before
        it, is a secured anchor or is tracked (at most `MAX_TRACKED` per boundary), and every
        entry was separable where it was measured."""
        return self.chained and all(e.exact for e in self.entries.values())

    def spans(self) -> list[tuple[int, int]]:
        return sorted(self.options)


def _le(x: Entry, y: Entry) -> bool:
    """Whether entry ``x`` costs no more than ``y`` in every respect."""
    return (x.local <= y.local and x.held <= y.held and x.time_s <= y.time_s
            and x.tail_local <= y.tail_local)


def _within(positions: list[int], lo: int, hi: int) -> bool:
    """Whether a sorted list of positions has one in ``[lo, hi)``."""
    i = bisect_left(positions, lo)
    return i < len(positions) and positions[i] < hi


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


def table_of(graph: CostGraph, *, save_top: int = SolverConfig.save_top,
             tracked: int | None = SolverConfig.chain_tracked,
             work: int = SolverConfig.chain_work) -> ChainTable:
    """The chain table of ``graph`` (cached beside it, `base.graph_cache`). ``tracked=None``:
    the most tracked anchors per cut (0 to `MAX_TRACKED`) whose table takes at most ``work``
    node-simulations (planned simulations times compute nodes; the fewest, 0, whatever it
    takes): a count, not a clock, so every run and machine builds the same table."""
    cache = graph_cache(graph, "chain tables")
    if (save_top, tracked, work) not in cache:
        if tracked is not None:
            table = ChainTable(graph, save_top=save_top, tracked=tracked)
        else:
            table = ChainTable(graph, save_top=save_top, tracked=0, measured=False)
            for level in range(1, MAX_TRACKED + 1):
                try:
                    table = ChainTable(graph, save_top=save_top, tracked=level, measured=False,
                                       most_simulations=work // len(graph.compute_nodes))
                except TableTooLarge:
                    break
            table.measure(graph)
        cache[save_top, tracked, work] = table
    return cache[save_top, tracked, work]
