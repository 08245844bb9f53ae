"""The cost model: ``simulate(graph, schedule) -> Estimate``, the one source of predictions.

It replays the profiled step the way PyTorch executes it under the schedule:

Forward, node by node: each node's recorded allocations and op-internal frees; then every
storage whose last forward reader has run is freed unless something holds it:

* a node in a ``keep`` region (or the loss) saved it for backward: held until that node's
  backward has run;
* it is an input of a ``recompute`` region (non-reentrant checkpoint keeps the region's inputs):
  held until the last backward step of that region;
* it was allocated by a node in its recompute region's save set (selective checkpoint caches
  every op output of a MUST_SAVE node): held until the region is replayed;
* it is the loss (``graph.meta["loss_node"]``): held until backward ends.

Backward, step by step as recorded (a schedule does not change the order or the gradients):
the first step of a recompute region that unpacks a saved tensor replays the region's forward
up to the moment autograd packs the last tensor the region saves (PyTorch stops recomputation
early there: inside its last saver, before the op whose input that is, or after the op whose
output it is; `CostGraph.replay_mark`), allocating a new copy of each storage it computes;
copies that the region's nodes saved stay alive until their backward step, the rest die at
their last reader in the replay. Then the step's recorded
gradient allocations and frees happen, then the saved storages it was the last holder of die.

Peak bytes are the base (parameters, buffers, inputs) plus the largest live total at any
event. Time is the measured unscheduled step plus the forward time of every replayed node,
plus, for a region with a save set, the selective-checkpoint policy's dispatch cost
(`Node.sac_s`) of its nodes in forward and of its replayed nodes in the replay, plus, for
every recompute region, the checkpoint's own cost (`CostGraph.checkpoint_call_s` for the call
and `CostGraph.checkpoint_saved_s` for each tensor its nodes save for backward).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from itertools import accumulate
from typing import Any

from .graph import CostGraph
from .schedule import RECOMPUTE, Region, Schedule

__all__ = ["Estimate", "RegionCost", "ReplayProbe", "region_costs", "simulate"]


@dataclass(frozen=True)
class Estimate:
    """Predicted cost of one training step under a schedule."""

    peak_bytes: int
    step_s: float
    recompute_s: float
    overhead: float  # recompute_s / unscheduled step time
    forward_peak_bytes: int
    # (label, live bytes) after each forward node, recompute and backward step, for plots
    timeline: tuple[tuple[str, int], ...] = field(default=(), repr=False, compare=False)

    def to_dict(self, *, timeline: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not timeline:
            d.pop("timeline")
        else:
            d["timeline"] = [list(x) for x in self.timeline]
        return d


def simulate(graph: CostGraph, schedule: Schedule, *, timeline: bool = True) -> Estimate:
    """Predict peak memory and step time of ``schedule`` on ``graph``.

    Runs in O(storages + events + nodes) time. Raises `ScheduleError` if the schedule does
    not fit the graph. ``timeline=False`` leaves the estimate's timeline empty (about half
    the time; the numbers are the same).
    """
    schedule.validate(graph)
    return _Sim(graph, schedule, timeline=timeline).run()


def gradient_steps(graph: CostGraph) -> list[tuple[str | None, int | None, int]]:
    """Per backward step, its gradient events (which no schedule changes) folded: (node, the
    highest running total of bytes within the step, the step's net bytes); the total is None
    for a step without events. Computed once per graph."""
    return _Static.of(graph).bwd


def storage_readers(graph: CostGraph) -> dict[int, frozenset[str]]:
    """For each storage id, the nodes that read it: users of its producer's output or of a
    view of it (none for an op-internal storage). Computed once per graph."""
    return _Static.of(graph).readers


class ReplayProbe:
    """Replays of candidate recompute regions on one graph, sharing the setup (for solvers
    that price many regions)."""

    def __init__(self, graph: CostGraph):
        self.sim = _Sim(graph, Schedule.none(graph))
        self.g = graph

    def __call__(self, start: int, stop: int) -> tuple[int | None, int, dict[int, int]]:
        """For a recompute region over ``compute_nodes[start:stop]``: the backward step at which
        it is replayed (None if never), the most bytes its replay adds on top of what was alive
        before it, and the bytes of replayed copies it leaves alive, by the step after which
        they are freed."""
        sim, g = self.sim, self.g
        r = Region(RECOMPUTE, tuple(g.compute_nodes[start:stop]))
        savers = [n for n in r.nodes if g.node(n).saved]
        steps = [sim.first_step[n] for n in savers if n in sim.first_step]
        if not steps:
            return None, 0, {}
        info = {"stop": sim.pos[savers[-1]], "mark": g.replay_mark(savers[-1])}
        _, high, _, frees = sim._replay(r, info, {}, min(steps))
        release: dict[int, int] = defaultdict(int)
        for step, b in frees:
            release[step] += b
        return min(steps), max(high, 0), dict(release)


def region_costs(graph: CostGraph, schedule: Schedule, *, timeline: bool = True
                 ) -> tuple[Estimate, list["RegionCost"]]:
    """`simulate`, plus each region's `RegionCost` (the loss is one more region, last).

    Slower than `simulate` by a factor of the number of regions; used by solvers to compose
    regions on chains. ``timeline=False`` leaves the estimate's timeline empty (faster).
    """
    schedule.validate(graph)
    sim = _Sim(graph, schedule, per_region=True, timeline=timeline)
    est = sim.run()
    return est, sim.region_costs


_REPLAY_MEMO = 500_000  # replays and their frees remembered per graph (some tens of MB at most)


class _Static:
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
        self.replays: dict[tuple, tuple] = {}  # `_Sim._replayed`'s memo
        self.replays_size = 0  # its entries and their frees
        self.full_bounds: dict[int, float] = {}  # `solvers.bound.full_space_bound`, by budget
        self.full_bound_s: dict[int, float] = {}  # ... the time it had (none: `relax`'s)
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
        self.fwd_flat: list[tuple[int, int, bool]] = []
        self.fwd_at = [0]
        for i, name in enumerate(self.names):
            for kind, sid in g.fwd_events.get(name, ()):
                b = g.storages[sid].bytes
                self.fwd_flat.append((sid, b, True) if kind == "a" else (sid, -b, False))
            self.fwd_flat.extend((sid, -g.storages[sid].bytes, False) for sid in last_use[i])
            self.fwd_at.append(len(self.fwd_flat))
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
        # per node (in graph order), the highest running total of its own forward events
        self.fwd_peak: list[int] = []
        for name in self.names:
            run = peak = 0
            for kind, sid in g.fwd_events.get(name, ()):
                run += g.storages[sid].bytes if kind == "a" else -g.storages[sid].bytes
                peak = max(peak, run)
            self.fwd_peak.append(peak)
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
        # the same as `_Mem` events: (bytes, None) for the high point, then for the end
        self.bwd_events: list[list[tuple[int, None]]] = [
            [] if top is None else [(top, None)] if net == top else [(top, None), (net - top, None)]
            for _, top, net in self.bwd]

    @staticmethod
    def of(g: CostGraph) -> "_Static":
        """The cached `_Static` of ``g`` (rebuilt when its nodes, storages or events change:
        the cache holds the very objects it was built from and compares them by identity)."""
        key = (g.nodes, g.storages, g.fwd_events, g.bwd_steps,
               len(g.storages), len(g.bwd_steps), len(g.fwd_events))
        cached = g.__dict__.get("_sim_static")
        if cached is not None:
            old = cached[0]
            if (len(old[0]) == len(g.nodes) and all(map(operator.is_, old[0], g.nodes))
                    and all(a is b for a, b in zip(old[1:4], key[1:4])) and old[4:] == key[4:]):
                return cached[1]
        static = _Static(g)
        g.__dict__["_sim_static"] = ((tuple(g.nodes), *key[1:]), static)
        return static


class _Sim:
    def __init__(self, g: CostGraph, s: Schedule, *, per_region: bool = False,
                 timeline: bool = True):
        self.g = g
        self.per_region = per_region
        self.timeline = timeline
        st = _Static.of(g)
        self.static = st
        self.pos = st.pos
        self.region_of: dict[str, int] = {}
        for ri, r in enumerate(s.regions):
            self.region_of.update(dict.fromkeys(r.nodes, ri))
        self.regions = s.regions
        self.first_step = st.first_step
        self.end_step = st.n_steps - 1

    def run(self) -> Estimate:
        g, static = self.g, self.static
        pos, done, first_step = static.pos, static.done, static.first_step
        regions = self.regions
        R = len(regions)
        # -- per recompute region: saver nodes, replay extent, frame lifetime, burst step ----
        rinfo: dict[int, dict[str, Any]] = {}
        frame_of: dict[str, int] = {}  # node of a recompute region -> the region's frame_end
        has_saved = static.has_saved
        for ri, r in enumerate(regions):
            if not r.recompute:
                continue
            savers = [n for n in r.nodes if n in has_saved]
            if not savers:
                rinfo[ri] = {"savers": [], "burst": None, "frame_end": -1, "stop": -1}
            else:
                steps = [first_step[n] for n in savers if n in first_step]
                burst = min(steps) if steps else None
                frame_end = max(done[n] for n in savers)
                rinfo[ri] = {"savers": savers, "burst": burst, "frame_end": frame_end,
                             "stop": pos[savers[-1]], "mark": static.mark[savers[-1]]}
            frame_of.update(dict.fromkeys(r.nodes, rinfo[ri]["frame_end"]))
        save_nodes = frozenset().union(*(r.save for r in regions))  # only recompute regions'

        # -- when each forward storage is released, and who owns it ---------------------------
        # hold_until[sid]: backward step after which it dies (-1: dies in forward);
        # cached_in[sid]: the recompute region whose save set caches it until the replay.
        # Owners, for per-region accounting: a storage belongs to its producer's region, or to
        # the first later region that reads it (a region input); the loss is region R.
        hold_until: dict[int, int] = {}
        cached_in: dict[int, int] = {}
        owner: dict[int, int] = {}
        phase_of = dict.fromkeys(static.names, R)
        phase_of.update(self.region_of)
        end = self.end_step
        dead: set[int] = set()  # freed in forward: by a recorded event or at its last use
        # step -> the frees after it, as `_Mem` events: (-bytes, owner)
        release: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for sid, b, producer, rdrs, loss_out, savers, before_mark in static.stor:
            h = end if loss_out else -1
            for m in savers:  # saved for backward by a node outside recompute regions
                if m not in frame_of:
                    d = done[m]
                    if d > h:
                        h = d
            pp = first = phase_of[producer]
            for u in rdrs:
                ph = phase_of[u]
                if ph != pp:
                    f = frame_of.get(u)  # an input of another region, a recompute one
                    if f is not None and f > h:
                        h = f
                    if ph > pp and (first == pp or ph < first):
                        first = ph
            owner[sid] = first
            if producer in save_nodes:
                info = rinfo[pp]
                replayed = pos[producer] < info["stop"] or (
                    pos[producer] == info["stop"] and before_mark)
                if info["burst"] is not None and replayed:
                    cached_in[sid] = pp  # until the replay pops it
                    hold_until[sid] = h
                    continue
                h = max(h, info["frame_end"])  # never replayed: held as long as the frame
            hold_until[sid] = h
            if h < 0:
                dead.add(sid)
            else:
                release[h].append((-b, first))
        mem = _Mem(R + 1, track=self.per_region)
        set_phase, add_many = mem.set_phase, mem.add_many
        timeline: list[tuple[str, int]] = []
        keep_timeline = self.timeline

        # -- forward: the events of each run of nodes in one phase (of each node, for the
        # timeline), allocations and the frees of storages nothing holds --------------------
        names, flat, at = static.names, static.fwd_flat, static.fwd_at
        phases = [phase_of[name] for name in names]
        start = 0
        for i in range(1, len(names) + 1):
            if i < len(names) and phases[i] == phases[start] and not keep_timeline:
                continue
            set_phase(phases[start])
            add_many([(b, owner[sid]) for sid, b, alloc in flat[at[start]:at[i]]
                      if alloc or sid in dead])
            if keep_timeline:
                timeline.append((names[start], mem.cur))
            start = i
        fwd_peak = mem.peak

        # -- backward: replays, then each step's gradients and releases (batched by phase) -----
        bursts: dict[int, list[int]] = defaultdict(list)
        for ri, info in rinfo.items():
            if info["burst"] is not None:
                bursts[info["burst"]].append(ri)
        region_s = [0.0] * R
        sac_s = static.sac_s
        call_s, per_saved_s = g.checkpoint_call_s, g.checkpoint_saved_s
        n_saved = static.n_saved
        for ri, r in enumerate(regions):
            if r.recompute and r.save:  # the policy's dispatch mode sees every forward op
                region_s[ri] += sum(sac_s.get(n, 0.0) for n in r.nodes)
            if r.recompute and (call_s or per_saved_s):  # the checkpoint and its hooks
                region_s[ri] += call_s + per_saved_s * sum(n_saved.get(n, 0) for n in r.nodes)
        grads = static.bwd_events
        events: list[tuple[int, int | None]] = []  # of the steps since the last set_phase
        for i, (node, _, _) in enumerate(static.bwd):
            if i in bursts:
                add_many(events)
                events = []
                for ri in bursts[i]:
                    set_phase(ri)
                    t, high, net, frees = self._replayed(regions[ri], rinfo[ri], hold_until, i)
                    region_s[ri] += t
                    # its bytes belong to region ri, the phase: no earlier owner changes, so
                    # the high point and the end stand for all its events (see `_Mem`)
                    add_many([(high, ri)] if net == high else [(high, ri), (net - high, ri)])
                    for h, b in frees:
                        release[h].append((-b, ri))
                    if keep_timeline:
                        timeline.append((f"recompute {regions[ri].nodes[0]}", mem.cur))
            phase = phase_of.get(node, R)
            if phase != mem.phase:
                add_many(events)
                events = []
                set_phase(phase)
            events += grads[i]  # the step's gradients: its high point, then where it ends
            if i in release:
                events += release.pop(i)
            if keep_timeline:
                add_many(events)
                events = []
                timeline.append((f"bwd {node or '<loss>'}", mem.cur))
        add_many(events)

        base = g.base_bytes
        unsched = g.measured_step_s
        recompute_s = sum(region_s)
        self.region_costs = [
            RegionCost(local_peak_bytes=base + mem.local[j], held_bytes=mem.held_lo[j],
                       recompute_s=region_s[j] if j < R else 0.0,
                       separable=mem.held_lo[j] == mem.held_hi[j])
            for j in range(R + 1)] if self.per_region else []
        return Estimate(
            peak_bytes=base + mem.peak,
            step_s=unsched + recompute_s,
            recompute_s=recompute_s,
            overhead=recompute_s / unsched if unsched > 0 else 0.0,
            forward_peak_bytes=base + fwd_peak,
            timeline=tuple((lbl, base + b) for lbl, b in timeline),
        )

    def _replayed(self, r: Region, info: dict[str, Any], hold_until: dict[int, int],
                  step: int) -> tuple[float, int, int, tuple[tuple[int, int], ...]]:
        """`_replay`, remembered per graph: solvers replay the same regions in many schedules.
        What it reads of the schedule besides the region is part of the key."""
        static = self.static
        # for each storage the save set caches, until when something outside the region holds
        # it (-1: nothing does, or it let go already)
        outer = {sid: hold_until[sid] if hold_until[sid] >= step else -1
                 for n in sorted(r.save) for sid in static.allocs.get(n, ())}
        key = (r.nodes[0], len(r.nodes), r.save, step, tuple(outer.values()))
        memo = static.replays
        hit = memo.get(key)
        if hit is None:
            if static.replays_size > _REPLAY_MEMO:
                memo.clear()
                static.replays_size = 0
            hit = memo[key] = self._replay(r, info, outer, step)
            static.replays_size += 1 + len(hit[3])
        return hit

    def _replay(self, r: Region, info: dict[str, Any], outer: dict[int, int], step: int
                ) -> tuple[float, int, int, tuple[tuple[int, int], ...]]:
        """Recompute region ``r`` before backward step ``step`` (its first backward unpack).

        Returns its time; the highest running total of the bytes it adds and where that total
        ends (its events, folded); and the copies it leaves alive, as (the step after which
        they are freed, bytes).

        Non-save nodes allocate new copies; save-set nodes hand over the storages forward
        cached (no allocation, no time). Either way a value then lives until its holders'
        backward if the region's nodes saved it, else until its last reader in the replay, or
        to the end of the replay if it is read only after the region or after the early stop.
        A cached storage that something outside the region holds (``outer``, by storage: until
        when; a later recompute region's input) stays as long as that holder.
        """
        static = self.static
        pos, done, fwd, times, sac_s = (static.pos, static.done, static.fwd, static.times,
                                        static.sac_s)
        stop = info["stop"]
        region = set(r.nodes)
        t = 0.0
        at_end = 0  # bytes of replayed values alive until the replay ends
        frees: dict[str, int] = defaultdict(int)  # bytes freed after each node's replay
        deltas: list[int] = []  # bytes added by each event, in order
        release: list[tuple[int, int]] = []
        for n in r.nodes:
            if pos[n] > stop:
                break  # (the region's nodes run in order)
            cached = n in r.save
            node_events = fwd.get(n, ())
            if pos[n] == stop:
                # the last saver: the replay stops when autograd packs its last saved tensor;
                # its events after that (ops whose inputs it saved, and later ones) never run
                # and their cached outputs are not popped (held to the frame's end)
                node_events = node_events[:info["mark"]]
                if not node_events:
                    continue
            if not cached:
                t += times[n]
            if r.save:  # and in the replay (cached nodes too: their ops are looked up)
                t += sac_s.get(n, 0.0)
            for alloc, sid, b, savers, inner_free, readers, last in node_events:
                # held: the region's nodes saved it, until the last of their backward steps
                held = False
                h = outer[sid] if cached and alloc else -1
                for m in savers:
                    if m in region:
                        held = True
                        if done[m] > h:
                            h = done[m]
                if not alloc:
                    if not held:
                        deltas.append(-b)
                    continue
                if not cached:
                    deltas.append(b)
                if held or h >= 0:
                    release.append((h, b))
                elif inner_free:
                    pass  # freed by its recorded event
                elif last is not None and (pos[last] > stop or not readers <= region):
                    at_end += b  # a region output, or read past the early stop
                else:  # freed after its last reader (n itself if nothing reads it)
                    frees[last if last is not None and pos[last] > pos[n] else n] += b
            freed = frees.pop(n, 0)
            if freed or not deltas:  # (adding 0 changes nothing once something was added)
                deltas.append(-freed)
        deltas.append(-(at_end + sum(frees.values())))
        return t, max(accumulate(deltas)), sum(deltas), tuple(release)


@dataclass(frozen=True)
class RegionCost:
    """One region's share of a step, for solvers that compose regions (see `region_costs`).

    ``local_peak_bytes``: the most bytes alive during the region's forward, replay and
    backward, not counting what earlier regions hold (base bytes included).
    ``held_bytes``: bytes it holds while later regions run. ``separable``: that amount was
    the same at every moment of the later regions (true on chains), so that
    ``peak = max_j (sum(held of earlier regions) + local_peak_j)`` holds exactly.
    """

    local_peak_bytes: int
    held_bytes: int
    recompute_s: float
    separable: bool


class _Mem:
    """Live bytes and their peak; optionally split by owning region, with each region's local
    peak and the range of what it holds while later regions run.

    Equivalent to recording, after every `add`, ``cur - sum(own[:phase])`` into the current
    phase's local peak and ``own[k]`` (every k < phase) into k's held range; done
    incrementally (solvers call it millions of times): the sum of earlier owners is kept for
    the current phase, and ``own[k]`` is recorded when it changes or at a phase's first
    `add`. `add_many` is `add` on each of a list of events in turn, without a call each.

    Events that change no earlier owner (owner None, or not before the phase) record nothing
    in between but the running total, so a run of them acts as two: the highest running total,
    then the rest of the way to where they end (the simulator folds gradient steps and
    replays so)."""

    def __init__(self, n_owners: int, *, track: bool):
        self.cur = 0
        self.peak = 0
        self.phase = 0
        self.track = track
        if track:
            self.own = [0] * n_owners
            self.local = [0] * n_owners
            self.held_lo = [0] * n_owners
            self.held_hi = [0] * n_owners
            self._seen = [False] * n_owners
            self._early = 0  # sum(own[:phase])
            self._fresh = False  # no add yet in this phase

    def set_phase(self, phase: int) -> None:
        if phase != self.phase:
            self.phase = phase
            if self.track:
                self._early = sum(self.own[:phase])
                self._fresh = True

    def _hold(self, k: int) -> None:
        v = self.own[k]
        if not self._seen[k]:
            self.held_lo[k] = self.held_hi[k] = v
            self._seen[k] = True
        elif v < self.held_lo[k]:
            self.held_lo[k] = v
        elif v > self.held_hi[k]:
            self.held_hi[k] = v

    def add(self, b: int, owner: int | None) -> None:
        cur = self.cur = self.cur + b
        if cur > self.peak:
            self.peak = cur
        if not self.track:
            return
        j = self.phase
        if owner is not None:
            self.own[owner] += b
            if owner < j:
                self._early += b
                if not self._fresh:
                    self._hold(owner)
        v = cur - self._early
        if v > self.local[j]:
            self.local[j] = v
        if self._fresh:
            self._fresh = False
            for k in range(j):
                self._hold(k)

    def add_many(self, events: list[tuple[int, int | None]]) -> None:
        """`add(b, owner)` for each ``(b, owner)`` of ``events`` in order."""
        if not events:
            return
        it = iter(events)
        if self.track and self._fresh:
            self.add(*next(it))  # the phase's first add records every earlier owner
        cur, peak = self.cur, self.peak
        if not self.track:
            for b, _ in it:
                cur += b
                if cur > peak:
                    peak = cur
            self.cur, self.peak = cur, peak
            return
        # as `add`, with no fresh phase: every earlier owner was recorded already (seen)
        j = self.phase
        own, lo, hi = self.own, self.held_lo, self.held_hi
        early, top = self._early, self.local[j]
        for b, owner in it:
            cur += b
            if cur > peak:
                peak = cur
            if owner is not None:
                own[owner] += b
                if owner < j:
                    early += b
                    v = own[owner]
                    if v < lo[owner]:
                        lo[owner] = v
                    elif v > hi[owner]:
                        hi[owner] = v
            if cur - early > top:
                top = cur - early
        self.cur, self.peak = cur, peak
        self._early, self.local[j] = early, top
