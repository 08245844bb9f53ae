"""``blocks``: exact dynamic programming over the chain of repeated blocks.

**Space.** `blocks.find_blocks` cuts the graph into stages: a prefix (embeddings), the chain
of blocks and a suffix (head, loss), each stage a run of nodes between chain cuts, each block
with its kind (identical blocks share one). A schedule's regions start and end at stage
boundaries: one stage kept, or a run of at most ``max_span`` stages recomputed; at save level
k a recompute region saves in each of its stages the kind's k slowest allocating node
positions, k from 0 to ``save_top`` (`SolverConfig.save_top`).
Keep regions over several stages are runs of one-stage keep regions (they compose exactly,
as in `dp`). Stages are whole blocks, or with ``fine`` (the default up to `FINE_NODES` compute
nodes and on graphs with units, `fine_stages`) the pieces of blocks between chain cuts, and
runs may then mix kinds. Runs the rewriter would refuse (across a unit's calls,
`ir.replays`) are not in the table at all. ``blocks_nested``
adds two-level regions: a recompute run holding inner recompute regions of r stages (r in
`blocktable.INNER_SPANS`) and, at its end, an inner keep region (nested non-reentrant
checkpoints). The space is named in
``schedule.meta["space"]``.

**Why it is exact.** As in `dp`, on a chain the simulator's peak is ``max_j (H_<j + L_j)``
with each region's local peak ``L_j``, held bytes ``H_j`` and time depending only on its span,
its option and the state the region before it leaves. `blocktable.BlockTable` gets those
numbers from the simulator: times per stage, memory of each kind's regions at two positions,
shifted exactly to the others by the schedule-independent gradients of the later stages
(its docstring has the argument); so a DP over stage boundaries with Pareto fronts of (bytes
held, recompute time), integers throughout, finds the least recompute time over the space.
The result is simulated again (`finish`) and claimed optimal over the space (``OPTIMAL``
before `certify`, ``space_optimal`` after) only when every entry it used was exact and the
simulated peak and recompute time equal the composed ones (a nested region's time is shifted
between positions by its flat equivalent's, exact where identical stages' times are equal).

Running time: the table costs a few simulations per kind, span and option (not per block:
2-3 per distinct run of kinds, option and entry state, plus 3 per save level),
cached beside the graph; then O(S * max_span * options * F) per budget, S the stages, F the
Pareto front size; the floor (least peak over the space) is a binary search on a feasibility
DP of O(S * max_span * options) per step.
"""

from __future__ import annotations

import time

import numpy as np

from ..ir.graph import CostGraph
from ..ir.schedule import KEEP, Schedule
from .base import (
    INFEASIBLE,
    OPTIMAL,
    SolveResult,
    finish,
    graph_cache,
    offers_least_peak,
    register,
)
from .blocks import Blocks, find_blocks
from .blocktable import BlockTable, TooLarge, build_schedule
from .config import SolverConfig
from .deadline import OutOfTime, expired
from .dp import simulation_s
from .pinning import Pinned, pinned_of

__all__ = ["FINE_NODES", "MAX_SPAN", "block_dp", "blocks_of", "fine_stages", "floor_bytes",
           "nested_block_dp",
           "route_of", "search", "space_of", "table_built", "table_of"]

#: the longest recompute region of the space, in stages
MAX_SPAN = 16
#: up to this many compute nodes, stages are the pieces of blocks between chain cuts (finer,
#: about three times the simulations); above it, whole blocks (deep models in seconds)
FINE_NODES = 1500


def route_of(graph: CostGraph) -> Pinned | None:
    """How the block DP sees ``graph``: None when its own chain cuts give repeated blocks;
    else its `pinning.Pinned` copy when that one's cuts do (the copy's blocks are cached
    beside the copy); None when neither does. Cached beside the graph."""
    cache = graph_cache(graph, "block route")
    if "route" not in cache:
        route = None
        if not find_blocks(graph).repeats:
            p = pinned_of(graph)
            fixed = p.fixed
            if find_blocks(p.graph, cuts=p.cuts, fixed=fixed).repeats:
                route = p
                done = graph_cache(p.graph, "blocks")
                for fine in (False, True):
                    done[fine] = find_blocks(p.graph, fine=fine, cuts=p.cuts, fixed=fixed)
        cache["route"] = route
    return cache["route"]


def fine_stages(graph: CostGraph) -> bool:
    """Whether the block DP's stages are pieces of blocks: up to `FINE_NODES` compute nodes,
    or on a graph with units (`CostGraph.units`), whose regions never cross a unit's call, so
    that a table of pieces measures a few runs per unit, not `MAX_SPAN` of them."""
    return len(graph.compute_nodes) <= FINE_NODES or bool(graph.units)


def blocks_of(graph: CostGraph, *, fine: bool = False) -> Blocks:
    """`find_blocks` of ``graph`` (of its pinned copy where `route_of` says so), cached
    beside it."""
    cache = graph_cache(graph, "blocks")
    if fine not in cache:
        route = route_of(graph)
        cache[fine] = (find_blocks(graph, fine=fine) if route is None
                       else blocks_of(route.graph, fine=fine))
    return cache[fine]


def table_of(graph: CostGraph, *, max_span: int = MAX_SPAN,
             save_top: int = SolverConfig.save_top, nested: bool = False,
             fine: bool = False, max_simulations: int | None = None) -> BlockTable:
    """The `BlockTable` of ``graph``'s stages, cached beside the graph; ``fine``: stages are
    the pieces of blocks between chain cuts (`find_blocks`), runs may mix their kinds.
    ``max_simulations``: a table not built yet that would take more raises
    `blocktable.TooLarge` (one built already is returned as it is)."""
    cache = graph_cache(graph, "block tables")
    key = (max_span, save_top, nested, fine)
    if key not in cache:
        cache[key] = BlockTable(graph, blocks_of(graph, fine=fine), max_span=max_span,
                                save_top=save_top, nested=nested, mixed=fine,
                                max_simulations=max_simulations)
    return cache[key]


def table_built(graph: CostGraph, *, config: SolverConfig | None = None,
                nested: bool = False) -> bool:
    """Whether `block_dp`'s table for ``graph`` (default span and stages; ``nested``:
    `nested_block_dp`'s) is built already, so that a solve with it takes a search, not
    thousands of simulations."""
    work, _ = _work_of(graph)
    fine = fine_stages(graph)
    key = (MAX_SPAN, (config or SolverConfig()).save_top, nested, fine)
    return key in graph_cache(work, "block tables")


def space_of(graph: CostGraph, table: BlockTable, save_top: int, nested: bool = False,
             fine: bool = False) -> str:
    """The text naming the space, for ``schedule.meta["space"]``."""
    stages = "pieces of blocks between chain cuts" if fine else "whole blocks"
    text = (f"block chain ({blocks_of(graph).describe()}; stages: {stages}): regions at "
            "stage boundaries, "
            f"one stage kept, or up to {table.max_span} stages recomputed, saving in each "
            f"the same positions, at most its kind's {save_top} slowest")
    if nested:
        text += ("; or recomputed holding inner recompute regions of a fixed number of "
                 "stages and, at its end, an inner keep region (two levels)")
    return text


def search(table: BlockTable, budget: int
           ) -> tuple[float, list[tuple], int, bool] | None:
    """Least recompute time under ``budget``: (time, steps (first stage, stages, option),
    composed peak, exact) or None. The Pareto front of each (point, state) is a set of numpy
    arrays (held, time, peak, exact, id); ``id`` links an item to its parent and last step."""
    last = len(table.stages)
    parent, step = [-1], [(-1, -1, -1)]  # per item id
    pending: dict[tuple[int, str | None], list[tuple]] = {}
    best: tuple | None = None
    for a in range(last):
        for q in table.states[a]:
            if a == 0:
                H, T, P = np.zeros(1, np.int64), np.zeros(1), np.zeros(1, np.int64)
                X, ID = np.ones(1, bool), np.zeros(1, np.int64)
            else:
                chunks = pending.pop((a, q), None)
                if not chunks:
                    continue
                H, T, P, X, ID = _pareto(chunks, parent, step)
            for m in range(1, table.max_span + 1):
                opts = table.options.get((a, m))
                if opts is None:
                    break
                for o in range(len(opts)):
                    if (a, m, o) in table.refused:
                        continue
                    e = table.entries[a, m, o, q]
                    pk = np.maximum(P, H + e.local)
                    ok = pk <= budget
                    if not ok.any():
                        continue
                    nh, nt, npk = H[ok] + e.held, T[ok] + e.time_s, pk[ok]
                    nx, nid = X[ok] & e.exact, ID[ok]
                    if a + m == last:
                        pk2 = np.maximum(npk, nh + e.tail_local)
                        fit = np.flatnonzero(pk2 <= budget)
                        if fit.size:
                            i = fit[np.argmin(nt[fit])]
                            if best is None or nt[i] < best[0]:
                                best = (float(nt[i]), int(nid[i]), (a, m, o), int(pk2[i]),
                                        bool(nx[i]))
                    else:
                        pending.setdefault((a + m, table.leaves(a, m, o)), []).append(
                            (nh, nt, npk, nx, nid, (a, m, o)))
    if best is None:
        return None
    steps, node = [best[2]], best[1]
    while node > 0:
        steps.append(step[node])
        node = parent[node]
    return best[0], steps[::-1], best[3], best[4]


def _pareto(chunks: list[tuple], parent: list[int], step: list[tuple]) -> tuple:
    """The Pareto front on (held, time) of the candidates reaching one (point, state), as
    arrays; each survivor gets an id (its parent and step appended)."""
    H = np.concatenate([c[0] for c in chunks])
    T = np.concatenate([c[1] for c in chunks])
    P = np.concatenate([c[2] for c in chunks])
    X = np.concatenate([c[3] for c in chunks])
    par = np.concatenate([c[4] for c in chunks])
    which = np.concatenate([np.full(len(c[0]), k) for k, c in enumerate(chunks)])
    order = np.lexsort((T, H))
    t = T[order]
    before = np.minimum.accumulate(np.concatenate(([np.inf], t[:-1])))
    keep = order[t < before]  # faster than everything holding no more
    first = len(parent)
    parent.extend(par[keep].tolist())
    step.extend(chunks[k][5] for k in which[keep].tolist())
    return H[keep], T[keep], P[keep], X[keep], np.arange(first, first + len(keep))


def _fits(table: BlockTable, budget: int) -> bool:
    """Whether some schedule of the space fits ``budget``: per (point, state), the least
    bytes held by a prefix that fits (what later regions see of a prefix)."""
    last = len(table.stages)
    least: dict[tuple[int, str | None], int] = {(0, None): 0}
    for a in range(last):
        for q in table.states[a]:
            held = least.get((a, q))
            if held is None:
                continue
            for m in range(1, table.max_span + 1):
                opts = table.options.get((a, m))
                if opts is None:
                    break
                for o in range(len(opts)):
                    if (a, m, o) in table.refused:
                        continue
                    e = table.entries[a, m, o, q]
                    nh = held + e.held
                    if held + e.local > budget:
                        continue
                    if a + m == last:
                        if nh + e.tail_local <= budget:
                            return True
                    else:
                        key = (a + m, table.leaves(a, m, o))
                        if nh < least.get(key, nh + 1):
                            least[key] = nh
    return False


def floor_bytes(table: BlockTable) -> int:
    """The least peak any schedule of the table's space reaches, as composed by the DP."""
    hi = max(e.local + e.held + e.tail_local for e in table.entries.values()) + 1
    while not _fits(table, hi):
        hi *= 2
    lo = 0
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(table, mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _merged(table: BlockTable, steps: list[tuple[int, int, int]]) -> list[tuple]:
    """`build_schedule` items of the DP's regions, adjacent keep regions as one."""
    out: list[list] = []
    for a, m, o in steps:
        item = table.spans(a, m, o)
        if out and item[2] == KEEP and out[-1][2] == KEEP:
            out[-1][1] = item[1]
        else:
            out.append(list(item))
    return [tuple(x) for x in out]


def _work_of(graph: CostGraph) -> tuple[CostGraph, tuple[str, ...]]:
    """The graph the block DP solves for ``graph`` (its pinned copy where `route_of` says
    so, else itself) and the producers pinned there."""
    route = route_of(graph)
    return (graph, ()) if route is None else (route.graph, tuple(route.names))


def _solve(graph: CostGraph, budget_bytes: int, *, solver: str, nested: bool,
           max_span: int, fine: bool | None, config: SolverConfig | None) -> SolveResult:
    started = time.perf_counter()
    save_top = (config or SolverConfig()).save_top
    if fine is None:
        fine = fine_stages(graph)
    work, pinned = _work_of(graph)
    try:
        table = table_of(work, max_span=max_span, save_top=save_top, nested=nested, fine=fine)
    except OutOfTime:  # (the table half built, not kept: nothing found, nothing proven)
        return finish(graph, budget_bytes, None, solver=solver, started=started,
                      status=INFEASIBLE)
    found = search(table, budget_bytes)
    if found is None:  # proven only where every entry composes exactly, on the graph itself
        proven = not pinned and all(e.exact for e in table.entries.values())
        return finish(graph, budget_bytes, None, solver=solver, started=started,
                      status=INFEASIBLE,
                      min_feasible_bytes=floor_bytes(table) if proven else None)
    t, steps, composed, exact = found
    meta: dict[str, object] = {"space": space_of(work, table, save_top, nested, fine),
                               "composed_peak_bytes": composed}
    if pinned:
        meta["pinned"] = ", ".join(pinned)
    schedule = build_schedule(work, _merged(table, steps), meta=meta)
    # simulated on the graph itself: a pinned copy's peak only bounds it (`pinning`)
    result = finish(graph, budget_bytes, schedule, solver=solver, started=started)
    est = result.estimate
    if pinned and fine and result.status == INFEASIBLE and not exact:
        # pieces of blocks whose costs did not compose on the pinned copy: whole blocks
        return _solve(graph, budget_bytes, solver=solver, nested=nested, max_span=max_span,
                      fine=False, config=config)
    if not pinned and exact and est is not None and est.peak_bytes == composed and \
            abs(est.recompute_s - t) <= 1e-9 * max(t, 1e-12):
        result = finish(graph, budget_bytes, schedule, solver=solver, started=started,
                        status=OPTIMAL, lower_bound_s=t)
    return result


@register("blocks")
def block_dp(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None,
             max_span: int = MAX_SPAN, fine: bool | None = None,
             config: SolverConfig | None = None) -> SolveResult:
    """Exact DP over the chain of blocks (see the module docstring). Polynomial; the time
    limit is not used. ``fine``: stages are pieces of blocks (default: on graphs of at most
    `FINE_NODES` compute nodes)."""
    return _solve(graph, budget_bytes, solver="blocks", nested=False, max_span=max_span,
                  fine=fine, config=config)


@register("blocks_nested")
def nested_block_dp(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None,
                    max_span: int = MAX_SPAN, fine: bool | None = None,
                    config: SolverConfig | None = None) -> SolveResult:
    """`block_dp` over a space that adds two-level nested regions (see the module
    docstring)."""
    return _solve(graph, budget_bytes, solver="blocks_nested", nested=True,
                  max_span=max_span, fine=fine, config=config)


@offers_least_peak("blocks")
def _blocks_offer(graph: CostGraph, *, time_limit_s: float | None,
                  config: SolverConfig) -> list[Schedule]:
    """Where blocks repeat: the least-peak schedules of `block_dp`'s space and of
    `nested_block_dp`'s (two levels), each solved at its space's floor (`floor_bytes`).
    With a time limit, a table not built yet is built only where its simulations, counted
    from the stages and estimated from the graph's size (`dp.simulation_s`, not timed), fit
    half of it: the same graph and limit skip the same tables in every process (a nested
    table on a 380-node U-Net takes 13,000 simulations). Cut short by the shared deadline,
    it raises `OutOfTime` with what it found."""
    if not blocks_of(graph).repeats:
        return []
    found: list[Schedule] = []
    fine = fine_stages(graph)
    work, _ = _work_of(graph)
    most = None if time_limit_s is None else int(time_limit_s / 2 / simulation_s(work))
    for solver, nested in (("blocks", False), ("blocks_nested", True)):
        try:
            table = table_of(work, save_top=config.save_top, nested=nested, fine=fine,
                             max_simulations=most)
        except TooLarge:
            continue
        except OutOfTime:
            raise OutOfTime("the floor's block offer: out of time", partial=found) from None
        got = _solve(graph, floor_bytes(table), solver=solver, nested=nested,
                     max_span=MAX_SPAN, fine=fine, config=config)
        if got.schedule is not None:
            found.append(got.schedule)
    if expired():  # (a fallback table in `_solve` may have been cut short)
        raise OutOfTime("the floor's block offer: out of time", partial=found)
    return found
