"""Where a recompute region may be: the rewriter's refusal of replays that would read a value
written in place after forward read it, as constraints on a torch-free `CostGraph`.

The backward replay of a recompute region reads the region's inputs as they are in backward.
When a value the region reads from outside (or a view of it) is written in place at or after
the region's start (Hugging Face's ``shift_tokens_right``: ``new_zeros``, then ``fill_`` and
item assignment into it), the replay would read the written value, so the rewriter refuses
such a region (`regions.CheckpointedStep`). The profile records each such read
(`CostGraph.written_reads`); here they become, for each start position, the furthest a
recompute region starting there may reach (`recompute_limits`), which every solver and
baseline consults:

* the optimizing solvers search only regions within it (`allowed`);
* the baselines build their usual cuts and `legalize` moves each refused region's start to
  the nearest place that is allowed (or its end, or keeps the region when nothing is);
* `solvers.base.finish` legalizes whatever a solver returns, so that no schedule the
  rewriter refuses is ever returned (`check` says whether one is).

A region that holds the reader and the value, or starts after the last write, is allowed.
"""

from __future__ import annotations

import weakref
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .nodes import WrittenRead
from .region import KEEP, RECOMPUTE, Region, ScheduleError

if TYPE_CHECKING:
    from .graph import CostGraph
    from .schedule import Schedule

#: `recompute_limits` per graph (by id, with a weak reference to tell a reused id apart)
_LIMITS: dict[int, tuple[Any, ...]] = {}

__all__ = ["allowed", "check", "labelled_recomputed", "legalize", "recompute_limits", "refusal",
           "unit_calls"]


def recompute_limits(graph: CostGraph) -> tuple[int, ...]:
    """For each start ``s`` over ``graph.compute_nodes``, the largest ``stop`` such that a
    recompute region over ``compute_nodes[s:stop]`` (at any nesting depth) is one the
    rewriter runs; ``len(compute_nodes)`` where nothing limits it, ``s`` where no recompute
    region may start at ``s``. Longer regions from ``s`` are refused, shorter ones are not.
    Cached while the graph's nodes and `CostGraph.written_reads` stay the same objects."""
    cached = _LIMITS.get(id(graph))
    key = (graph.written_reads, graph.units)
    if cached is not None and cached[0]() is graph and cached[1] == key and len(
            cached[2]) == len(graph.nodes) and all(a is b for a, b in zip(cached[2], graph.nodes)):
        return cached[3]
    names = graph.compute_nodes
    n = len(names)
    limits = [n] * n
    if graph.written_reads:
        cpos = [graph.index(x) for x in names]
        at = {x: i for i, x in enumerate(names)}
        for w in graph.written_reads:
            r = at.get(w.reader)
            if r is None:  # a loss node: never in a region
                continue
            lo = graph.index(w.value) if _is_node(graph, w.value) else -1
            hi = min(graph.index(w.writer), graph.index(w.reader))
            # refused: a start after the value (or any start, for an input) and at or before
            # the write, with the reader inside
            for s in range(bisect_right(cpos, lo), bisect_right(cpos, hi)):
                limits[s] = min(limits[s], r)
    for a, b in _unit_limits(graph):
        for s in range(a, max(b, a + 1)):  # (a node outside the units: b == a)
            limits[s] = min(limits[s], b)
    out = tuple(limits)
    # (beside the graph, not on it, as `cost.static.Static.of` keeps its cache: no solver
    # state on the graph object)
    if cached is None or cached[0]() is not graph:
        weakref.finalize(graph, _LIMITS.pop, id(graph), None)
    _LIMITS[id(graph)] = (weakref.ref(graph), key, tuple(graph.nodes), out)
    return out


def unit_calls(graph: CostGraph) -> list[tuple[str, int, int]]:
    """The calls of the graph's units (`CostGraph.units`), in order: ``(unit path, start,
    stop)`` over ``graph.compute_nodes``, each a maximal run of nodes whose module path is the
    unit's or inside it. Empty for a whole-graph plan."""
    if not graph.units:
        return []
    units = set(graph.units)
    memo: dict[str, str | None] = {}

    def unit_of(path: str) -> str | None:  # (the longest unit path that is a dotted prefix)
        if path not in memo:
            parts = path.split(".")
            memo[path] = next((p for p in (".".join(parts[:k])
                                           for k in range(len(parts), 0, -1)) if p in units),
                              None)
        return memo[path]

    out: list[tuple[str, int, int]] = []
    for i, name in enumerate(graph.compute_nodes):
        unit = unit_of(graph.nodes[graph.index(name)].module_path)
        if unit is None:
            continue
        if out and out[-1][0] == unit and out[-1][2] == i:
            out[-1] = (unit, out[-1][1], i + 1)
        else:
            out.append((unit, i, i + 1))
    return out


def _unit_limits(graph: CostGraph) -> list[tuple[int, int]]:
    """``(start, stop)`` runs of compute positions a recompute region may not leave: each unit
    call, and each single node outside every unit (``stop == start``: no region starts
    there). Empty for a whole-graph plan."""
    if not graph.units:
        return []
    out, at = [], 0
    for _, a, b in unit_calls(graph):
        out.extend((s, s) for s in range(at, a))
        out.append((a, b))
        at = b
    out.extend((s, s) for s in range(at, len(graph.compute_nodes)))
    return out


def _is_node(graph: CostGraph, name: str) -> bool:
    try:
        graph.index(name)
    except KeyError:
        return False
    return True


def allowed(graph: CostGraph, start: int, stop: int) -> bool:
    """Whether a recompute region over ``compute_nodes[start:stop]`` is one the rewriter
    runs."""
    return stop <= recompute_limits(graph)[start]


def refusal(graph: CostGraph, nodes: Sequence[str]) -> WrittenRead | None:
    """The recorded read that makes the rewriter refuse a recompute region over ``nodes`` (in
    order), or None when it runs it."""
    if not nodes or not graph.written_reads:
        return None
    inside = set(nodes)
    start = graph.index(nodes[0])
    for w in graph.written_reads:
        if w.reader in inside and w.value not in inside and graph.index(w.writer) >= start:
            return w
    return None


def labelled_recomputed(regions: Sequence[Any], label: str = "region ") -> list[tuple[str, Any]]:
    """Every recompute region, nested ones too, with a label (``region 2``, ``region 2.1``):
    of `Region`s or of anything with ``recompute`` and ``inner`` (the executor's regions)."""
    out = []
    for i, r in enumerate(regions):
        if r.recompute:
            out.append((f"{label}{i}", r))
            out.extend(labelled_recomputed(r.inner, f"{label}{i}."))
    return out


def check(graph: CostGraph, schedule: Schedule) -> None:
    """Raise `ScheduleError` if the rewriter would refuse one of ``schedule``'s recompute
    regions (nested ones included), naming the region, the value and the write."""
    if graph.units:
        limits, at = recompute_limits(graph), {x: i for i, x in enumerate(graph.compute_nodes)}
        for label, r in labelled_recomputed(schedule.regions):
            a = at[r.nodes[0]]
            if a + len(r.nodes) > limits[a] and refusal(graph, r.nodes) is None:
                raise ScheduleError(
                    f"{label} ({r.nodes[0]!r} .. {r.nodes[-1]!r}) is not within one call of "
                    f"one of the plan's units ({', '.join(graph.units[:3])}"
                    f"{', ...' if len(graph.units) > 3 else ''}): the model's own code runs "
                    "between them, un-checkpointed; scheduler.ir.replays.legalize splits it")
    for label, r in labelled_recomputed(schedule.regions) if graph.written_reads else ():
        w = refusal(graph, r.nodes)
        if w is not None:
            raise ScheduleError(
                f"{label} recomputes from {w.value!r}, which node {w.writer!r} writes in "
                f"place afterwards: the backward replay would read the written value. Keep "
                f"{label} (policy keep), start it at or before {w.value!r} or after "
                f"{w.writer!r}, or end it before {w.reader!r}; "
                "scheduler.ir.replays.legalize does that")


# (start, stop, policy, save, inner) over compute positions
_Span = list


def legalize(graph: CostGraph, schedule: Schedule) -> tuple[Schedule, list[str]]:
    """``schedule`` with every recompute region the rewriter would refuse changed to one it
    runs, and what changed, one line each (empty: ``schedule`` itself is returned).

    A refused region's start moves to the nearest position that is allowed (the region
    before it grows or shrinks; merging into a recompute region before it counts as moving
    there), or, when that is nearer, its end moves back to where the region is allowed and
    the rest keeps; when neither is possible the region keeps. Save sets lose the nodes that
    left their region; a region whose span changes loses its inner regions (it runs flat)."""
    limits = recompute_limits(graph)
    if all(v == len(limits) for v in limits):
        return schedule, []
    names = graph.compute_nodes
    moves: list[str] = []
    at = {x: i for i, x in enumerate(names)}
    spans = _split_at_units([_span(r, at) for r in schedule.regions], graph, names, moves)
    fixed = _level(spans, limits, names, moves, "region ")
    if not moves:
        return schedule, []
    regions = [_region(s, names) for s in fixed]
    return replace(schedule, regions=regions), moves


def _split_at_units(spans: list[_Span], graph: CostGraph, names: list[str],
                    moves: list[str]) -> list[_Span]:
    """Top-level recompute regions that leave a unit call, split into one recompute region
    per unit call they cover and kept runs between (a split region runs flat; its save set
    is cut to each piece)."""
    runs = _unit_limits(graph)
    if not runs:
        return spans
    out: list[_Span] = []
    for i, s in enumerate(spans):
        a, b, p = s[:3]
        pieces = [(max(a, x), min(b, y if y > x else x + 1), y > x) for x, y in runs
                  if max(a, x) < min(b, y if y > x else x + 1)]
        if p != RECOMPUTE or len(pieces) == 1 and pieces[0][2]:
            out.append(s)
            continue
        moves.append(f"region {i} ({names[a]} .. {names[b - 1]}): split at the units' calls")
        for x, y, inside in pieces:
            piece = [x, y, RECOMPUTE if inside else KEEP,
                     {n for n in s[3] if n in names[x:y]} if inside else set(), []]
            if out and not inside and out[-1][2] == KEEP and out[-1][1] == x:
                out[-1][1] = y
            else:
                out.append(piece)
    return out


def _span(r: Region, at: dict[str, int]) -> _Span:
    return [at[r.nodes[0]], at[r.nodes[-1]] + 1, r.policy, set(r.save),
            [_span(x, at) for x in r.inner]]


def _region(s: _Span, names: list[str]) -> Region:
    a, b, p, save, inner = s
    return Region(p, tuple(names[a:b]), frozenset(save),
                  tuple(_region(x, names) for x in inner))


def _resize(s: _Span, a: int, b: int, names: list[str]) -> None:
    if (s[0], s[1]) != (a, b):
        s[0], s[1] = a, b
        s[3] = {x for x in s[3] if x in names[a:b]}
        s[4] = []


def _level(spans: list[_Span], limits: tuple[int, ...], names: list[str], moves: list[str],
           label: str) -> list[_Span]:
    """One level of regions (top level, or a region's inner ones) made legal, left to right;
    a region before the one being fixed is already legal."""
    i = 0
    while i < len(spans):
        a, b, p = spans[i][:3]
        if p == RECOMPUTE and b > limits[a]:
            choice = _nearest(spans, i, limits)
            where = f"{label}{i} ({names[a]} .. {names[b - 1]})"
            if choice is None:
                spans[i][2] = KEEP
                spans[i][3], spans[i][4] = set(), []
                moves.append(f"{where}: no allowed cut nearby; kept")
            elif choice[0] == "start":
                a2 = choice[1]
                prev = spans[i - 1]
                if a2 == prev[0]:  # merged into the recompute region before
                    save = prev[3] | spans[i][3]
                    _resize(prev, prev[0], b, names)
                    prev[3] = save
                    del spans[i]
                    i -= 1
                    moves.append(f"{where}: merged into the recompute region before it")
                else:
                    _resize(prev, prev[0], a2, names)
                    _resize(spans[i], a2, b, names)
                    moves.append(f"{where}: start moved to {names[a2]}")
            else:
                b2 = choice[1]
                _resize(spans[i], a, b2, names)
                spans.insert(i + 1, [b2, b, KEEP, set(), []])
                moves.append(f"{where}: end moved to before {names[b2]}, the rest kept")
        if spans[i][2] == RECOMPUTE and spans[i][4]:
            spans[i][4] = _level(spans[i][4], limits, names, moves, f"{label}{i}.")
        i += 1
    return spans


def _nearest(spans: list[_Span], i: int, limits: tuple[int, ...]
             ) -> tuple[str, int] | None:
    """The nearest change that makes recompute region ``i`` legal: ("start", new start) or
    ("end", new stop); None when there is none."""
    a, b = spans[i][:2]
    options: list[tuple[int, int, str, int]] = []
    if i > 0:
        pa, _, pp = spans[i - 1][:3]
        for a2 in range(pa + 1, b):
            if a2 != a and limits[a2] >= b and (pp != RECOMPUTE or a2 < a or limits[pa] >= a2):
                options.append((abs(a2 - a), 0, "start", a2))
        if pp == RECOMPUTE and limits[pa] >= b and not spans[i - 1][4] and not spans[i][4]:
            options.append((a - pa, 0, "start", pa))
    if limits[a] > a:
        options.append((b - limits[a], 1, "end", limits[a]))
    if not options:
        return None
    _, _, kind, x = min(options)
    return kind, x
