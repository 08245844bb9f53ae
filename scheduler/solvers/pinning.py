"""Pinning: block boundaries of models whose layers share tensors made before them.

Hugging Face models trace so that no layer boundary is a chain cut (`dp.chain_cuts`): every
layer reads tensors the prefix made (the attention mask, the rotary cos/sin), and some
storages are read by nodes outside the compute nodes (metadata asserts, the model's
outputs). The lifetime of a shared input depends on the schedule (it lives until the backward
of the earliest recompute region that reads it, or dies at its last forward reader when
nothing saves it), so the block table's costs would not compose. Pinning makes it
schedule-independent.

**Classes.** For the forward storages that cross a block boundary (positions over
``graph.compute_nodes``; a storage spans from its producer to the last compute node that
reads or saves it, or to the end when the loss reads it or its recorded last use is not a
compute node):

* *outputs*: storages whose recorded last use is not a compute node (the simulator frees a
  storage at its recorded last use: such a one lives in forward until then whatever the
  schedule; only compute nodes' savers hold it longer). They are left as they are and not
  counted as crossing.
* *shared inputs*: storages produced in the prefix (before the first labelled block) and
  read or saved in at least two blocks. They are *pinned*.

**The transformation** (`pin`): a copy of the graph (the caller's is not changed) in which
each shared input gets one more saver, an *anchor*: a node outside the compute nodes whose
backward never runs. The simulator holds a storage saved by a node outside every recompute
region until that node's backward has run, which for a node without backward is the end of
backward: so in every schedule a pinned storage lives from its production to the end of the
step. Replays count only the savers inside the replayed region, so they do not change.

**Why it is sound.** For one schedule, the pinned graph's simulation differs from the
original's only in release times: each pinned storage's release moves to the end of
backward (the last step), and a cached copy handed over by a replay is held at least as long
(its holder outside the region now holds it to the end). No allocation moves and none is
added; so at every instant the pinned graph's live bytes are at least the original's, and a
schedule whose pinned peak fits a budget fits it on the original graph. A schedule solved on
the pinned graph has the same node names and fingerprint, so it runs on the original as it
is, and the solver re-simulates it there (`finish`). It is not claimed optimal over any space
(the pinned costs are an upper bound, not the original's).

The cost: each shared input is held for the whole backward (the attention mask, cos and sin:
small next to the activations).
"""

from __future__ import annotations

from dataclasses import replace

from ..cost.simulate import storage_readers
from ..ir.graph import CostGraph
from .base import graph_cache

__all__ = ["Pinned", "block_cuts", "pin", "pinned_of", "shared_inputs"]


class Pinned:
    """A pinned copy of a graph: ``graph`` (the copy, or the original when nothing was
    pinned), ``names`` (producers of the pinned storages), ``anchor`` (their new saver, or
    None), ``cuts`` (`block_cuts` of the copy) and ``fixed`` (the producers and views of
    the pinned storages: the nodes blocks name absolutely, `blocks.stage_signature`)."""

    def __init__(self, graph: CostGraph, names: tuple[str, ...], anchor: str | None,
                 cuts: list[int], fixed: frozenset[str] = frozenset()):
        self.graph, self.names, self.anchor, self.cuts = graph, names, anchor, cuts
        self.fixed = fixed

    @property
    def changed(self) -> bool:
        return bool(self.names)


def _spans(graph: CostGraph) -> tuple[int, dict[int, tuple[int, int]]]:
    """``(n, {storage id: (producer position, last position it is needed)})`` over
    ``graph.compute_nodes`` (see the module docstring; n: the end)."""
    names = graph.compute_nodes
    n = len(names)
    idx = {name: i for i, name in enumerate(names)}
    loss = graph.meta.get("loss_node")
    readers = storage_readers(graph)
    out = {}
    for sid, st in graph.storages.items():
        p = idx.get(st.producer, n)
        used = [idx[r] for r in (*st.savers, *readers[sid]) if r in idx]
        if loss in readers[sid] or loss in st.savers:
            used.append(n)
        out[sid] = (p, max(used, default=p))
    return n, out


def _outputs(graph: CostGraph) -> set[int]:
    """Storages whose recorded last use is not a compute node (outputs, in the module
    docstring)."""
    compute = set(graph.compute_nodes)
    return {sid for sid, st in graph.storages.items()
            if not st.inner_free and st.last_use not in compute}


def _block_starts(graph: CostGraph) -> list[int]:
    """Positions where a labelled block starts (the label changes to a non-empty one)."""
    labels = [graph.node(x).block for x in graph.compute_nodes]
    return [c for c in range(1, len(labels)) if labels[c] and labels[c] != labels[c - 1]]


def shared_inputs(graph: CostGraph) -> list[int]:
    """Ids of the storages made in the prefix and needed by at least two labelled blocks."""
    starts = _block_starts(graph)
    if len(starts) < 2:
        return []
    _, spans = _spans(graph)
    outputs = _outputs(graph)
    return sorted(sid for sid, (p, last) in spans.items()
                  if sid not in outputs and p < starts[0] and last >= starts[1])


def block_cuts(graph: CostGraph, pinned: set[int]) -> list[int]:
    """Positions c (0 < c < n) that at most one forward storage crosses, not counting the
    ``pinned`` storages and the outputs (module docstring)."""
    n, spans = _spans(graph)
    skip = pinned | _outputs(graph)
    delta = [0] * (n + 2)
    for sid, (p, last) in spans.items():
        if sid not in skip and last > p:
            delta[p + 1] += 1
            delta[min(last, n) + 1] -= 1
    cuts, running = [], 0
    for c in range(n):
        running += delta[c]
        if c > 0 and running <= 1:
            cuts.append(c)
    return cuts


def _anchor(graph: CostGraph) -> str | None:
    """A node outside the compute nodes whose backward never runs (the last such)."""
    with_bwd = {s.node for s in graph.bwd_steps}
    compute = set(graph.compute_nodes)
    free = [x.name for x in graph.nodes if x.name not in compute and x.name not in with_bwd]
    return free[-1] if free else None


def pin(graph: CostGraph) -> Pinned:
    """The pinned copy of ``graph`` (module docstring). Nothing is pinned when no storage is
    shared or the graph has no anchor node; then ``graph`` itself is returned."""
    shared = shared_inputs(graph)
    anchor = _anchor(graph) if shared else None
    if not shared or anchor is None:
        return Pinned(graph, (), None, block_cuts(graph, set()))
    storages = dict(graph.storages)
    for sid in shared:
        st = storages[sid]
        storages[sid] = replace(st, savers=(*st.savers, anchor))
    copy = replace(graph, storages=storages)
    names = tuple(dict.fromkeys(graph.storages[sid].producer for sid in shared))
    fixed = frozenset(x for sid in shared for x in (graph.storages[sid].producer,
                                                     *graph.storages[sid].views))
    return Pinned(copy, names, anchor, block_cuts(copy, set(shared)), fixed)


def pinned_of(graph: CostGraph) -> Pinned:
    """`pin` of ``graph``, cached beside it."""
    cache = graph_cache(graph, "pinned")
    if "pinned" not in cache:
        cache["pinned"] = pin(graph)
    return cache["pinned"]
