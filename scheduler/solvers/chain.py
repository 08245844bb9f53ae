"""``chain``: exact DP over the chain of unit calls of a graph with units.

A graph with units (`CostGraph.units`) is a chain of unit calls (`ir.replays.unit_calls`)
with the model's own code between them, which is always kept. Every recompute region lies
within one call (`ir.replays.recompute_limits`).

**Space** (written to ``schedule.meta["space"]``). Region boundaries at every call's start
and end and at the *unit cuts* inside the calls (`chaincuts.unit_cuts`; one set per unit
kind, kept where it holds for every call of the kind): positions where at most one storage
made since the boundary before crosses, and every other crossing storage is an *anchor* (a
residual stream) that the region starting at the first boundary it crosses holds whatever
that region is, or, with ``SolverConfig.chain_tracked`` (0 to 2; by default the most whose
table takes at most ``SolverConfig.chain_work`` node-simulations, `table_of`), at most that
many *tracked* anchors that nothing there saves (a bf16 layer's input, which its norm casts).
Each region within a call is ``keep`` (between two neighbouring boundaries;
a longer keep region is the run of them) or ``recompute`` over any run of boundaries the
rewriter runs (a whole call recomputed included), saving nothing or its 1 ..
``SolverConfig.save_top`` slowest allocating nodes (by the kind's median time, as
`dp.save_candidates` ranks) but not its own output where that crosses its end, and never
spanning an anchor's first boundary while making the anchor and passing it on. The code
between calls is one keep region. It contains ``every_block`` (each call recomputed whole)
and the schedules that keep every call; it does not contain the other boundaries, other
save sets, or recompute regions over several calls (which the runtime does not execute
yet).

**Why it is exact.** As in `dp`: at region boundaries that one activation crosses, the
simulator's peak is ``max_j (H_<j + L_j)`` (and the loss region's local peak after the last
one), where ``L_j``, ``H_j`` and the recompute time of region j depend only on the region
and on what the region before leaves for the activation that enters it (kept or dropped:
`ChainTable.leave`). An anchor crossing several boundaries does not break this: the region
starting at the first of them holds it (a node there saves it, or that region recomputes and
so holds it as an input) from its making to that region's backward, so its bytes are that
region's ``H``, the same at every later moment, whatever the later regions are. A tracked
anchor (`chaincuts.tracked_anchors`) is, for the accounting (`region_costs`'
``last_owned``), the last region's that reads it: every region up to that one counts it in
its local peak while it is alive, which is in forward and, once a region before holds it (a
recompute region reading it, a keep region saving it), in backward too; so the entry states
carry, besides the policy, the tracked anchors crossing the boundary that a region before
holds (`ChainTable.leave`). Storages crossing calls (a skip connection) are tracked the same
way, at most `chaincuts.MAX_TRACKED` per boundary. A recompute region that caches its own
output for the next region would hold it or not by the next region's policy, so that option
is left out. The numbers are the simulator's own (`region_costs`): each region option of
each call is measured after each state it may be entered in (each call has its own numbers:
the gradients later calls left alive, what the first call frees, differ by position). The DP
then keeps, per boundary and entry state, the Pareto front of (bytes held, recompute time)
over the prefixes that fit: integers, no rounding, no time limit. It claims OPTIMAL only
where every measured entry was separable (`RegionCost`) and the schedule's own simulation
agrees with the composed peak; else the schedule (simulated, so it fits) is FEASIBLE.

**Cost.** As many simulations as region options (with the region before them) overlap at
one position: the table packs every job that does not overlap another into one simulation
(`chainpack.measure`), whatever the number of calls; then a DP linear in the number
of calls (times the fronts' sizes), which skips an option another one beats in every cost
after the same state (`ChainTable.undominated`). The least peak over the space
(`least_peak`) is one DP over (held, peak) fronts: exact, no binary search.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from ..ir.graph import CostGraph
from ..ir.schedule import KEEP, Schedule
from .base import INFEASIBLE, OPTIMAL, SolveResult, finish, register
from .chaintable import ChainTable, State, applies, table_of
from .config import SolverConfig

__all__ = ["ChainTable", "applies", "chain", "least_peak", "search", "space_of", "table_of"]


#: a path of chosen regions, newest first: (boundary a, boundary b, option, the rest) or None
Path = tuple | None


@dataclass
class _Front:
    """Prefixes reaching one boundary in one state, as arrays: bytes held, the minimized key
    (time, or peak for the least peak), the other one, and where each came from (the front
    before, its index there, and the region: boundary a, boundary b, option)."""

    held: np.ndarray
    key: np.ndarray
    other: np.ndarray
    src: np.ndarray
    idx: np.ndarray
    span: list[tuple[int, int, int]]
    span_of: np.ndarray


def _pareto(chunks: list[tuple]) -> _Front:
    """The Pareto front on (held, key), both minimized, of candidate chunks; of equal ones
    the first in the order they came: deterministic. Each chunk is a front already (a front
    shifted by one region's constants), sorted by held, so a stable sort by held alone merges
    them (timsort finds the runs); of the points left with equal held, the last has the least
    key (and is the first to come of those with it)."""
    held = np.concatenate([c[0] for c in chunks])
    key = np.concatenate([c[1] for c in chunks])
    sizes = [len(c[0]) for c in chunks]
    order = np.argsort(held, kind="stable")
    k = key[order]
    before = np.concatenate(([np.inf], np.minimum.accumulate(k)[:-1]))
    keep = order[k < before]
    h = held[keep]
    keep = keep[np.append(h[1:] != h[:-1], True)]
    other = np.concatenate([c[2] for c in chunks])[keep]
    src = np.repeat(np.array([c[3] for c in chunks], dtype=np.int64), sizes)[keep]
    idx = np.concatenate([c[4] for c in chunks])[keep]
    span_of = np.repeat(np.arange(len(chunks), dtype=np.int64), sizes)[keep]
    return _Front(held[keep], key[keep], other, src, idx, [c[5] for c in chunks], span_of)


def _run(table: ChainTable, budget: int | None) -> tuple[int, float, Path] | None:
    """The DP. With ``budget``: the least recompute time of a schedule whose composed peak
    fits, as (peak, time, path), fronts on (held, time). Without: the least composed peak,
    fronts on (held, peak) (the least time breaks ties at the end)."""
    last = len(table.points) - 1
    timed = budget is not None
    fronts: list[_Front] = []
    pending: dict[tuple[int, State], list[tuple]] = {
        (0, None): [(np.zeros(1, np.int64), np.zeros(1, np.float64 if timed else np.int64),
                     np.zeros(1, np.int64 if timed else np.float64), -1,
                     np.zeros(1, np.int64), (-1, -1, -1))]}
    best: tuple | None = None
    for a in range(last):
        for q in table.states[a]:
            chunks = pending.pop((a, q), None)
            if not chunks:
                continue
            f = _pareto(chunks)
            fid = len(fronts)
            fronts.append(f)
            index = np.arange(len(f.held))
            for b in table.starts[a]:
                for o in table.undominated(a, b, q):
                    e = table.entries[a, b, o, q]
                    if timed:
                        t, pk = f.key, f.other
                    else:
                        pk, t = f.key, f.other
                    pk = np.maximum(pk, f.held + e.local)
                    nh = f.held + e.held
                    nt = t + e.time_s
                    if b == last:
                        pk = np.maximum(pk, nh + e.tail_local)
                    ok = pk <= budget if timed else np.ones(len(pk), bool)
                    if not ok.any():
                        continue
                    if b == last:
                        pick = np.flatnonzero(ok)
                        first, second = (nt[pick], pk[pick]) if timed else (pk[pick], nt[pick])
                        j = int(np.lexsort((second, first))[0])
                        i = int(pick[j])
                        cand = (first[j].item(), second[j].item())
                        if best is None or cand < best[0]:
                            best = (cand, (int(pk[i]), float(nt[i]), (a, b, o, (fid, int(i)))))
                        continue
                    key, other = (nt, pk) if timed else (pk, nt)
                    pending.setdefault((b, table.leave(a, b, o, q)), []).append(
                        (nh[ok], key[ok], other[ok], fid, index[ok], (a, b, o)))
    if best is None:
        return None
    pk, t, (a, b, o, (fid, i)) = best[1]
    path: Path = (a, b, o, None)
    regions = [(a, b, o)]
    while fid >= 0:
        f = fronts[fid]
        span = f.span[int(f.span_of[i])]
        fid, i = int(f.src[i]), int(f.idx[i])
        if span[0] >= 0:
            regions.append(span)
    path = None
    for a, b, o in reversed(regions):
        path = (a, b, o, path)
    return pk, t, path


def _spans(table: ChainTable, path: Path) -> list[tuple[int, int, str, frozenset[str]]]:
    out = []
    while path is not None:
        a, b, o, path = path
        out.append((table.points[a], table.points[b], *table.options[a, b][o]))
    out.reverse()
    merged: list[list] = []
    for a, b, p, save in out:  # adjacent keep regions are one keep region
        if merged and p == KEEP and merged[-1][2] == KEEP:
            merged[-1][1] = b
        else:
            merged.append([a, b, p, save])
    return [tuple(x) for x in merged]  # type: ignore[misc]


def search(table: ChainTable, budget: int) -> tuple[float, list[tuple], int] | None:
    """The least recompute time over the table's space whose composed peak fits ``budget``:
    (time, spans over compute positions, composed peak), or None when nothing fits."""
    found = _run(table, budget)
    if found is None:
        return None
    pk, t, path = found
    return t, _spans(table, path), pk


def least_peak(table: ChainTable) -> int:
    """The least composed peak of any schedule in the table's space (one DP over (held,
    peak) fronts: exact)."""
    found = _run(table, None)
    assert found is not None  # (keeping everything is in the space)
    return found[0]


def space_of(table: ChainTable) -> str:
    """What ``schedule.meta["space"]`` says of the table's space."""
    kinds = len(set(table.kinds))
    tracked = (f", and at most {table.tracked_cuts} tracked ones nothing there saves"
               if table.tracked_cuts else "")
    return (f"chain of {len(table.calls)} unit calls ({kinds} kind{'s' * (kinds != 1)}); "
            "regions within one call, bounded at the call's ends and its unit cuts (one storage "
            "made since the boundary before crosses, besides residual anchors the region "
            f"after their first boundary holds{tracked}); keep, or recompute saving nothing "
            f"or at most the {table.save_top} slowest allocating nodes, not its own output; "
            "code between calls kept")


@register("chain")
def chain(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None,
          config: SolverConfig | None = None) -> SolveResult:
    """Exact DP over the chain of unit calls (see the module docstring): the least recompute
    time over the space named in ``schedule.meta["space"]``, OPTIMAL (gap 0) over that space
    where proven. ``time_limit_s`` is accepted for the common signature and not used: the
    answer never depends on a clock. Raises ValueError on a graph without units."""
    started = time.perf_counter()
    if not applies(graph):
        raise ValueError(
            f"solver 'chain' solves graphs with units (CostGraph.units); graph {graph.name!r} "
            "has none: solve it with 'auto' or plan the model with units='auto'")
    config = config or SolverConfig()
    table = table_of(graph, save_top=config.save_top, tracked=config.chain_tracked,
                     work=config.chain_work)
    found = search(table, budget_bytes)
    if found is None:  # (the least peak is proven only where the composition is exact)
        return finish(graph, budget_bytes, None, solver="chain", started=started,
                      status=INFEASIBLE,
                      min_feasible_bytes=least_peak(table) if table.exact else None)
    t, spans, composed = found
    schedule = Schedule.from_regions(graph, spans, meta={"space": space_of(table)})
    result = finish(graph, budget_bytes, schedule, solver="chain", started=started)
    if not result.fits:  # (a composition that was not exact, `ChainTable.exact`)
        return finish(graph, budget_bytes, None, solver="chain", started=started,
                      status=INFEASIBLE)
    moved = result.schedule is not None and "moved_cuts" in result.schedule.meta
    proven = (table.exact and not moved and result.estimate is not None
              and result.estimate.peak_bytes == composed)
    if not proven:
        return result
    result = finish(graph, budget_bytes, schedule, solver="chain", started=started,
                    status=OPTIMAL, lower_bound_s=result.estimate.recompute_s,  # type: ignore
                    full_space=True)
    # (OPTIMAL over the stated space: the bound is the space's, not the full space's)
    return replace(result, lower_bound_s=None, space_bound_s=t)
