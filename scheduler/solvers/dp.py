"""``dp``: exact dynamic programming over chain schedules.

**Space.** Regions start and end at *chain cuts*: positions between two compute nodes that at
most one activation crosses (no other forward storage is read or saved on both sides). Each
region is ``keep``, or ``recompute`` with one of the save sets `save_candidates` offers (its
`SolverConfig.save_top` slowest allocating nodes at most: selective checkpointing of the ops worth
caching), except recompute regions the rewriter would refuse (`ir.replays`). `chain_cuts`
lists the cuts; when there are more than ``max_cuts``, only cuts at
block boundaries are kept (the space shrinks, and results say so in
``schedule.meta["space"]``).

**Why it is exact.** On such a chain the simulator's peak decomposes over regions:
``peak = max_j (H_<j + L_j)`` where ``L_j`` is region j's local peak (its forward, replay and
backward, base included) and ``H_<j`` the bytes earlier regions hold meanwhile (`RegionCost`).
Both depend only on the region's span, its policy and save set, and the previous region's
policy (which decides whether the activation entering it is held). They are measured by running the
simulator itself on small schedules, so the DP composes the simulator's own numbers. The DP
keeps, for every cut and last policy, the Pareto front of (bytes held, recompute time) over
feasible prefixes: integers, no rounding, so a schedule it accepts fits. Each result is
simulated again; it is claimed optimal over the space only when that simulation agrees with
the composed peak and every region used was separable (``space_optimal``; `certify` calls it
OPTIMAL only if the full-space bound reaches it).

Running time: O(C^2) simulations to build the region table (cached beside the graph,
`base.graph_cache`), then O(C^2 * F) per budget, F the Pareto front size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..cost.simulate import region_costs, storage_readers
from ..cost.static import Static
from ..ir.graph import CostGraph
from ..ir.replays import recompute_limits
from ..ir.schedule import KEEP, RECOMPUTE, Schedule
from .base import INFEASIBLE, OPTIMAL, SolveResult, finish, graph_cache, register
from .config import SolverConfig
from .deadline import OutOfTime, check, clamp

__all__ = ["chain_cuts", "crossing_counts", "dp", "RegionTable", "region_options",
           "save_candidates", "simulation_s", "table_for"]

POLICIES = (KEEP, RECOMPUTE)


def _storage_spans(graph: CostGraph) -> tuple[int, list[tuple[int, int, str]]]:
    """``(n, [(producer position, last position that reads or saves it, producer)])`` for
    every forward storage, positions over ``graph.compute_nodes`` (loss nodes count as n)."""
    names = graph.compute_nodes
    n = len(names)
    idx = {name: i for i, name in enumerate(names)}
    readers = storage_readers(graph)
    spans = []
    for sid, st in graph.storages.items():
        p = idx.get(st.producer, n)
        last = max((idx.get(r, n) for r in (*st.savers, *readers[sid])), default=p)
        spans.append((p, last, st.producer))
    return n, spans


def crossing_counts(graph: CostGraph) -> list[int]:
    """For each position c (0 <= c <= n over ``graph.compute_nodes``), how many forward
    storages cross it: produced before c and read or saved at or after c. O(storages + n)."""
    n, spans = _storage_spans(graph)
    delta = [0] * (n + 2)
    for p, last, _ in spans:
        if last > p:  # crosses every cut c with p < c <= last
            delta[p + 1] += 1
            delta[min(last, n) + 1] -= 1
    out, running = [], 0
    for c in range(n + 1):
        running += delta[c]
        out.append(running)
    return out


def chain_cuts(graph: CostGraph) -> list[int]:
    """Positions c (0 < c < n over ``graph.compute_nodes``) that at most one forward storage
    crosses (`crossing_counts`)."""
    counts = crossing_counts(graph)
    return [c for c in range(1, len(counts) - 1) if counts[c] <= 1]


def save_candidates(graph: CostGraph, start: int, stop: int, *,
                    save_top: int = SolverConfig.save_top) -> list[frozenset[str]]:
    """Save sets offered to a recompute region over ``compute_nodes[start:stop]``: none, its
    slowest allocating node, ..., its ``save_top`` slowest (ties by position)."""
    names = graph.compute_nodes[start:stop]
    alloc = [(-graph.node(x).time_s, i, x) for i, x in enumerate(names) if graph.allocates(x)]
    top = [x for _, _, x in sorted(alloc)[:save_top]]
    return [frozenset(top[:k]) for k in range(len(top) + 1)]


def region_options(graph: CostGraph, start: int, stop: int, *,
                   save_top: int = SolverConfig.save_top) -> list[tuple[str, frozenset[str]]]:
    """(policy, save set) choices for one region of the space."""
    return [(KEEP, frozenset())] + [(RECOMPUTE, s) for s in
                                    save_candidates(graph, start, stop, save_top=save_top)]


@dataclass(frozen=True)
class _Entry:
    local: int  # local peak bytes of the region
    held: int  # bytes held while later regions run
    time_s: float
    tail_local: int  # local peak of the loss region when this region is the last
    exact: bool


#: what the region before a cut does with the activation crossing it: keeps it for backward
#: (keep), drops it (recompute), or caches it (recompute with its producer in the save set)
ENTRY_STATES = (KEEP, RECOMPUTE, "cached")


class RegionTable:
    """`RegionCost` of every region span between cuts, for each of its `region_options` and
    each `ENTRY_STATES` the region before it leaves, measured with the simulator.

    Keep regions longer than one gap between cuts are offered only where a one-gap keep
    region inside them is not separable: elsewhere a longer keep region is the run of its
    one-gap keep regions (`_spans_merged` joins them) and composes exactly from them (what it
    holds while later regions run is what its pieces hold together; its local peak over a
    piece is that piece's plus what earlier pieces hold). That leaves about a third fewer
    regions to simulate."""

    def __init__(self, graph: CostGraph, cuts: list[int], *, long_keeps: bool = False,
                 save_top: int = SolverConfig.save_top):
        """``long_keeps``: offer keep regions over every span (the full table, for checks).
        ``save_top``: see `save_candidates`. (It keeps no reference to ``graph``.)"""
        self.points = [0, *cuts, len(graph.compute_nodes)]
        self.crossing = _crossing_producers(graph, self.points)
        self.options: dict[tuple[int, int], list[tuple[str, frozenset[str]]]] = {}
        self.entries: dict[tuple[int, int, int, str | None], _Entry] = {}
        pts = self.points
        last = len(pts) - 1
        states: dict[int, tuple[str | None, ...]] = {}
        limits = recompute_limits(graph)
        for a in range(last):
            # "cached" only where some region ending here can cache the crossing activation
            cross = self.crossing[a]
            cacheable = cross is not None and any(
                cross in save for z in range(a) for _, save in self.options[z, a])
            states[a] = (None,) if a == 0 else ENTRY_STATES if cacheable else POLICIES
            for b in range(a + 1, last + 1):
                # (a recompute region the rewriter would refuse is not in the space)
                self.options[a, b] = region_options(graph, pts[a], pts[b], save_top=save_top) \
                    if pts[b] <= limits[pts[a]] else [(KEEP, frozenset())]
        for a in range(last):  # one-gap keep regions first: they decide the longer ones
            for q in states[a]:
                self.entries[a, a + 1, 0, q] = self._measure(graph, a, a + 1, KEEP,
                                                             frozenset(), q)
        inexact = [not all(self.entries[a, a + 1, 0, q].exact for q in states[a])
                   for a in range(last)]
        for a in range(last):
            for b in range(a + 1, last + 1):
                opts = self.options[a, b]
                if b > a + 1 and not long_keeps and not any(inexact[a:b]):
                    opts = self.options[a, b] = opts[1:]
                for o, (p, save) in enumerate(opts):
                    for q in states[a]:
                        if (a, b, o, q) not in self.entries:
                            self.entries[a, b, o, q] = self._measure(graph, a, b, p, save, q)

    def leaves(self, b: int, policy: str, save: frozenset[str]) -> str:
        """The entry state a region ending at point ``b`` leaves for the next one."""
        if policy == RECOMPUTE and self.crossing[b] in save:
            return "cached"
        return policy

    def _measure(self, graph: CostGraph, a: int, b: int, p: str, save: frozenset[str],
                 q: str | None) -> _Entry:
        n = len(graph.compute_nodes)
        start, stop = self.points[a], self.points[b]
        spans: list[tuple] = []
        if start > 0:
            if q == "cached":
                spans.append((0, start, RECOMPUTE, {self.crossing[a]}))
            else:
                spans.append((0, start, q))
        spans.append((start, stop, p, save))
        if stop < n:
            spans.append((stop, n, KEEP))
        check("dp's region table")  # (a solve's shared deadline: `deadline`)
        _, costs = region_costs(graph, Schedule.from_regions(graph, spans), timeline=False)
        j = 1 if start > 0 else 0
        c = costs[j]
        return _Entry(c.local_peak_bytes, c.held_bytes, c.recompute_s,
                      costs[-1].local_peak_bytes,
                      c.separable and all(x.separable for x in costs[:j]))


def _crossing_producers(graph: CostGraph, points: list[int]) -> dict[int, str | None]:
    """For each point index: the node that produced the activation crossing that cut (None
    at the ends or when nothing crosses)."""
    n, spans = _storage_spans(graph)
    out: dict[int, str | None] = {i: None for i in range(len(points))}
    for p, last, producer in spans:
        for i, c in enumerate(points):
            if 0 < c < n and p < c <= last:
                out[i] = producer
    return out


def table_for(graph: CostGraph, *, max_cuts: int = 40,
              save_top: int = SolverConfig.save_top) -> tuple[RegionTable, str]:
    """The region table of ``graph`` (cached beside the graph, `base.graph_cache`) and a
    description of the space it spans: every chain cut, or, when there are more than
    ``max_cuts``, those at block boundaries, evenly thinned to ``max_cuts`` if still too
    many."""
    cache = graph_cache(graph, "dp tables")
    if (max_cuts, save_top) not in cache:
        cuts = chain_cuts(graph)
        space = "chain cuts"
        if len(cuts) > max_cuts:
            blocks = [n.block for n in graph.nodes if not n.is_loss]
            cuts = [c for c in cuts if blocks[c] != blocks[c - 1]]
            space = "chain cuts at block boundaries"
        if len(cuts) > max_cuts:
            step = len(cuts) / max_cuts
            cuts = sorted({cuts[int(i * step)] for i in range(max_cuts)})
            space += f", thinned to {len(cuts)}"
        cache[max_cuts, save_top] = (RegionTable(graph, cuts, save_top=save_top), space)
    return cache[max_cuts, save_top]


def simulation_s(graph: CostGraph) -> float:
    """About how long one of the solvers' table simulations (`region_costs`) takes on
    ``graph``, estimated from its size (events, storages, steps), not timed: the same graph
    gives the same estimate in every process, so that work sized by it is the same too."""
    static = Static.of(graph)
    return 8e-7 * (len(static.fwd_flat) + len(static.stor) + 4 * static.n_steps) + 1e-4


def affordable_cuts(graph: CostGraph, seconds: float, *, most: int = 40,
                    save_top: int = SolverConfig.save_top) -> int:
    """How many cuts the region table can have for its O(cuts^2) simulations to take about
    ``seconds`` on this graph, each priced by `simulation_s` (its size, not a clock: the same
    graph and seconds give the same table on every run, rank and machine)."""
    # every region option, after every entry state
    per_pair = (save_top + 2) * len(ENTRY_STATES) * simulation_s(graph)
    return max(2, min(most, int((2 * seconds / per_pair) ** 0.5)))


def _search(table: RegionTable, budget: int) -> tuple[float, list[tuple], int, bool] | None:
    """Least recompute time under ``budget``: (time, spans, composed peak, exact) or None."""
    pts = table.points
    last = len(pts) - 1
    # front[(a, q)]: Pareto list of (held, time, peak, exact, spans) over feasible prefixes
    front: dict[tuple[int, str | None], list[tuple[int, float, int, bool, tuple]]] = {
        (0, None): [(0, 0.0, 0, True, ())]}
    best = None
    for a in range(last):
        for q in ((None,) if a == 0 else ENTRY_STATES):
            for held, t, peak, exact, spans in front.get((a, q), ()):
                for b in range(a + 1, last + 1):
                    for o, (p, save) in enumerate(table.options[a, b]):
                        e = table.entries[a, b, o, q]
                        pk = max(peak, held + e.local)
                        if pk > budget:
                            continue
                        nh, nt = held + e.held, t + e.time_s
                        ns = spans + ((pts[a], pts[b], p, save),)
                        ex = exact and e.exact
                        if b == last:
                            pk = max(pk, nh + e.tail_local)
                            if pk <= budget and (best is None or nt < best[0]):
                                best = (nt, list(ns), pk, ex)
                        else:
                            _insert(front.setdefault((b, table.leaves(b, p, save)), []),
                                    (nh, nt, pk, ex, ns))
    return best


def _insert(front: list, item: tuple) -> None:
    """Add ``item`` to a Pareto front on (held, time), dropping what it dominates."""
    h, t = item[0], item[1]
    for x in front:
        if x[0] <= h and x[1] <= t:
            return
    front[:] = [x for x in front if not (h <= x[0] and t <= x[1])]
    front.append(item)


def _spans_merged(spans: list[tuple]) -> list[tuple]:
    """Adjacent keep regions are one keep region."""
    out: list[list] = []
    for a, b, p, save in spans:
        if out and p == KEEP and out[-1][2] == KEEP:
            out[-1][1] = b
        else:
            out.append([a, b, p, save])
    return [tuple(x) for x in out]


def min_feasible_bytes(table: RegionTable) -> int:
    """The least peak any schedule in the table's space reaches (binary search on the DP)."""
    lo, hi = 0, max(e.local + e.held + e.tail_local for e in table.entries.values()) * 2 + 1
    while _search(table, hi) is None:
        hi *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        if _search(table, mid) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


@register("dp")
def dp(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None,
       max_cuts: int = 40, config: SolverConfig | None = None) -> SolveResult:
    """Exact DP over chain schedules (see the module docstring). The search is polynomial;
    ``time_limit_s`` bounds the table's size (fewer cuts on large graphs, said in
    ``schedule.meta["space"]``; a table already built for the graph with no more cuts than
    ``max_cuts`` is used as it is)."""
    started = time.perf_counter()
    save_top = (config or SolverConfig()).save_top
    time_limit_s = clamp(time_limit_s)  # (never past a solve's shared deadline)
    built = [k for k, top in graph_cache(graph, "dp tables") if top == save_top]
    if max_cuts not in built and time_limit_s is not None:
        max_cuts = next((k for k in sorted(built, reverse=True) if k <= max_cuts),
                        min(max_cuts, affordable_cuts(graph, time_limit_s / 2,
                                                      save_top=save_top)))
    try:
        table, space = table_for(graph, max_cuts=max_cuts, save_top=save_top)
    except OutOfTime:  # (the table half built: nothing found, nothing proven)
        return finish(graph, budget_bytes, None, solver="dp", started=started,
                      status=INFEASIBLE)
    found = _search(table, budget_bytes)
    if found is None:
        return finish(graph, budget_bytes, None, solver="dp", started=started,
                      status=INFEASIBLE, min_feasible_bytes=min_feasible_bytes(table))
    t, spans, composed_peak, exact = found
    schedule = Schedule.from_regions(graph, _spans_merged(spans),
                                     meta={"space": space + "; keep, or recompute saving at most "
                                                            f"the {save_top} slowest nodes"})
    result = finish(graph, budget_bytes, schedule, solver="dp", started=started)
    proven = exact and result.estimate is not None and \
        result.estimate.peak_bytes == composed_peak
    if proven:
        result = finish(graph, budget_bytes, schedule, solver="dp", started=started,
                        status=OPTIMAL, lower_bound_s=t)
    return result
