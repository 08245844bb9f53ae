"""Repeated blocks of a `CostGraph`: the chain of stages the block DP (`blockdp`) solves over.

A *stage* is a run of compute nodes between two chain cuts (`dp.chain_cuts`: at most one
activation crosses). `find_blocks` cuts the graph into a prefix (embeddings), a chain of
blocks and a suffix (head, loss), and gives each stage a *kind*: stages of one kind are
identical, so that what the simulator says of one holds, shifted, for the others.

**Where blocks start.** The nodes' ``block`` labels (from module paths such as ``h.3`` or
``layers.3``) propose the boundaries: chain cuts where the label changes. They are only a
hint: when there are fewer than two labelled blocks, the boundaries come from the structure
alone (the period of the chain cuts' pieces whose signatures repeat over the longest run).

**When two stages are identical** (the proof, whatever the labels say): their
`stage_signature` is equal, an exact hash of everything the simulator reads of a stage except
times and names: each node's op, target with its integers blanked, output shape and bytes,
pack mark, inputs and saved tensors (as positions relative to the stage, or the kind of a
parameter/input), every forward storage event with the storage's bytes, flags, last reader,
savers and views (relative), and the stage's backward steps with their gradient events
(gradient ids renumbered in order of appearance). Times are not part of a kind: profiled
times of identical layers differ by noise (on the recorded GPT example by a factor of nearly
two; on a busy machine more), while a real difference in work changes shapes or bytes, which
are hashed exactly. `blockdp` measures each stage's replay time on its own position, so a
kind's times never enter a cost, only the choice of which node positions its save sets hold
(by the kind's median). Kinds once split where a time left a tolerance of the median: on a
busy machine that made the blocks of one profile not repeat, and the block DP's space
depended on the machine's load.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from itertools import pairwise

from ..ir.graph import CostGraph
from .base import graph_cache
from .dp import chain_cuts

__all__ = [
    "BETWEEN",
    "BLOCK",
    "MAX_PERIOD",
    "PREFIX",
    "SUFFIX",
    "Blocks",
    "Stage",
    "find_blocks",
    "stage_signature",
]

PREFIX, BLOCK, BETWEEN, SUFFIX = "prefix", "block", "between", "suffix"

#: without block labels, a block is at most this many pieces between chain cuts (the search
#: for the period is O(MAX_PERIOD * pieces))
MAX_PERIOD = 64

_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class Stage:
    """Compute nodes ``[start, stop)`` (positions over ``graph.compute_nodes``), its role
    (`PREFIX`, `BLOCK`, `BETWEEN`, `SUFFIX`) and its kind (equal kinds: identical stages)."""

    start: int
    stop: int
    role: str
    kind: int


@dataclass(frozen=True)
class Blocks:
    """The stages of a graph, in order, covering every compute node; ``hinted``: block
    boundaries came from the nodes' block labels (else from the structure alone)."""

    stages: tuple[Stage, ...]
    hinted: bool

    @property
    def points(self) -> list[int]:
        """Stage boundaries: 0, each stage's stop."""
        return [0] + [s.stop for s in self.stages]

    @property
    def chain(self) -> list[Stage]:
        return [s for s in self.stages if s.role == BLOCK]

    @property
    def repeats(self) -> bool:
        """Whether some kind of block occurs at least twice."""
        kinds = [s.kind for s in self.chain]
        return len(set(kinds)) < len(kinds)

    def describe(self) -> str:
        kinds = [s.kind for s in self.chain]
        distinct = len(set(kinds))
        return (f"{len(kinds)} blocks of {distinct} kind{'s' if distinct != 1 else ''}"
                f" ({'block labels' if self.hinted else 'structure'})")


def _normal(text: str) -> str:
    return _DIGITS.sub("#", text)


def stage_signature(graph: CostGraph, start: int, stop: int,
                    fixed: frozenset[str] = frozenset(), *,
                    layout: tuple[list[str], dict[str, list[int]]] | None = None) -> str:
    """The exact structural hash of compute nodes ``[start, stop)`` (see the module
    docstring): equal for stages the simulator cannot tell apart but by their times.
    ``fixed``: nodes that, outside the stage, are named as themselves, not by position (the
    producers of storages `pinning` holds to the end in every schedule, which every block
    reads). ``layout``: `graph_layout` of the graph, where the caller hashes many stages."""
    compute, steps_of = layout or graph_layout(graph)
    names = compute[start:stop]
    first = graph.index(names[0])
    inside = set(names)

    def rel(name: str) -> object:
        return name if name in fixed and name not in inside else graph.index(name) - first

    def source(src: str) -> object:
        if src.startswith(("param:", "buffer:", "input:")):
            return src.split(":", 1)[0]
        return rel(src)

    parts: list[object] = []
    for name in names:
        n = graph.node(name)
        events = []
        for kind, sid in graph.fwd_events.get(name, ()):
            st = graph.storages[sid]
            events.append((kind, st.bytes, rel(st.producer), st.output, st.inner_free,
                           rel(st.last_use), tuple(map(rel, st.savers)),
                           tuple(map(rel, st.views))))
        parts.append((n.op, _normal(str(n.target)), n.shape, n.out_bytes, n.pack_mark,
                      graph.engine_bytes.get(name, (0, 0)),
                      n.sac_s is None, tuple(map(rel, n.inputs)),
                      tuple((source(s.source), s.bytes) for s in n.saved), tuple(events)))
    ids: dict[int, int] = {}
    for step in _steps_in(graph, steps_of, names):
        evs = tuple((k, ids.setdefault(gid, len(ids)) if k == "a" else ids.get(gid, -1), b)
                    for k, gid, b in step.events)
        parts.append(("bwd", rel(step.node), evs))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def graph_layout(graph: CostGraph) -> tuple[list[str], dict[str, list[int]]]:
    """``graph.compute_nodes`` and, per node, the indices of its backward steps, computed once
    per graph (`base.graph_cache`): stages are hashed by the hundred on deep graphs."""
    cache = graph_cache(graph, "blocks layout")
    if "layout" not in cache:
        steps_of: dict[str, list[int]] = {}
        for i, step in enumerate(graph.bwd_steps):
            if step.node:
                steps_of.setdefault(step.node, []).append(i)
        cache["layout"] = (graph.compute_nodes, steps_of)
    return cache["layout"]


def _steps_in(graph: CostGraph, steps_of: dict[str, list[int]], names: list[str]) -> list:
    """The backward steps of nodes ``names``, in the graph's order."""
    return [graph.bwd_steps[i] for i in sorted(i for x in names for i in steps_of.get(x, ()))]


def _periodic(sigs: list[str]) -> tuple[int, int, int] | None:
    """(first piece, period, repetitions) of the longest run of pieces that repeats with a
    period (at least twice); ties: the smaller period, then the earlier run."""
    best = None
    for p in range(1, min(MAX_PERIOD, len(sigs) // 2) + 1):
        i = 0
        while i + p < len(sigs):
            j = i
            while j + p < len(sigs) and sigs[j] == sigs[j + p]:
                j += 1
            reps = (j - i) // p + 1
            if reps >= 2 and (best is None or reps * p > best[1] * best[2]):
                best = (i, p, reps)
            i = j + 1 if j > i else i + 1
    return best


def find_blocks(graph: CostGraph, *, fine: bool = False,
                cuts: list[int] | None = None, fixed: frozenset[str] = frozenset()) -> Blocks:
    """The prefix, the chain of blocks (each with its kind) and the suffix of ``graph`` (see
    the module docstring). A graph with no repeating structure is one chain of blocks of
    distinct kinds (``Blocks.repeats`` is False). ``fine``: each block cut further at the
    chain cuts inside it (e.g. a transformer block's attention and MLP halves), each piece a
    stage with its own kind. ``cuts``: the chain cuts to use (default `dp.chain_cuts`; the
    pinned graphs of `pinning` give theirs); ``fixed``: see `stage_signature`."""
    names = graph.compute_nodes
    n = len(names)
    pts = [0, *(chain_cuts(graph) if cuts is None else cuts), n]
    labels = [graph.node(x).block for x in names]
    bounds = [c for c in pts[1:-1] if labels[c] != labels[c - 1]]
    spans = list(zip([0, *bounds], [*bounds, n]))
    labelled = [(a, b) for a, b in spans if labels[a] and all(labels[i] for i in range(a, b))]
    hinted = len(labelled) >= 2
    if hinted:
        lo, hi = labelled[0][0], labelled[-1][1]
        roles = [(a, b, BLOCK if (a, b) in labelled else BETWEEN) for a, b in spans
                 if lo <= a and b <= hi]
    else:
        pieces = _pairs(pts)
        at = graph_layout(graph)
        found = _periodic([stage_signature(graph, a, b, fixed, layout=at) for a, b in pieces])
        if found is None:
            roles = [(a, b, BLOCK) for a, b in pieces]
            lo, hi = 0, n
        else:
            i, p, reps = found
            lo, hi = pieces[i][0], pieces[i + p * reps - 1][1]
            roles = [(pieces[i + k * p][0], pieces[i + k * p + p - 1][1], BLOCK)
                     for k in range(reps)]
    if fine:
        inside = set(pts)
        roles = [(x, y, role) for a, b, role in roles
                 for x, y in _pairs([a, *sorted(c for c in inside if a < c < b), b])]
    stages = ([(0, lo, PREFIX)] if lo > 0 else []) + roles + \
        ([(hi, n, SUFFIX)] if hi < n else [])
    return Blocks(_kinds(graph, stages, fixed), hinted)


def _pairs(points: list[int]) -> list[tuple[int, int]]:
    return list(pairwise(points))


def _kinds(graph: CostGraph, stages: list[tuple[int, int, str]],
           fixed: frozenset[str]) -> tuple[Stage, ...]:
    """Stages with kinds: blocks by signature; every other stage a kind of its own."""
    kind_of: dict[str, int] = {}
    at = graph_layout(graph)
    return tuple(Stage(a, b, role, kind_of.setdefault(
        stage_signature(graph, a, b, fixed, layout=at) if role == BLOCK else f"{role}:{i}",
        len(kind_of))) for i, (a, b, role) in enumerate(stages))
