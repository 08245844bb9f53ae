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
output it is; `CostGraph.replay_mark`), allocating a new copy of each storage it computes; copies that the region's nodes saved stay alive until
their backward step, the rest die at their last reader in the replay. Then the step's recorded
gradient allocations and frees happen, then the saved storages it was the last holder of die.

Peak bytes are the base (parameters, buffers, inputs) plus the largest live total at any
event. Time is the measured unscheduled step plus the forward time of every replayed node,
plus, for a region with a save set, the selective-checkpoint policy's dispatch cost
(`Node.sac_s`) of its nodes in forward and of its replayed nodes in the replay.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
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


def simulate(graph: CostGraph, schedule: Schedule) -> Estimate:
    """Predict peak memory and step time of ``schedule`` on ``graph``.

    Runs in O(storages + events + nodes) time. Raises `ScheduleError` if the schedule does
    not fit the graph.
    """
    schedule.validate(graph)
    return _Sim(graph, schedule).run()


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
        mem = _Mem(1, track=False)
        release: dict[int, list[tuple[int, int]]] = defaultdict(list)
        info = {"stop": sim.pos[savers[-1]], "mark": g.replay_mark(savers[-1])}
        sim._replay(0, r, info, mem, defaultdict(lambda: -1), release, min(steps))
        return min(steps), mem.peak, {k: sum(b for b, _ in v) for k, v in release.items()}


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


class _Static:
    """What the simulator derives from a graph alone (positions, readers, backward steps of
    each node), computed once per graph: solvers simulate thousands of schedules on one."""

    def __init__(self, g: CostGraph):
        self.pos = {n.name: i for i, n in enumerate(g.nodes)}
        self.first_step: dict[str, int] = {}
        self.last_step: dict[str, int] = {}
        for i, st in enumerate(g.bwd_steps):
            if st.node:
                self.first_step.setdefault(st.node, i)
                self.last_step[st.node] = i
        self.n_steps = len(g.bwd_steps)
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
        self.times = {n.name: n.time_s for n in g.nodes}
        self.sac_s = {n.name: n.sac_s for n in g.nodes if n.sac_s}
        # per storage: (id, storage, producer, readers, whether it is the loss's output)
        loss_node = g.meta.get("loss_node")
        self.stor = [(sid, st, st.producer, tuple(self.readers[sid]),
                      st.producer == loss_node and st.output)
                     for sid, st in g.storages.items()]
        # forward events with their bytes: (is allocation, storage id, bytes)
        self.fwd = {name: [(kind == "a", sid, g.storages[sid].bytes) for kind, sid in evs]
                    for name, evs in g.fwd_events.items()}
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

    @staticmethod
    def of(g: CostGraph) -> "_Static":
        """The cached `_Static` of ``g`` (rebuilt when its nodes, storages or events change:
        the cache holds the very objects it was built from and compares them by identity)."""
        key = (g.nodes, g.storages, g.fwd_events, g.bwd_steps,
               len(g.storages), len(g.bwd_steps), len(g.fwd_events))
        cached = g.__dict__.get("_sim_static")
        if cached is not None:
            old = cached[0]
            if (len(old[0]) == len(g.nodes) and all(a is b for a, b in zip(old[0], g.nodes))
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
        self.recompute: dict[int, bool] = {}
        self.save: dict[int, frozenset[str]] = {}
        for ri, r in enumerate(s.regions):
            self.recompute[ri] = r.recompute
            self.save[ri] = r.save
            for n in r.nodes:
                self.region_of[n] = ri
        self.regions = s.regions
        self.n_steps = st.n_steps
        self.first_step = st.first_step
        self.last_step = st.last_step
        self.end_step = self.n_steps - 1

    # -- helpers ---------------------------------------------------------------------------
    def _bwd_done(self, node: str) -> int:
        """Step after which node's saved tensors are released (end if its backward never runs)."""
        return self.last_step.get(node, self.end_step)

    def run(self) -> Estimate:
        g = self.g
        nodes = g.nodes
        # -- per recompute region: saver nodes, replay extent, frame lifetime, burst step ----
        rinfo: dict[int, dict[str, Any]] = {}
        has_saved = self.static.has_saved
        for ri, r in enumerate(self.regions):
            if not r.recompute:
                continue
            savers = [n for n in r.nodes if n in has_saved]
            if not savers:
                rinfo[ri] = {"savers": [], "burst": None, "frame_end": -1, "stop": -1}
                continue
            steps = [self.first_step[n] for n in savers if n in self.first_step]
            burst = min(steps) if steps else None
            frame_end = max(self._bwd_done(n) for n in savers)
            rinfo[ri] = {"savers": savers, "burst": burst, "frame_end": frame_end,
                         "stop": self.pos[savers[-1]], "mark": g.replay_mark(savers[-1])}

        # -- when each forward storage is released -------------------------------------------
        # hold_until[sid]: backward step after which it dies (-1: dies in forward);
        # cached_in[sid]: the recompute region whose save set caches it until the replay
        hold_until: dict[int, int] = {}
        cached_in: dict[int, int] = {}
        region_of, recompute, last_step = self.region_of, self.recompute, self.last_step
        end = self.end_step
        for sid, st, producer, rdrs, loss_out in self.static.stor:
            h = end if loss_out else -1
            for m in st.savers:
                ri = region_of.get(m)
                if ri is None or not recompute[ri]:
                    d = last_step.get(m, end)
                    if d > h:
                        h = d
            prod_r = region_of.get(producer)
            for ri in {region_of.get(u) for u in rdrs}:
                if ri is not None and ri != prod_r and recompute[ri]:
                    h = max(h, rinfo[ri]["frame_end"])
            if (prod_r is not None and recompute[prod_r]
                    and producer in self.save[prod_r]):
                info = rinfo[prod_r]
                replayed = self.pos[producer] < info["stop"] or (
                    self.pos[producer] == info["stop"] and self._before_mark(sid, info))
                if info["burst"] is not None and replayed:
                    cached_in[sid] = prod_r  # until the replay pops it
                else:  # never replayed: the cache lives as long as the region's frame
                    h = max(h, info["frame_end"])
            hold_until[sid] = h

        # -- owners, for per-region accounting: a storage belongs to its producer's region, or
        # to the first later region that reads it (a region input); the loss is region R
        R = len(self.regions)
        phase_of = {n.name: region_of.get(n.name, R) for n in nodes}
        owner: dict[int, int] = {}
        for sid, _, producer, rdrs, _ in self.static.stor:
            pp = phase_of[producer]
            first = pp
            for u in rdrs:
                ph = phase_of[u]
                if ph > pp and (first == pp or ph < first):
                    first = ph
            owner[sid] = first
        mem = _Mem(R + 1, track=self.per_region)

        # -- forward ---------------------------------------------------------------------------
        timeline: list[tuple[str, int]] = []
        keep_timeline = self.timeline
        free_at: dict[int, list[int]] = defaultdict(list)
        for sid, st in g.storages.items():
            if hold_until[sid] < 0 and sid not in cached_in and not st.inner_free:
                free_at[self.pos[st.last_use]].append(sid)
        fwd = self.static.fwd
        add = mem.add
        for i, n in enumerate(nodes):
            mem.set_phase(phase_of[n.name])
            for alloc, sid, b in fwd.get(n.name, ()):
                if alloc:
                    add(b, owner[sid])
                elif hold_until[sid] < 0 and sid not in cached_in:
                    add(-b, owner[sid])
            for sid in free_at.get(i, ()):
                add(-g.storages[sid].bytes, owner[sid])
            if keep_timeline:
                timeline.append((n.name, mem.cur))
        fwd_peak = mem.peak

        # -- backward --------------------------------------------------------------------------
        release: dict[int, list[tuple[int, int]]] = defaultdict(list)  # step -> (bytes, owner)
        for sid, h in hold_until.items():
            if h >= 0 and sid not in cached_in:
                release[h].append((g.storages[sid].bytes, owner[sid]))
        bursts: dict[int, list[int]] = defaultdict(list)
        for ri, info in rinfo.items():
            if info["burst"] is not None:
                bursts[info["burst"]].append(ri)
        region_s = [0.0] * R
        sac_s = self.static.sac_s
        for ri, r in enumerate(self.regions):
            if r.recompute and r.save:  # the policy's dispatch mode sees every forward op
                region_s[ri] += sum(sac_s.get(n, 0.0) for n in r.nodes)
        for i, (node, top, net) in enumerate(self.static.bwd):
            for ri in bursts.get(i, ()):
                mem.set_phase(ri)
                region_s[ri] += self._replay(ri, self.regions[ri], rinfo[ri], mem, hold_until,
                                            release, i)
                if keep_timeline:
                    timeline.append((f"recompute {self.regions[ri].nodes[0]}", mem.cur))
            mem.set_phase(phase_of.get(node, R))
            if top is not None:  # the step's gradients: its high point, then where it ends
                add(top, None)
                if net != top:
                    add(net - top, None)
            for b, o in release.pop(i, ()):
                add(-b, o)
            if keep_timeline:
                timeline.append((f"bwd {node or '<loss>'}", mem.cur))

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

    def readers(self, sid: int) -> frozenset[str]:
        """Nodes that read storage ``sid``: users of its producer's output or of a view of it."""
        return self.static.readers[sid]

    def _before_mark(self, sid: int, info: dict[str, Any]) -> bool:
        """Whether the stopping node of a region allocates storage ``sid`` before the replay
        stops (see `CostGraph.replay_mark`)."""
        st = self.g.storages[sid]
        events = self.g.fwd_events.get(st.producer, ())
        return any(kind == "a" and e == sid for kind, e in events[:info["mark"]])

    def _replay(self, ri: int, r: Region, info: dict[str, Any], mem: "_Mem",
                hold_until: dict[int, int], release: dict[int, list[tuple[int, int]]],
                step: int) -> float:
        """Recompute region ``ri`` before backward step ``step`` (its first backward unpack);
        returns its time.

        Non-save nodes allocate new copies; save-set nodes hand over the storages forward
        cached (no allocation, no time). Either way a value then lives until its holders'
        backward if the region's nodes saved it, else until its last reader in the replay, or
        to the end of the replay if it is read only after the region or after the early stop.
        Replayed copies belong to region ``ri``.
        """
        g = self.g
        stop = info["stop"]
        members = [n for n in r.nodes if self.pos[n] <= stop]
        region = set(r.nodes)
        t = 0.0
        at_end = 0  # bytes of replayed values alive until the replay ends
        frees: dict[str, int] = defaultdict(int)
        fwd, times, sac_s = self.static.fwd, self.static.times, self.static.sac_s
        for n in members:
            cached = n in r.save
            events = fwd.get(n, ())
            if self.pos[n] == stop:
                # the last saver: the replay stops when autograd packs its last saved tensor;
                # its events after that (ops whose inputs it saved, and later ones) never run
                # and their cached outputs are not popped (held to the frame's end)
                events = events[:info["mark"]]
                if not events:
                    continue
            if not cached:
                t += times[n]
            if r.save:  # and in the replay (cached nodes too: their ops are looked up)
                t += sac_s.get(n, 0.0)
            for alloc, sid, _ in events:
                st = g.storages[sid]
                held = [m for m in st.savers if m in region]
                if not alloc:
                    if not held:
                        mem.add(-st.bytes, ri)
                    continue
                if not cached:
                    mem.add(st.bytes, ri)
                # a cached storage that something outside the region holds (a later recompute
                # region's input) stays as long as that holder, unless it let go already
                outer = hold_until[sid] if cached and hold_until[sid] >= step else -1
                if held or outer >= 0:
                    h = max([self._bwd_done(m) for m in held] + [outer])
                    release[h].append((st.bytes, ri))
                elif st.inner_free:
                    pass  # freed by its recorded event
                else:
                    readers = self.readers(sid)
                    if readers - region or any(self.pos[u] > stop for u in readers):
                        at_end += st.bytes  # a region output, or read past the early stop
                    else:
                        last_reader = max(readers | {n}, key=self.pos.__getitem__)
                        frees[last_reader] += st.bytes
            mem.add(-frees.pop(n, 0), ri)
        mem.add(-(at_end + sum(frees.values())), ri)
        return t


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
    `add`."""

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
