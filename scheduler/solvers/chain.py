"""``chain``: exact DP over the chain of unit calls of a graph with units.

A graph with units (`CostGraph.units`) is a chain of unit calls (`ir.replays.unit_calls`)
with the model's own code between them, which is always kept. Every recompute region lies
within one call (`ir.replays.recompute_limits`).

**Space** (written to ``schedule.meta["space"]``). Region boundaries at every call's start
and end and at the *unit cuts* inside the calls: positions that at most one storage crosses
of those the call itself reads or saves from there on or made before there (`unit_cuts`; one
set per unit kind, kept where it holds for every call of the kind). Each region within a call
is ``keep`` (between two neighbouring boundaries; a longer keep region is the run of them) or
``recompute`` over any run of boundaries the rewriter runs (a whole call recomputed included),
saving nothing or its 1 .. ``SolverConfig.save_top`` slowest allocating nodes (by the kind's
median time, as `dp.save_candidates` ranks). The code between calls is one keep region.
It contains ``every_block`` (each call recomputed whole) and the schedules that keep every
call; it does not contain boundaries between unit cuts, other save sets, or recompute
regions over several calls (which the runtime does not execute yet).

**Why it is exact.** As in `dp`: at region boundaries that one activation crosses, the
simulator's peak is ``max_j (H_<j + L_j)`` (and the loss region's local peak after the last
one), where ``L_j``, ``H_j`` and the recompute time of region j depend only on the region and
on what the region before leaves for the activation that enters it (kept, dropped, or cached
by a save set: `leaves`). The numbers are the simulator's own (`region_costs`): each region
option of each call is measured once, after each state it may be entered in. Calls of one
kind share their options, and one simulation measures an option at every call of the kind at
once (each call has its own numbers: the gradients later calls left alive, what the first call
frees, differ by position). The DP then keeps, per boundary and entry state, the Pareto front
of (bytes held, recompute time) over the prefixes that fit: integers, no rounding, no time
limit. It claims OPTIMAL only where every measured entry was separable (`RegionCost`) and the
schedule's own simulation agrees with the composed peak; else the schedule (simulated, so it
fits) is FEASIBLE.

**Cost.** A few simulations per option and entry state of each unit kind (not per call), then
a DP linear in the number of calls (times the fronts' sizes). The least peak over the space
(`least_peak`) is one DP over (held, peak) fronts: exact, no binary search.
"""

from __future__ import annotations

import time
from dataclasses import replace

from ..ir.graph import CostGraph
from ..ir.schedule import KEEP, Schedule
from .base import INFEASIBLE, OPTIMAL, SolveResult, finish, register
from .chaintable import ChainTable, State, applies, table_of
from .config import SolverConfig

__all__ = ["ChainTable", "applies", "chain", "least_peak", "search", "space_of", "table_of"]


#: a path of chosen regions, newest first: (boundary a, boundary b, option, the rest) or None
Path = tuple | None


def _pareto(items: list[tuple]) -> list[tuple]:
    """The Pareto front of ``items`` on their first two fields (both minimized), by one sort
    and a sweep: of equal ones, the first (a stable sort keeps the order they came in)."""
    items.sort(key=lambda x: (x[0], x[1]))
    out, best = [], None
    for x in items:
        if best is None or x[1] < best:
            out.append(x)
            best = x[1]
    return out


def _run(table: ChainTable, budget: int | None) -> tuple[int, float, int, Path] | None:
    """The DP. With ``budget``: the least recompute time of a schedule whose composed peak
    fits, as (peak, time, held, path), fronts on (held, time). Without: the least composed
    peak, fronts on (held, peak) (time breaks ties at the end)."""
    last = len(table.points) - 1
    # front[(boundary, state)]: Pareto list of (held, time or peak, peak or time, path)
    fronts: dict[tuple[int, State], list[tuple]] = {(0, None): [(0, 0, 0.0, None)]}
    best = None
    for a in range(last):
        for q in table.states[a]:
            front = fronts.pop((a, q), None)
            if not front:
                continue
            front = _pareto(front)
            for b in table.starts[a]:
                opts = table.options[a, b]
                for o in range(len(opts)):
                    e = table.entries[a, b, o, q]
                    nxt = None if b == last else fronts.setdefault(
                        (b, table.leaves(b, *opts[o])), [])
                    for held, key, other, path in front:
                        if budget is None:
                            pk, t = key, other
                        else:
                            t, pk = key, other
                        pk = max(pk, held + e.local)
                        if budget is not None and pk > budget:
                            continue
                        nh, nt, np = held + e.held, t + e.time_s, (a, b, o, path)
                        if b == last:
                            pk = max(pk, nh + e.tail_local)
                            if budget is not None and pk > budget:
                                continue
                            cand = (pk, nt) if budget is None else (nt, pk)
                            if best is None or cand < best[0]:
                                best = (cand, (pk, nt, nh, np))
                        elif budget is None:
                            nxt.append((nh, pk, nt, np))
                        else:
                            nxt.append((nh, nt, pk, np))
    return None if best is None else best[1]


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
    pk, t, _, path = found
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
    return (f"chain of {len(table.calls)} unit calls ({kinds} kind{'s' * (kinds != 1)}); "
            "regions within one call, bounded at the call's ends and its unit cuts (at most "
            "one storage crosses); keep, or recompute saving nothing or at most the "
            f"{table.save_top} slowest allocating nodes; code between calls kept")


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
    save_top = (config or SolverConfig()).save_top
    table = table_of(graph, save_top=save_top)
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
