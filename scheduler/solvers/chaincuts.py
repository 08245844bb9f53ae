"""Where `chain` may cut a unit call: the positions between its nodes where a region
boundary keeps the composition exact (`unit_cuts`), what crosses them, and the checks that
the table's boundaries and spans keep to that (`chained`, `spans_anchor`). See `chain`
for the space and why it composes exactly.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from ..cost.simulate import storage_readers
from ..ir.graph import CostGraph
from ..ir.replays import unit_calls
from .base import graph_cache

__all__ = ["MAX_TRACKED", "positions_of", "saver_positions", "shared_inputs", "spans_anchor",
           "tracked_anchors", "unit_cuts"]

#: the most *tracked* anchors (`tracked_anchors`) that may cross one boundary
#: (`SolverConfig.chain_tracked` at most): each one doubles the entry states the table
#: measures there
MAX_TRACKED = 2


def _positions(graph: CostGraph) -> tuple[int, dict[int, tuple[int, list[int]]]]:
    """``(n, {storage: (producer position, sorted positions that read or save it)})`` over
    ``graph.compute_nodes``. A node outside the compute nodes (the loss, an export's metadata
    assert) counts at the position of the next compute node (n after the last): a saver
    there holds the storage, a recorded last use there keeps it alive until then, and a mere
    reader there (an assert) holds nothing and is left out."""
    names = graph.compute_nodes
    n = len(names)
    at: dict[str, int] = {}
    k = 0
    for node in graph.nodes:
        at[node.name] = k
        if not node.is_loss:
            k += 1
    compute = set(names)
    readers = storage_readers(graph)
    out = {}
    for sid, st in graph.storages.items():
        p = at[st.producer] if st.producer in compute else n
        used = {at[r] for r in (*st.savers, st.last_use)}
        used |= {at[r] for r in readers[sid] if r in compute}
        out[sid] = (p, sorted(used - {p}))
    return n, out


def _crossing(graph: CostGraph, start: int, stop: int) -> dict[int, list[int]]:
    """For each position c in ``(start, stop)``: the storages crossing it that a region
    boundary there must account for: made before c and read or saved at or after c, where
    they were made in the call ``[start, stop)`` or are read or saved in it from c on."""
    _, pos = positions_of(graph)
    out: dict[int, list[int]] = {c: [] for c in range(start + 1, stop)}
    for sid, (p, uses) in pos.items():
        if not uses or uses[-1] <= start or p >= stop - 1:
            continue
        for c in range(max(start + 1, p + 1), stop):
            if p >= start:
                if uses[-1] >= c:
                    out[c].append(sid)
            else:
                j = bisect_left(uses, c)
                if j < len(uses) and uses[j] < stop:
                    out[c].append(sid)
    return out


def positions_of(graph: CostGraph) -> tuple[int, dict[int, tuple[int, list[int]]]]:
    """`_positions` of ``graph``, once (`base.graph_cache`)."""
    cache = graph_cache(graph, "chain positions")
    if "p" not in cache:
        cache["p"] = _positions(graph)
    return cache["p"]


def unit_cuts(graph: CostGraph, start: int, stop: int, tracked: int = 0) -> list[int]:
    """Positions inside the call ``[start, stop)`` (relative to ``start``) where a region
    boundary keeps the composition exact, taken left to right: of the storages crossing it
    (`_crossing`), at most one made after the boundary before it (the call's start or the
    previous cut taken), so that the region just before says its state; every other one an
    *anchor* (a residual stream: the call's input, the attention half's sum) that either the
    region starting at the first boundary it crosses holds whatever that region is
    (`_secured`), so that its bytes are that region's all step long, whichever regions
    follow, or, at most ``tracked`` of them (`SolverConfig.chain_tracked`), one the table
    tracks (`tracked_anchors`).
    Storages the code before the first call makes for several calls are exempt
    (`shared_inputs`)."""
    _, pos = positions_of(graph)
    savers = saver_positions(graph)
    shared = shared_inputs(graph)
    out, prev = [], start
    entered: dict[int, int] = {}  # anchor -> the first boundary it crosses
    next_cut: dict[int, int] = {}  # boundary -> the cut taken after it
    for c, sids in sorted(_crossing(graph, start, stop).items()):
        own = [sid for sid in sids if pos[sid][0] >= prev]
        loose = 0  # anchors not secured
        for sid in sids:
            if sid not in own and sid not in shared:
                b0 = entered.get(sid, start)  # (made before the call: it crosses its start)
                loose += not _secured(savers.get(sid, ()), b0, next_cut.get(b0, c))
        if len(own) <= 1 and loose <= tracked:
            entered.update(dict.fromkeys(own, c))
            next_cut.setdefault(prev, c)
            out.append(c - start)
            prev = c
    return out


def _secured(positions: list[int] | tuple[()], lo: int, hi: int) -> bool:
    """Whether a storage crossing boundary ``lo`` is held by every region starting there,
    which reaches ``hi`` (the next boundary) at least: a node in ``[lo, hi)`` saves it (a
    keep region holds it for that node's backward; a recompute region reads it there, so
    holds it as an input)."""
    return any(lo <= q < hi for q in positions)


def saver_positions(graph: CostGraph) -> dict[int, list[int]]:
    """Per storage, the compute positions of the nodes that save it for backward."""
    cache = graph_cache(graph, "chain saver positions")
    if "s" not in cache:
        index = {x: i for i, x in enumerate(graph.compute_nodes)}
        cache["s"] = {sid: sorted(index[m] for m in st.savers if m in index)
                      for sid, st in graph.storages.items()}
    return cache["s"]


def shared_inputs(graph: CostGraph) -> frozenset[int]:
    """Storages the code before the first call makes for several calls (rotary tables,
    masks): every call reads them after the first call holds them, so no boundary's state
    depends on them. (The first call's input, read by that call alone, is not one.)"""
    cache = graph_cache(graph, "chain shared inputs")
    if "s" not in cache:
        calls = unit_calls(graph)
        _, pos = positions_of(graph)
        first, first_end = (calls[0][1], calls[0][2]) if calls else (0, 0)
        cache["s"] = frozenset(sid for sid, (p, uses) in pos.items()
                               if p < first and uses and uses[-1] >= first_end)
    return cache["s"]


def tracked_anchors(points: list[int], pos: dict[int, tuple[int, list[int]]],
                    shared: frozenset[int], savers: dict[int, list[int]]) -> frozenset[int]:
    """The storages crossing two or more interior boundaries of ``points`` that the region
    starting at the first of them does not hold whatever it is (not `_secured`: in a bf16
    model, the call's input that the norm's cast copies, and the attention half's sum): the
    table *tracks* them, as the accounting's property of the last region that reads them
    (`region_costs`' ``last_owned``) with, in its entry states, whether a region before
    holds them. Everything else crossing a boundary is made in the region just before it,
    so that its policy says all the next one depends on, or is a secured anchor. The
    ``shared`` inputs (`shared_inputs`) are not counted."""
    inner = points[1:-1]
    out = set()
    for sid, (p, uses) in pos.items():
        if not uses or sid in shared:
            continue
        j = bisect_right(inner, p)
        if j + 1 < len(inner) and inner[j + 1] <= uses[-1] and not _secured(
                savers.get(sid, ()), inner[j], inner[j + 1]):
            out.add(sid)
    return frozenset(out)


def spans_anchor(made: dict[int, tuple[int, list[int]]], pa: int, pb: int,
                 inside: list[int]) -> bool:
    """Whether a region over ``[pa, pb)`` with the boundaries ``inside`` within it makes a
    storage that crosses one of them and ``pb`` too: an anchor the region would hold in
    place of the region starting at the boundary it crosses first, which the composition's
    states do not say. Such regions are left out of the space."""
    if not inside:
        return False
    last = inside[-1]
    return any(pa <= p < last and uses and uses[-1] >= pb for p, uses in made.values())
