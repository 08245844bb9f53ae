"""Backward replays of nested recompute regions (`Region.inner`), for the simulator.

PyTorch runs a recompute region with inner regions as nested non-reentrant checkpoints
(NOTE [ Nestable Checkpoint ] in ``torch/utils/checkpoint.py``): a saved tensor belongs to
the innermost checkpoint around the op that saved it, and the inputs of an inner checkpoint
are tensors its parent saves. So, with the *direct* nodes of a recompute region X being those
in its inner ``keep`` regions (all its nodes when it has no inner regions):

* Forward keeps only the top region's inputs (the simulator's flat forward, unchanged).
* X is replayed at its first backward unpack, the first backward step of any node in X that
  saves a tensor (an inner region cannot replay before X has given back its inputs). The
  replay runs X's nodes in order, inner recompute regions included (as checkpoints: what
  their nodes save is not kept), and stops where X packs its last tensor: inside its last
  direct saver (`CostGraph.replay_mark`), or as an inner recompute region that reads a value
  from outside itself is entered (its inputs are packed before its body runs), whichever
  is later.
* Each value the replay computes lives until its last reader in the replay (to the end of
  the replay if it is read after X or past the stop); one that a direct node of X saves lives
  until that node's backward step; one that an inner recompute region C with saved tensors
  reads as an input lives until C is replayed (the inner ``keep`` savers' and C's own holds
  still count), and C's replay then gives it the holds of C's direct savers and of C's own
  inner regions, or frees it at its end.
* An inner recompute region is replayed in turn at its own first backward unpack (at the
  same step as X's replay, just after it, when that is where backward first needs it), by
  the same rules, and so on down. A node replayed by several levels pays its forward time
  each time, and each checkpoint entered pays `CostGraph.checkpoint_call_s`.

An inner region counts as packing inputs when one of its nodes reads a compute node outside
it (`Node.inputs`): one reading only graph inputs is taken to pack too, where it is the last
holder, if it reads nothing from outside it, it is taken to pack nothing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from itertools import accumulate

from ..ir.graph import CostGraph
from ..ir.schedule import Region
from .static import Static

__all__ = ["Copy", "InnerReplay", "inner_checkpoints", "replay_nested"]


@dataclass(eq=False)
class Copy:
    """A value a replay computed that an inner recompute region still needs as an input:
    its bytes, the backward step after which its other holders let go (-1: none), and the
    inner regions (by id) whose replays have yet to take it."""

    bytes: int
    sid: int
    hold: int
    waiting: set[int] = field(default_factory=set)


@dataclass(eq=False)
class InnerReplay:
    """An inner recompute region's replay, due before backward step ``step``, with the copies
    of its inputs its parent's replay left for it."""

    region: Region
    step: int
    inputs: list[Copy]


def replay_nested(g: CostGraph, static: Static, r: Region, step: int, inputs: list[Copy]
                  ) -> tuple[float, int, int, list[tuple[int, int]], list[InnerReplay]]:
    """Replay recompute region ``r`` before backward step ``step`` (see the module docstring).

    Returns its time; the highest running total of the bytes it adds and where that total
    ends; the copies it leaves alive, as (the step after which they are freed, bytes); and
    the replays of its inner recompute regions that it makes due (with their inputs).
    ``inputs``: the copies of ``r``'s inputs that its parent's replay left waiting for it.
    """
    pos, done, fwd, times = static.pos, static.done, static.fwd, static.times
    region = set(r.nodes)
    kids = [c for c in r.inner if c.recompute]
    child_of = {n: ci for ci, c in enumerate(kids) for n in c.nodes}
    direct = region - child_of.keys()
    # where the replay stops: (position, how many events of that node run); entering a
    # child that packs inputs stops it before the child's first node
    stop = (-1, 0)
    sets, bursts = [], []
    for c in kids:
        cset = set(c.nodes)
        steps = [static.first_step[n] for n in c.nodes
                 if n in static.has_saved and n in static.first_step]
        sets.append(cset)
        bursts.append(min(steps) if steps else None)
        if any(u not in cset for n in c.nodes for u in g.node(n).inputs):
            stop = max(stop, (pos[c.nodes[0]], 0))
    for n in reversed(r.nodes):
        if n in direct and n in static.has_saved:
            stop = max(stop, (pos[n], static.mark[n]))
            break
    stop_pos, stop_mark = stop
    # the children replayed later (those whose nodes save tensors); the replay keeps the
    # inputs of those it enters for them
    due = [ci for ci in range(len(kids)) if bursts[ci] is not None]
    waiting = [ci for ci in due if pos[kids[ci].nodes[0]] <= stop_pos]
    handed: dict[int, list[Copy]] = defaultdict(list)

    def holds(savers: tuple[str, ...], readers: frozenset[str], inside: int | None
              ) -> tuple[int, bool, list[int]]:
        """Until when the direct savers hold a value, whether they do, and the waiting
        children that read it as an input (``inside``: the child that computed it)."""
        h, held = -1, False
        for m in savers:
            if m in direct:
                held = True
                if done[m] > h:
                    h = done[m]
        return h, held, [ci for ci in waiting
                         if ci != inside and not readers.isdisjoint(sets[ci])]

    t = 0.0
    at_end = 0  # bytes of values alive until the replay ends
    frees: dict[str, int] = defaultdict(int)  # bytes freed after each node's replay
    deltas: list[int] = []  # bytes added by each event, in order
    release: list[tuple[int, int]] = []
    entered: set[int] = set()
    for n in r.nodes:
        p = pos[n]
        if p > stop_pos:
            break
        ci = child_of.get(n)
        if ci is not None and ci not in entered:
            entered.add(ci)
            if p == stop_pos:
                break  # entering it packs the replay's last tensor: its body does not run
            t += g.checkpoint_call_s
        node_events = fwd.get(n, ())
        if p == stop_pos:
            node_events = node_events[:stop_mark]
            if not node_events:
                continue
        t += times[n]
        for alloc, sid, b, savers, inner_free, readers, last in node_events:
            h, held, kw = holds(savers, readers, ci)
            if not alloc:
                if not held and not kw:
                    deltas.append(-b)
                continue
            deltas.append(b)
            if kw:
                copy = Copy(b, sid, h, {id(kids[k]) for k in kw})
                for k in kw:
                    handed[k].append(copy)
            elif held:
                release.append((h, b))
            elif inner_free:
                pass  # freed by its recorded event
            elif last is not None and (pos[last] > stop_pos or not readers <= region):
                at_end += b  # read after the region or past the stop
            else:
                frees[last if last is not None and pos[last] > p else n] += b
        freed = frees.pop(n, 0)
        if freed or not deltas:
            deltas.append(-freed)
    # the inputs its parent's replay left for it: held on by its direct savers and waiting
    # children, else freed after the step's backward or at the end of this replay
    for copy in inputs:
        copy.waiting.discard(id(r))
        st = g.storages[copy.sid]
        h, _, kw = holds(st.savers, static.readers[copy.sid], None)
        copy.hold = max(copy.hold, h)
        for k in kw:
            copy.waiting.add(id(kids[k]))
            handed[k].append(copy)
        if not copy.waiting:
            if copy.hold >= step:
                release.append((copy.hold, copy.bytes))
            else:
                at_end += copy.bytes
    deltas.append(-(at_end + sum(frees.values())))
    later = [InnerReplay(kids[ci], bursts[ci], handed[ci]) for ci in due]
    return t, max(accumulate(deltas)), sum(deltas), release, later


def inner_checkpoints(r: Region) -> int:
    """How many recompute regions ``r`` nests, at every depth (each is a checkpoint call in
    forward)."""
    return sum(x.recompute + inner_checkpoints(x) for x in r.inner)
