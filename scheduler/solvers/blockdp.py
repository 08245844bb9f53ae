"""``blocks``: exact dynamic programming over the chain of repeated blocks.

**Space.** `blocks.find_blocks` cuts the graph into stages: a prefix (embeddings), the chain
of blocks and a suffix (head, loss), each stage a run of nodes between chain cuts, each block
with its kind (identical blocks share one). A schedule's regions start and end at stage
boundaries: one stage kept, or a run of at most ``max_span`` stages recomputed; at save level
k a recompute region saves in each of its stages the kind's k slowest allocating node
positions, k from 0 to ``save_top`` (`SolverConfig.save_top`).
Keep regions over several stages are runs of one-stage keep regions (they compose exactly,
as in `dp`). The space is named in ``schedule.meta["space"]``.

**Why it is exact.** As in `dp`, on a chain the simulator's peak is ``max_j (H_<j + L_j)``
with each region's local peak ``L_j``, held bytes ``H_j`` and time depending only on its span,
its option and the state the region before it leaves. `blocktable.BlockTable` gets those
numbers from the simulator: times per stage, memory of each kind's regions at two positions,
shifted exactly to the others by the schedule-independent gradients of the later stages
(its docstring has the argument); so a DP over stage boundaries with Pareto fronts of (bytes
held, recompute time), integers throughout, finds the least recompute time over the space.
The result is simulated again (`finish`) and claimed optimal over the space (``OPTIMAL``
before `certify`, ``space_optimal`` after) only when every entry it used was exact and the
simulated peak equals the composed one.

Running time: the table costs a few simulations per kind, span and option (not per block:
2-3 per distinct run of kinds, option and entry state, plus 3 per save level),
cached beside the graph; then O(S * max_span * options * F) per budget, S the stages, F the
Pareto front size; the floor (least peak over the space) is a binary search on a feasibility
DP of O(S * max_span * options) per step.
"""

from __future__ import annotations

import time
from bisect import bisect_right

from ..ir.graph import CostGraph
from ..ir.schedule import KEEP, Schedule
from .base import INFEASIBLE, OPTIMAL, SolveResult, finish, graph_cache, register
from .blocks import Blocks, find_blocks
from .blocktable import BlockTable
from .config import SolverConfig

__all__ = ["MAX_SPAN", "block_dp", "blocks_of", "floor_bytes", "search", "space_of",
           "table_of"]

#: the longest recompute region of the space, in blocks
MAX_SPAN = 16


def blocks_of(graph: CostGraph) -> Blocks:
    """`find_blocks` of ``graph``, cached beside it."""
    cache = graph_cache(graph, "blocks")
    if "blocks" not in cache:
        cache["blocks"] = find_blocks(graph)
    return cache["blocks"]


def table_of(graph: CostGraph, *, max_span: int = MAX_SPAN,
             save_top: int = SolverConfig.save_top) -> BlockTable:
    """The `BlockTable` of ``graph``'s stages, cached beside the graph."""
    cache = graph_cache(graph, "block tables")
    if (max_span, save_top) not in cache:
        cache[max_span, save_top] = BlockTable(graph, blocks_of(graph), max_span=max_span,
                                               save_top=save_top)
    return cache[max_span, save_top]


def space_of(graph: CostGraph, table: BlockTable, save_top: int) -> str:
    """The text naming the space, for ``schedule.meta["space"]``."""
    return (f"block chain ({blocks_of(graph).describe()}): regions at stage boundaries, "
            f"one stage kept, or up to {table.max_span} stages recomputed, saving in each "
            f"the same positions, at most its kind's {save_top} slowest")


def search(table: BlockTable, budget: int
           ) -> tuple[float, list[tuple], int, bool] | None:
    """Least recompute time under ``budget``: (time, spans, composed peak, exact) or None."""
    last = len(table.stages)
    front: dict[tuple[int, str | None], tuple[list[int], list[tuple]]] = {
        (0, None): ([0], [(0, 0.0, 0, True, None)])}
    best = None
    for a in range(last):
        for q in table.states[a]:
            for held, t, peak, exact, spans in front.pop((a, q), ((), ()))[1]:
                for m in range(1, table.max_span + 1):
                    opts = table.options.get((a, m))
                    if opts is None:
                        break
                    for o in range(len(opts)):
                        e = table.entries[a, m, o, q]
                        pk = max(peak, held + e.local)
                        if pk > budget:
                            continue
                        nh, nt = held + e.held, t + e.time_s
                        ns = (spans, (a, m, o))  # a linked list, read back at the end
                        ex = exact and e.exact
                        if a + m == last:
                            pk = max(pk, nh + e.tail_local)
                            if pk <= budget and (best is None or nt < best[0]):
                                best = (nt, ns, pk, ex)
                        else:
                            _insert(front.setdefault((a + m, table.leaves(a, m, o)), ([], [])),
                                    (nh, nt, pk, ex, ns))
    if best is None:
        return None
    steps, link = [], best[1]
    while link is not None:
        link, step = link
        steps.append(step)
    return best[0], steps[::-1], best[2], best[3]


def _insert(front: tuple[list[int], list[tuple]], item: tuple) -> None:
    """Add ``item`` to a Pareto front on (held, time), dropping what it dominates. The front
    is sorted by held bytes (``front[0]``, its keys), so times fall along it."""
    keys, items = front
    h, t = item[0], item[1]
    i = bisect_right(keys, h)
    if i and items[i - 1][1] <= t:
        return  # something holding no more is no slower
    j = i
    while j < len(items) and items[j][1] >= t:
        j += 1
    while i > 0 and keys[i - 1] == h:  # (equal held, slower: dominated)
        i -= 1
    keys[i:j] = [h]
    items[i:j] = [item]


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
    """Schedule spans of the DP's regions, adjacent keep regions as one."""
    out: list[list] = []
    for a, m, o in steps:
        start, stop, p, save = table.spans(a, m, o)
        if out and p == KEEP and out[-1][2] == KEEP:
            out[-1][1] = stop
        else:
            out.append([start, stop, p, save])
    return [tuple(x) for x in out]


@register("blocks")
def block_dp(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None,
             max_span: int = MAX_SPAN, config: SolverConfig | None = None) -> SolveResult:
    """Exact DP over the chain of blocks (see the module docstring). Polynomial; the time
    limit is not used (the table's size does not depend on the depth)."""
    started = time.perf_counter()
    save_top = (config or SolverConfig()).save_top
    table = table_of(graph, max_span=max_span, save_top=save_top)
    found = search(table, budget_bytes)
    if found is None:
        return finish(graph, budget_bytes, None, solver="blocks", started=started,
                      status=INFEASIBLE, min_feasible_bytes=floor_bytes(table))
    t, steps, composed, exact = found
    schedule = Schedule.from_regions(graph, _merged(table, steps),
                                     meta={"space": space_of(graph, table, save_top),
                                           "composed_peak_bytes": composed})
    result = finish(graph, budget_bytes, schedule, solver="blocks", started=started)
    if exact and result.estimate is not None and result.estimate.peak_bytes == composed:
        result = finish(graph, budget_bytes, schedule, solver="blocks", started=started,
                        status=OPTIMAL, lower_bound_s=t)
    return result
