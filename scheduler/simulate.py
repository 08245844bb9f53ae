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
event. Time is the measured unscheduled step plus the forward time of every replayed node.
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


def region_costs(graph: CostGraph, schedule: Schedule) -> tuple[Estimate, list["RegionCost"]]:
    """`simulate`, plus each region's `RegionCost` (the loss is one more region, last).

    Slower than `simulate` by a factor of the number of regions; used by solvers to compose
    regions on chains.
    """
    schedule.validate(graph)
    sim = _Sim(graph, schedule, per_region=True)
    est = sim.run()
    return est, sim.region_costs


class _Sim:
    def __init__(self, g: CostGraph, s: Schedule, *, per_region: bool = False):
        self.g = g
        self.per_region = per_region
        self.pos = {n.name: i for i, n in enumerate(g.nodes)}
        self.region_of: dict[str, int] = {}
        self.recompute: dict[int, bool] = {}
        self.save: dict[int, frozenset[str]] = {}
        for ri, r in enumerate(s.regions):
            self.recompute[ri] = r.recompute
            self.save[ri] = r.save
            for n in r.nodes:
                self.region_of[n] = ri
        self.regions = s.regions
        steps = g.bwd_steps
        self.n_steps = len(steps)
        self.first_step: dict[str, int] = {}
        self.last_step: dict[str, int] = {}
        for i, st in enumerate(steps):
            if st.node:
                self.first_step.setdefault(st.node, i)
                self.last_step[st.node] = i
        self.end_step = self.n_steps - 1
        # readers of each storage (nodes reading the producer's output or one of its views)
        users: dict[str, list[str]] = defaultdict(list)
        for n in g.nodes:
            for u in n.inputs:
                users[u].append(n.name)
        self.users = users

    # -- helpers ---------------------------------------------------------------------------
    def _is_rc(self, node: str) -> bool:
        ri = self.region_of.get(node)
        return ri is not None and self.recompute[ri]

    def _bwd_done(self, node: str) -> int:
        """Step after which node's saved tensors are released (end if its backward never runs)."""
        return self.last_step.get(node, self.end_step)

    def run(self) -> Estimate:
        g = self.g
        nodes = g.nodes
        # -- per recompute region: saver nodes, replay extent, frame lifetime, burst step ----
        rinfo: dict[int, dict[str, Any]] = {}
        for ri, r in enumerate(self.regions):
            if not r.recompute:
                continue
            savers = [n for n in r.nodes if g.node(n).saved]
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
        loss_node = g.meta.get("loss_node")
        for sid, st in g.storages.items():
            h = self.end_step if st.producer == loss_node and st.output else -1
            for m in st.savers:
                if not self._is_rc(m):
                    h = max(h, self._bwd_done(m))
            prod_r = self.region_of.get(st.producer)
            for ri in {self.region_of.get(u) for u in self.readers(st)}:
                if ri is not None and ri != prod_r and self.recompute[ri]:
                    h = max(h, rinfo[ri]["frame_end"])
            if (prod_r is not None and self.recompute[prod_r]
                    and st.producer in self.save[prod_r]):
                info = rinfo[prod_r]
                replayed = self.pos[st.producer] < info["stop"] or (
                    self.pos[st.producer] == info["stop"] and self._before_mark(sid, info))
                if info["burst"] is not None and replayed:
                    cached_in[sid] = prod_r  # until the replay pops it
                else:  # never replayed: the cache lives as long as the region's frame
                    h = max(h, info["frame_end"])
            hold_until[sid] = h

        # -- owners, for per-region accounting: a storage belongs to its producer's region, or
        # to the first later region that reads it (a region input); the loss is region R
        R = len(self.regions)
        phase_of = {n.name: self.region_of.get(n.name, R) for n in nodes}
        owner: dict[int, int] = {}
        for sid, st in g.storages.items():
            later = [phase_of[u] for u in self.readers(st) if phase_of[u] > phase_of[st.producer]]
            owner[sid] = min(later) if later else phase_of[st.producer]
        mem = _Mem(R + 1, track=self.per_region)

        # -- forward ---------------------------------------------------------------------------
        timeline: list[tuple[str, int]] = []
        free_at: dict[int, list[int]] = defaultdict(list)
        for sid, st in g.storages.items():
            if hold_until[sid] < 0 and sid not in cached_in and not st.inner_free:
                free_at[self.pos[st.last_use]].append(sid)
        for i, n in enumerate(nodes):
            mem.phase = phase_of[n.name]
            for kind, sid in g.fwd_events.get(n.name, ()):
                if kind == "a":
                    mem.add(g.storages[sid].bytes, owner[sid])
                elif hold_until[sid] < 0 and sid not in cached_in:
                    mem.add(-g.storages[sid].bytes, owner[sid])
            for sid in free_at.get(i, ()):
                mem.add(-g.storages[sid].bytes, owner[sid])
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
        gid_bytes: dict[int, int] = {}
        for i, step in enumerate(g.bwd_steps):
            for ri in bursts.get(i, ()):
                mem.phase = ri
                region_s[ri] = self._replay(ri, self.regions[ri], rinfo[ri], mem, hold_until,
                                            release, i)
                timeline.append((f"recompute {self.regions[ri].nodes[0]}", mem.cur))
            mem.phase = phase_of.get(step.node, R)
            for kind, gid, b in step.events:
                if kind == "a":
                    gid_bytes[gid] = b
                    mem.add(b, None)
                else:
                    mem.add(-gid_bytes.pop(gid, 0), None)
            for b, o in release.pop(i, ()):
                mem.add(-b, o)
            timeline.append((f"bwd {step.node or '<loss>'}", mem.cur))

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

    def readers(self, st: Any) -> set[str]:
        """Nodes that read a storage: users of its producer's output or of a view of it."""
        if not st.output:
            return set()
        out = set(self.users.get(st.producer, ()))
        for v in st.views:
            out.update(self.users.get(v, ()))
        return out

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
        for n in members:
            cached = n in r.save
            events = g.fwd_events.get(n, ())
            if self.pos[n] == stop:
                # the last saver: the replay stops when autograd packs its last saved tensor;
                # its events after that (ops whose inputs it saved, and later ones) never run
                # and their cached outputs are not popped (held to the frame's end)
                events = events[:info["mark"]]
                if not events:
                    continue
            if not cached:
                t += g.node(n).time_s
            for kind, sid in events:
                st = g.storages[sid]
                held = [m for m in st.savers if m in region]
                if kind == "f":
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
                    readers = self.readers(st)
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
    peak and the range of what it holds while later regions run."""

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

    def add(self, b: int, owner: int | None) -> None:
        self.cur += b
        if self.cur > self.peak:
            self.peak = self.cur
        if not self.track:
            return
        if owner is not None:
            self.own[owner] += b
        j = self.phase
        early = sum(self.own[:j])
        self.local[j] = max(self.local[j], self.cur - early)
        for k in range(j):
            v = self.own[k]
            if not self._seen[k]:
                self.held_lo[k] = self.held_hi[k] = v
                self._seen[k] = True
            elif v < self.held_lo[k]:
                self.held_lo[k] = v
            elif v > self.held_hi[k]:
                self.held_hi[k] = v
