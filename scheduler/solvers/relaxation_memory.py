"""The memory constraints of the full-space relaxation (`relaxation.Relaxation`), and the
literals they are built from.

With the relaxation's Booleans (``r[p]`` replayed, ``a[s]`` kept, ``link[i]``, ``cached[x]``,
see `relaxation`), every schedule of the full space whose simulated peak fits the budget
satisfies:

* in forward, before each node's events: the storages between their producer and last reader
  (alive in every schedule), the node's own highest running total and the kept storages whose
  last reader ran fit the budget; so do the kept storages when forward ends;
* at a backward step: its gradients (which no schedule changes), the storages some node whose
  backward spans that step saved (alive in every schedule), the kept storages not needed yet,
  forward's copies of storages needed before and again after it (unless their producer
  replays in one region with every later saver, `MemoryConstraints._forward_copy`), cached
  outputs whose region has not replayed yet, and the region inputs still held fit the budget;
  at the first backward step of a saver z, so do the copies that z's region's replay made (a
  storage not kept whose producer is linked to z, needed after that step).

They go in lazily: `SolverConfig.max_steps` of each kind up front (evenly spread over those
no earlier or later one implies), the others when a rounded schedule breaks the budget there
(`Relaxation.violated`, `MemoryConstraints.add`, `relax.relax_and_round`). Leaving one out
only weakens the relaxation. In a lean relaxation, each goes in as a sum built on the largest
one before whose terms are all among its own (`MemoryConstraints._flush`).

A run of linked nodes of any length costs O(log n) literals (`MemoryConstraints._run`:
aligned spans of links); an or of literals is one literal, made once (`_or`).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Any, Callable

from ..cost.simulate import gradient_steps
from ..cost.static import Static
from ..ir.graph import CostGraph
from .config import SolverConfig

__all__ = ["MemoryConstraints"]


class MemoryConstraints:
    """The memory constraints of `relaxation.Relaxation` and the literals they use; the
    model, its variables and the facts below are made by `Relaxation.__init__`."""

    g: CostGraph
    config: SolverConfig
    static: Static
    m: Any  # the CP-SAT model
    lean: bool
    room: int  # the budget less the graph's base bytes
    at: dict[str, int]  # compute node -> position
    replayed: dict[str, Any]
    cached: dict[str, Any]
    link: list[Any]
    kept: dict[int, Any]
    # (storage, literal: held as a region's input, until which backward step)
    inputs: list[tuple[int, Any, int]]
    windows: dict[int, list[tuple[int, int]]]
    first_need: dict[int, int]
    regenerable: list[tuple[int, str, list[str]]]
    cached_out: list[tuple[int, str]]
    pending: dict[tuple[str, int], Callable[[], None]]
    built: dict[tuple[str, int], Callable[[], None]]
    _up_front: bool

    def __init__(self) -> None:
        self._ors: dict[tuple[int, ...], Any] = {}  # `_or`'s literals, by their operands
        # `_cached_alive`'s: savers by step, its literals
        self._early: dict[int, list[int]] = {}
        self._alive: dict[tuple[str, tuple[int, ...]], Any] = {}
        self._runs: dict[tuple[int, int], Any] = {}  # `_run`'s literals
        self._spans: dict[tuple[int, int], Any] = {}  # `_span`'s literals
        self._copies: dict[tuple[int, int], Any] = {}  # `_forward_copy`'s literals
        # `_fits`'s constraints not in the model yet (room, terms by literal index), and those
        # in it: (terms, their sum's variable, its largest value)
        self._batch: list[tuple[int, dict[int, list[Any]]]] = []
        self._sums: list[tuple[frozenset[tuple[int, int]], Any, int]] = []

    def add(self, labels: list[tuple[str, int]]) -> int:
        """Put the pending memory constraints ``labels`` in the model; returns how many were
        pending."""
        added = 0
        for label in labels:
            build = self.pending.pop(label, None)
            if build is not None:
                build()
                self.built[label] = build
                added += 1
        self._flush()
        return added

    def tighten(self, over: list[tuple[int, tuple[str, int]]]) -> int:
        """For each (bytes, label) of ``over``: the memory constraint ``label`` (pending or
        not; holding everything) again, with that many bytes less room. These are cuts that
        steer the rounded schedules under the budget where the relaxation leaves something out
        (transient replay peaks); the model no longer bounds the budget. Returns how many went
        in."""
        added = 0
        for by, label in over:
            build = self.pending.pop(label, None) or self.built.get(label)
            if build is None:
                continue
            self.room -= by
            try:
                build()
            finally:
                self.room += by
            self.built[label] = build
            added += 1
        self._flush()
        return added

    def keep(self, sid: int) -> Any:
        """``a[sid]``, made on first use."""
        if sid not in self.kept:
            self.kept[sid] = self.m.NewBoolVar(f"a_{sid}")
        return self.kept[sid]

    def _fits(self, const: int, terms: list[tuple[int, Any]]) -> None:
        """``const`` plus the bytes of the true literals of ``terms`` fit the room (as it is
        now); `_flush` puts it in the model."""
        if const > self.room:
            self.m.AddBoolOr([])  # nothing fits
            return
        merged: dict[int, list[Any]] = {}  # literal index -> [bytes, literal]
        for b, v in terms:
            if b:
                merged.setdefault(v.Index(), [0, v])[0] += b
        if merged:
            self._batch.append((self.room - const, merged))

    def _flush(self) -> None:
        """The memory constraints `_fits` collected; in a lean relaxation, as sums that build
        on each other: smallest first, each is the largest one put in before whose terms are
        all among its own, plus the rest. Consecutive forward nodes and backward steps hold
        nearly the same storages, so this about halves the terms a large model carries and
        CP-SAT solves it sooner. (A full relaxation's constraints go in each on its own: its
        later solves, with the constraints a rounded schedule broke, were slower chained.)"""
        batch, self._batch = self._batch, []
        chained = self.lean
        for cap, merged in sorted(batch, key=lambda t: len(t[1])):
            keys = frozenset((i, b) for i, (b, _) in merged.items())
            base = None
            if chained:
                for sums in reversed(self._sums):
                    if len(sums[0]) <= len(keys) and sums[0] <= keys and (
                            base is None or len(sums[0]) > len(base[0])):
                        base = sums
            rest = keys - base[0] if base else keys
            total = (base[2] if base else 0) + sum(b for _, b in rest)
            expr = sum(b * merged[i][1] for i, b in rest)
            if base is not None:
                expr = base[1] + expr
            if total <= cap:
                continue  # (it holds whatever the literals are)
            if not chained:
                self.m.Add(expr <= cap)
                continue
            v = self.m.NewIntVar(0, cap, "")
            self.m.Add(v == expr)
            self._sums.append((keys, v, total))

    def _forward(self) -> None:
        """Forward: before each node's events (see the module docstring). Along forward only
        the kept part grows, so a node gets a constraint only when its constant part is above
        every later node's (at most `SolverConfig.max_steps`)."""
        g, pos, fwd_peak = self.g, self.static.pos, self.static.fwd_peak
        loss = g.meta.get("loss_node")
        enter: dict[int, list[int]] = defaultdict(list)
        leave: dict[int, list[int]] = defaultdict(list)
        temps: dict[int, list[int]] = defaultdict(list)  # op temporaries, after their op
        for sid, st in g.storages.items():
            p = pos[st.producer]
            if st.inner_free:  # (alive after it only when a save set caches it)
                temps[p + 1].append(sid)
                continue
            enter[p + 1].append(sid)
            leave[max(pos[st.last_use], p) + 1].append(sid)
        const, tops, gone = 0, [], []
        for i in range(len(g.nodes)):
            const += sum(g.storages[sid].bytes for sid in enter.get(i, ()))
            gone += temps.get(i, ())
            for sid in leave.get(i, ()):
                st = g.storages[sid]
                if not (st.output and st.producer == loss):  # the loss's output stays
                    const -= st.bytes
                    gone.append(sid)
            tops.append((const, fwd_peak[i], len(gone)))
        for i, (const, peak, n_gone) in enumerate(tops):
            self.pending[("fwd", i)] = self._forward_fits(const + peak, gone, n_gone)
        needed, later = [], None
        for i in range(len(tops) - 1, -1, -1):
            top = tops[i][0] + tops[i][1]
            if later is None or top > later:
                needed.append(i)
                later = top
        self.add([("fwd", i) for i in _spread(needed, self.config.max_steps,
                                                     key=lambda i: sum(tops[i][:2]))])

    def _forward_fits(self, top: int, gone: list[int], n_gone: int) -> Callable[[], None]:
        """The constraint at a forward node: ``top`` and the kept of ``gone[:n_gone]``."""
        return lambda: self._fits(top, self._stored(gone[:n_gone]))

    def _stored(self, sids: list[int]) -> list[tuple[int, Any]]:
        """(bytes, literal) of those of ``sids`` kept from forward or held as a region's input
        (from forward to backward): alive once their last reader ran."""
        held: dict[int, list[Any]] = defaultdict(list)
        for sid, v in self.kept.items():
            held[sid].append(v)
        for sid, inp, _ in self.inputs:
            held[sid].append(inp)
        return [(self.g.storages[sid].bytes, self._or(held[sid])) for sid in dict.fromkeys(sids)
                if held.get(sid)]

    def _backward(self) -> None:
        """Backward steps (see the module docstring): those whose constant part exceeds every
        earlier step's (later ones need no more of the kept storages), and the first steps of
        savers, for replay bursts (at most `SolverConfig.max_steps` each)."""
        g, static = self.g, self.static
        starts: dict[int, list[int]] = defaultdict(list)
        ends: dict[int, list[int]] = defaultdict(list)
        for sid, ws in self.windows.items():
            for f, d in ws:
                starts[f].append(sid)
                ends[d].append(sid)
        needed: dict[int, int] = defaultdict(int)  # storage -> windows open now
        needed_bytes, grads, best = 0, 0, -1
        consts: list[int] = []
        higher: list[tuple[int, int]] = []  # (step, constant part)
        for k, (_, top, net) in enumerate(gradient_steps(g)):
            for sid in starts[k]:
                needed[sid] += 1
                if needed[sid] == 1:
                    needed_bytes += g.storages[sid].bytes
            const = grads + (top or 0) + needed_bytes
            consts.append(const)
            if const > best:
                best = const
                higher.append((k, const))
            grads += net
            for sid in ends[k]:
                needed[sid] -= 1
                if needed[sid] == 0:
                    needed_bytes -= g.storages[sid].bytes
        for k, const in enumerate(consts):
            self.pending[("bwd", k)] = self._step_fits(k, const)
        bursts = sorted({static.first_step[z] for z in static.has_saved
                         if z in static.first_step and z in self.at})
        for k in bursts:
            self.pending[("burst", k)] = self._burst_fits(k, consts[k])
        self.add([("bwd", k) for k, _ in _spread(higher, self.config.max_steps, key=lambda t: t[1])])
        if not self.lean:
            self.add([("burst", k) for k, _ in _spread([(k, consts[k]) for k in bursts],
                                                       self.config.max_steps, key=lambda t: t[1])])

    def _step_fits(self, k: int, const: int) -> Callable[[], None]:
        return lambda: self._fits(const, self._held(k))

    def _burst_fits(self, k: int, const: int) -> Callable[[], None]:
        return lambda: self._burst(k, const)

    def _held(self, k: int) -> list[tuple[int, Any]]:
        """(bytes, literal) of the storages alive at step k that its constant part leaves out:
        kept and not needed yet, or held as a region's input until then (one literal each)."""
        lits: dict[int, list[Any]] = defaultdict(list)
        for sid, v in self.kept.items():
            if self.first_need.get(sid, -1) > k:
                lits[sid].append(v)
        for sid, inp, until in self.inputs:
            if until >= k and not self._needed(sid, k):
                lits[sid].append(inp)
        if self.lean and self._up_front:
            return [(self.g.storages[sid].bytes, self._or(ls)) for sid, ls in lits.items()]
        for sid in self.kept:
            if sid in self.windows and self.first_need[sid] <= k and not self._needed(sid, k):
                copy = self._forward_copy(sid, k)
                if copy is not None:
                    lits[sid].append(copy)
        for sid, x in self.cached_out:
            if self.first_need.get(sid, -1) > k or self._needed(sid, k):
                continue  # (counted already)
            alive = self._cached_alive(x, k)
            if alive is not None:
                lits[sid].append(alive)
        return [(self.g.storages[sid].bytes, self._or(ls)) for sid, ls in lits.items()]

    def _needed(self, sid: int, k: int) -> bool:
        """Whether a saver of storage sid needs it at step k (its constant part counts it)."""
        return any(f <= k <= d for f, d in self.windows.get(sid, ()))

    def _forward_copy(self, sid: int, k: int) -> Any:
        """For a storage some saver needed before step k and another needs after it: a
        literal true when forward's copy is alive at k, or None when no saver needs it after
        k. It is, unless its producer replays in one region with every such saver (the
        nearest is the producer or after it: replays remake it for them); a saver outside
        the compute nodes (the loss) keeps it."""
        static, at = self.static, self.at
        st = self.g.storages[sid]
        later = [z for z in st.savers if static.first_step.get(z, -1) > k]
        if not later:
            return None
        if any(z not in at for z in later):
            return self.keep(sid)  # (kept: `__init__`)
        p, far = at[st.producer], max(at[z] for z in later)
        key = (sid, far)
        if key not in self._copies:
            remade = self.m.NewBoolVar("")
            self.m.AddImplication(remade, self.replayed[st.producer])
            if far > p:
                self.m.AddImplication(remade, self._run(p, far))
            self._copies[key] = remade.Not()
        return self._copies[key]

    def _cached_alive(self, x: str, k: int) -> Any:
        """A literal true when cached node x's outputs are still held at step k: until its
        region's replay, at the first backward step of any of the region's savers. So they
        are, unless x's linked run reaches a saver whose backward starts at k or before (the
        nearest such on either side); None when x itself is one."""
        m, at = self.m, self.at
        early = self._early.get(k)
        if early is None:
            static = self.static
            early = self._early[k] = sorted(
                at[z] for z in static.has_saved
                if z in at and static.first_step.get(z, k + 1) <= k)
        i = at[x]
        j = bisect.bisect_left(early, i)
        if j < len(early) and early[j] == i:
            return None
        reach = []
        if j:
            reach.append(self._run(early[j - 1], i))
        if j < len(early):
            reach.append(self._run(i, early[j]))
        if not reach:
            return self.cached[x]
        key2 = (x, tuple(v.Index() for v in reach))
        if key2 not in self._alive:
            v = self._alive[key2] = m.NewBoolVar("")
            m.AddBoolOr([v, self.cached[x].Not(), *reach])
        return self._alive[key2]

    def _run(self, p: int, j: int) -> Any:
        """A literal that implies that nodes p..j (positions, p < j) are linked, each to its
        predecessor: it implies the literals of the few aligned spans of links (`_span`) that
        make up links p+1..j, so that a run costs O(log n) however long it is."""
        key = (p, j)
        if key not in self._runs:
            v = self._runs[key] = self.m.NewBoolVar(f"run_{p}_{j}")
            lo, hi = p + 1, j + 1  # links lo .. hi-1
            while lo < hi:
                level = 0
                while lo % (2 << level) == 0 and lo + (2 << level) <= hi:
                    level += 1
                self.m.AddImplication(v, self._span(level, lo >> level))
                lo += 1 << level
        return self._runs[key]

    def _span(self, level: int, k: int) -> Any:
        """A literal that implies links k*2**level .. (k+1)*2**level - 1 (level 0: the link)."""
        if level == 0:
            return self.link[k]
        key = (level, k)
        if key not in self._spans:
            v = self._spans[key] = self.m.NewBoolVar(f"span_{level}_{k}")
            self.m.AddImplication(v, self._span(level - 1, 2 * k))
            self.m.AddImplication(v, self._span(level - 1, 2 * k + 1))
        return self._spans[key]

    def _or(self, lits: list[Any]) -> Any:
        if len(lits) == 1:
            return lits[0]
        ors = self._ors
        key = tuple(sorted(x.Index() for x in lits))
        if key not in ors:
            v = ors[key] = self.m.NewBoolVar("")
            for x in lits:
                self.m.AddImplication(x, v)
        return ors[key]

    def _burst(self, k: int, const: int) -> None:
        """At step k, the first backward step of saver z: a storage not kept whose producer
        shares z's region (every node between them linked) was remade by the region's replay,
        at k or before, and lives until its savers' backward: if none comes before k, its copy
        is alive at k besides what `_held` counts."""
        m, link, at = self.m, self.link, self.at
        z = at[self.g.bwd_steps[k].node]
        later = [(sid, at[p]) for sid, p, _ in self.regenerable
                 if self.first_need[sid] > k and abs(at[p] - z) <= self.config.link_span]
        if not later:
            return
        same: dict[int, Any] = {z: None}  # node i shares z's region (forced; None: z itself)

        def shares(edge: Any, nearer: Any) -> Any:  # linked to a node that shares it
            v = m.NewBoolVar("")
            m.AddBoolOr([v, edge.Not(), *([] if nearer is None else [nearer.Not()])])
            return v

        for i in range(z - 1, min(q for _, q in later) - 1, -1):
            same[i] = shares(link[i + 1], same[i + 1])
        for i in range(z + 1, max(q for _, q in later) + 1):
            same[i] = shares(link[i], same[i - 1])
        terms = self._held(k)
        for sid, q in later:
            c = m.NewBoolVar("")
            m.AddBoolOr([c, self.keep(sid), *([] if same[q] is None else [same[q].Not()])])
            terms.append((self.g.storages[sid].bytes, c))
        self._fits(const, terms)


def _spread(items: list[Any], most: int, *, key: Callable[[Any], int]) -> list[Any]:
    """At most ``most`` of ``items``, evenly spread, the highest by ``key`` among them."""
    if len(items) <= most:
        return items
    top = max(range(len(items)), key=lambda i: key(items[i]))
    picked = {int(i * len(items) / most) for i in range(most - 1)}
    return [items[i] for i in sorted(picked | {top})]
