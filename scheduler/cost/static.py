"""What the simulator derives from a graph alone (positions, readers, backward steps of each
node, the forward's events in order), computed once per graph and shared by the simulator and
the solvers, which price thousands of schedules on one graph."""

from __future__ import annotations

import operator
import weakref
from collections import defaultdict
from typing import Any

from ..ir.graph import CostGraph

__all__ = ["REPLAY_MEMO", "Static"]

REPLAY_MEMO = 500_000  # replays and their frees remembered per graph (some tens of MB at most)


class Static:
    """What the simulator derives from a graph alone (positions, readers, backward steps of
    each node), computed once per graph: solvers simulate thousands of schedules on one."""

    def __init__(self, g: CostGraph):
        self.names = [n.name for n in g.nodes]
        self.pos = {name: i for i, name in enumerate(self.names)}
        self.first_step: dict[str, int] = {}
        self.last_step: dict[str, int] = {}
        for i, st in enumerate(g.bwd_steps):
            if st.node:
                self.first_step.setdefault(st.node, i)
                self.last_step[st.node] = i
        self.n_steps = len(g.bwd_steps)
        # per node: the step after which its saved tensors are released (the last step if its
        # backward never runs)
        self.done = {name: self.last_step.get(name, self.n_steps - 1) for name in self.names}
        users: dict[str, list[str]] = defaultdict(list)
        for n in g.nodes:
            for u in n.inputs:
                users[u].append(n.name)
        # readers of each storage (nodes reading the producer's output or one of its views)
        self.readers: dict[int, frozenset[str]] = {}
        for sid, st in g.storages.items():
            out: set[str] = set()
            if st.output:
                out.update(users.get(st.producer, ()))
                for v in st.views:
                    out.update(users.get(v, ()))
            self.readers[sid] = frozenset(out)
        self.has_saved = frozenset(n.name for n in g.nodes if n.saved)
        self.n_saved = {n.name: len(n.saved) for n in g.nodes if n.saved}
        self.allocs = {name: [sid for kind, sid in evs if kind == "a"]
                       for name, evs in g.fwd_events.items()}
        self.replays: dict[tuple, tuple] = {}  # `Simulator._replayed`'s memo
        self.replays_size = 0  # its entries and their frees
        self.mark = {name: g.replay_mark(name) for name in self.has_saved}
        self.times = {n.name: n.time_s for n in g.nodes}
        self.sac_s = {n.name: n.sac_s for n in g.nodes if n.sac_s}
        # per storage: (id, bytes, producer, readers, whether it is the loss's output, savers,
        # whether a replay that stops at its producer allocates it, see `CostGraph.replay_mark`)
        loss_node = g.meta.get("loss_node")
        self.stor = []
        last_use: dict[int, list[int]] = defaultdict(list)  # node position -> storages
        for sid, st in g.storages.items():
            mark = self.mark.get(st.producer, 0)
            before_mark = any(kind == "a" and e == sid
                              for kind, e in g.fwd_events.get(st.producer, ())[:mark])
            self.stor.append((sid, st.bytes, st.producer, tuple(self.readers[sid]),
                              st.producer == loss_node and st.output, st.savers, before_mark))
            if not st.inner_free:
                last_use[self.pos[st.last_use]].append(sid)
        # the forward's events, node after node, as (storage id, bytes added, is allocation):
        # each node's recorded allocations and frees, then a free of every storage it is the
        # last reader of (not op temporaries); under a schedule, frees happen only for the
        # storages nothing holds. Node i's events are fwd_flat[fwd_at[i]:fwd_at[i + 1]]
        # The engine's bytes (`CostGraph.engine_bytes`) come first: its change and spike, as
        # storage -1 (allocations, of negative bytes for a drop, so that they always apply).
        self.fwd_flat: list[tuple[int, int, bool]] = []
        self.fwd_at = [0]
        engine = [g.engine_bytes.get(name, (0, 0))[0] for name in self.names]
        spike = [g.engine_bytes.get(name, (0, 0))[1] for name in self.names]
        for i, name in enumerate(self.names):
            change = engine[i] - (engine[i - 1] if i else 0)
            if change or spike[i]:
                self.fwd_flat.append((-1, change + spike[i], True))
            if spike[i]:
                self.fwd_flat.append((-1, -spike[i], True))
            for kind, sid in g.fwd_events.get(name, ()):
                b = g.storages[sid].bytes
                self.fwd_flat.append((sid, b, True) if kind == "a" else (sid, -b, False))
            self.fwd_flat.extend((sid, -g.storages[sid].bytes, False) for sid in last_use[i])
            if i == len(self.names) - 1 and engine[i]:  # (backward's events hold its own)
                self.fwd_flat.append((-1, -engine[i], True))
            self.fwd_at.append(len(self.fwd_flat))
        self.engine = engine
        # per node, its forward events for replays: (is allocation, storage id, bytes, savers,
        # inner_free, readers, the last reader or None)
        self.fwd: dict[str, list[tuple[bool, int, int, tuple[str, ...], bool, frozenset[str],
                                       str | None]]] = {}
        for name, evs in g.fwd_events.items():
            self.fwd[name] = []
            for kind, sid in evs:
                st, rdrs = g.storages[sid], self.readers[sid]
                last = max(rdrs, key=self.pos.__getitem__) if rdrs else None
                self.fwd[name].append((kind == "a", sid, st.bytes, st.savers, st.inner_free,
                                       rdrs, last))
        # per node (in graph order), the highest running total of its own forward events, on
        # top of the engine's bytes while it runs
        self.fwd_peak: list[int] = []
        for i, name in enumerate(self.names):
            run = peak = 0
            for kind, sid in g.fwd_events.get(name, ()):
                run += g.storages[sid].bytes if kind == "a" else -g.storages[sid].bytes
                peak = max(peak, run)
            self.fwd_peak.append(engine[i] + max(peak, spike[i]))
        # each backward step's gradient events, which no schedule changes, as (node, the
        # highest running total within the step, the step's net bytes); None: no events
        self.bwd: list[tuple[str | None, int | None, int]] = []
        gid_bytes: dict[int, int] = {}
        for step in g.bwd_steps:
            cur, top = 0, None
            for kind, gid, b in step.events:
                if kind == "a":
                    gid_bytes[gid] = b
                    cur += b
                else:
                    cur -= gid_bytes.pop(gid, 0)
                top = cur if top is None or cur > top else top
            self.bwd.append((step.node, top, cur))
        # the same as `LiveBytes` events: (bytes, None) for the high point, then for the end
        self.bwd_events: list[list[tuple[int, None]]] = [
            [] if top is None else [(top, None)] if net == top else [(top, None), (net - top, None)]
            for _, top, net in self.bwd]

    @staticmethod
    def of(g: CostGraph) -> "Static":
        """The cached `Static` of ``g`` (rebuilt when its nodes, storages or events change:
        the cache holds the very objects it was built from and compares them by identity). The
        cache lives beside the graph, not on it, and goes with it."""
        key = (g.nodes, g.storages, g.fwd_events, g.bwd_steps,
               len(g.storages), len(g.bwd_steps), len(g.fwd_events))
        cached = _CACHE.get(id(g))
        if cached is not None and cached[0]() is g:
            old = cached[1]
            if (len(old[0]) == len(g.nodes) and all(map(operator.is_, old[0], g.nodes))
                    and all(a is b for a, b in zip(old[1:4], key[1:4])) and old[4:] == key[4:]):
                return cached[2]
        static = Static(g)
        if cached is None or cached[0]() is not g:
            weakref.finalize(g, _CACHE.pop, id(g), None)
        _CACHE[id(g)] = (weakref.ref(g), (tuple(g.nodes), *key[1:]), static)
        return static


#: graph id -> (a weak reference to the graph, what its `Static` was built from, the `Static`)
_CACHE: dict[int, tuple[Any, tuple, Static]] = {}
