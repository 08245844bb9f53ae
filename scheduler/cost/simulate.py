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
A region with inner regions (nested checkpoints) runs forward as a flat one and is replayed
level by level (`nested`).
"""

from __future__ import annotations

from collections import defaultdict
from itertools import accumulate
from typing import Any

from ..ir.graph import CostGraph
from ..ir.schedule import RECOMPUTE, Region, Schedule
from . import static as _static_mod
from .estimate import Estimate, RegionCost
from .memory import LiveBytes
from .nested import InnerReplay, inner_checkpoints, replay_nested
from .static import Static

__all__ = ["Estimate", "RegionCost", "ReplayProbe", "Simulator", "gradient_steps", "region_costs",
           "simulate", "storage_readers"]


def simulate(graph: CostGraph, schedule: Schedule, *, timeline: bool = True) -> Estimate:
    """Predict peak memory and step time of ``schedule`` on ``graph``.

    Runs in O(storages + events + nodes) time. Raises `ScheduleError` if the schedule does
    not fit the graph. ``timeline=False`` leaves the estimate's timeline empty (about half
    the time; the numbers are the same).
    """
    schedule.validate(graph)
    return Simulator(graph, schedule, timeline=timeline).run()


def gradient_steps(graph: CostGraph) -> list[tuple[str | None, int | None, int]]:
    """Per backward step, its gradient events (which no schedule changes) folded: (node, the
    highest running total of bytes within the step, the step's net bytes); the total is None
    for a step without events. Computed once per graph."""
    return Static.of(graph).bwd


def storage_readers(graph: CostGraph) -> dict[int, frozenset[str]]:
    """For each storage id, the nodes that read it: users of its producer's output or of a
    view of it (none for an op-internal storage). Computed once per graph."""
    return Static.of(graph).readers


class ReplayProbe:
    """Replays of candidate recompute regions on one graph, sharing the setup (for solvers
    that price many regions)."""

    def __init__(self, graph: CostGraph):
        self.sim = Simulator(graph, Schedule.none(graph))
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


def region_costs(graph: CostGraph, schedule: Schedule, *, timeline: bool = True,
                 last_owned: frozenset[int] = frozenset()
                 ) -> tuple[Estimate, list["RegionCost"]]:
    """`simulate`, plus each region's `RegionCost` (the loss is one more region, last).

    Slower than `simulate` by a factor of the number of regions; used by solvers to compose
    regions on chains. ``timeline=False`` leaves the estimate's timeline empty (faster).
    Storages in ``last_owned`` belong to the last region that reads them (see `Simulator`).
    """
    schedule.validate(graph)
    sim = Simulator(graph, schedule, per_region=True, timeline=timeline,
                    last_owned=last_owned)
    est = sim.run()
    return est, sim.region_costs

class Simulator:
    """One simulation of a schedule on a graph (see the module docstring); `run` gives its
    `Estimate`, and with ``per_region`` each region's `RegionCost` in ``region_costs``."""

    def __init__(self, g: CostGraph, s: Schedule, *, per_region: bool = False,
                 timeline: bool = True, last_owned: frozenset[int] = frozenset()):
        self.g = g
        self.last_owned = last_owned
        self.per_region = per_region
        self.timeline = timeline
        st = Static.of(g)
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
        # the first later region that reads it (a region input; the last, those in
        # ``last_owned``: `chain`'s tracked anchors); the loss is region R.
        hold_until: dict[int, int] = {}
        cached_in: dict[int, int] = {}
        owner: dict[int, int | None] = {-1: None}  # (-1: the engine's bytes, `Static`)
        phase_of = dict.fromkeys(static.names, R)
        phase_of.update(self.region_of)
        end = self.end_step
        dead: set[int] = set()  # freed in forward: by a recorded event or at its last use
        last_inside = max((pos[x] for x in self.region_of), default=-1)
        # step -> the frees after it, as `LiveBytes` events: (-bytes, owner)
        release: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for sid, b, producer, rdrs, loss_out, savers, before_mark in static.stor:
            h = end if loss_out else -1
            for m in savers:  # saved for backward by a node outside recompute regions
                if m not in frame_of:
                    d = done[m]
                    if d > h:
                        h = d
            pp = first = phase_of[producer]
            latest = sid in self.last_owned
            for u in rdrs:
                ph = phase_of[u]
                if ph != pp:
                    f = frame_of.get(u)  # an input of another region, a recompute one
                    if f is not None and f > h:
                        h = f
                    # (a node outside the regions amid them, e.g. an export's metadata
                    # assert, owns nothing: ownership is accounting only, never a peak)
                    if ph > pp and (first == pp or (ph > first if latest else ph < first)
                                    ) and (ph < R or pos[u] > last_inside):
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
        mem = LiveBytes(R + 1, track=self.per_region)
        set_phase, add_many = mem.set_phase, mem.add_many
        timeline: list[tuple[str, int]] = []
        keep_timeline = self.timeline

        # -- forward: the events of each run of nodes in one phase (of each node, for the
        # timeline), allocations and the frees of storages nothing holds --------------------
        names, flat, at = static.names, static.fwd_flat, static.fwd_at
        phases = [phase_of[name] for name in names]
        # nodes outside the regions but before the last region node (metadata asserts, index
        # ops of an exported graph) count in the phase of the region before them (the first
        # for those before it): the phase is accounting only, never a peak or a hold
        inside = [i for i, name in enumerate(names) if name in self.region_of]
        if inside:
            for i in range(inside[-1]):
                if names[i] not in self.region_of:
                    phases[i] = phases[i - 1] if i > 0 and i > inside[0] else phases[inside[0]]
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
        bursts: dict[int, list[Any]] = defaultdict(list)
        for ri, info in rinfo.items():
            if info["burst"] is not None:
                r = regions[ri]
                bursts[info["burst"]].append(
                    (ri, InnerReplay(r, info["burst"], [])) if r.inner else ri)
        region_s = [0.0] * R
        sac_s = static.sac_s
        call_s, per_saved_s = g.checkpoint_call_s, g.checkpoint_saved_s
        n_saved = static.n_saved
        for ri, r in enumerate(regions):
            if r.recompute and r.save:  # the policy's dispatch mode sees every forward op
                region_s[ri] += sum(sac_s.get(n, 0.0) for n in r.nodes)
            if r.recompute and (call_s or per_saved_s):  # the checkpoints (nested ones too)
                region_s[ri] += (call_s * (1 + inner_checkpoints(r))
                                 + per_saved_s * sum(n_saved.get(n, 0) for n in r.nodes))
        grads = static.bwd_events
        events: list[tuple[int, int | None]] = []  # of the steps since the last set_phase
        for i, (node, _, _) in enumerate(static.bwd):
            if i in bursts:
                add_many(events)
                events = []
                for ri in bursts[i]:  # (nested replays append their inner ones: `nested`)
                    if isinstance(ri, int):
                        r, (t, high, net, frees) = regions[ri], self._replayed(
                            regions[ri], rinfo[ri], hold_until, i)
                    else:
                        ri, job = ri
                        r, (t, high, net, frees, later) = job.region, replay_nested(
                            g, static, job.region, i, job.inputs)
                        for inner in later:
                            bursts[inner.step].append((ri, inner))
                    set_phase(ri)
                    region_s[ri] += t
                    # its bytes belong to region ri, the phase: no earlier owner changes, so
                    # the high point and the end stand for all its events (see `LiveBytes`)
                    add_many([(high, ri)] if net == high else [(high, ri), (net - high, ri)])
                    for h, b in frees:
                        release[h].append((-b, ri))
                    if keep_timeline:
                        timeline.append((f"recompute {r.nodes[0]}", mem.cur))
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
            if static.replays_size > _static_mod.REPLAY_MEMO:
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

