"""The CP-SAT relaxation of the *full* schedule space: a proven lower bound on recompute time,
and the schedules its solutions read as.

The full space is every schedule `Schedule` can express on one level: region boundaries after
any compute node, each region ``keep`` or ``recompute``, and any save set (on a graph with
units, regions within one unit call: `_within_units`). Every schedule of
it maps to a solution of this relaxation at no more cost, so the relaxation's optimum bounds
them all from below (`bound.full_space_bound`, `certify`), and its solutions round to
schedules (`relax`).

**Variables.** Booleans ``r[p]``: node p runs again in a replay; ``a[s]``: the storage s that
forward made is itself used by backward (it stays alive from forward until the first backward
step that uses it; for a storage nothing saves: it is alive when forward ends); ``link[i]``:
nodes i-1 and i lie in one recompute region, both at or before its last saver;
``cached[x]``: x is in its region's save set (its outputs kept from forward). Every schedule
of the full space maps to values that satisfy:

* a linked node replays or is cached (or, node i only, is the region's last saver and stops
  the replay before running: `_idle_stop`);
* a storage that a node saves for backward (a node whose backward runs) is kept, or its
  producer runs again in a region that holds its savers too (a saver outside every region,
  the loss, always keeps it): every node from the producer to the saver is linked;
* a node that runs again reads each of its inputs kept, or remade in its own region (every
  node from the producer to it linked); read from another region, the input is the region's,
  held by the checkpoint until the region's last backward step, at least until the first node
  at or after the reader that saves tensors lets go (it is in the region: the reader runs in
  the replay, which stops at the region's last saver);
* the memory constraints of `relaxation_memory` (forward nodes, backward steps, replay
  bursts), which go in lazily.

**Objective**: what those replays cost at least (in whole picoseconds, `UNIT_S`, rounded
down): each replayed node's forward time; the checkpoint's hooks on the tensors saved by each
node in a region (replayed, cached or linked); the save-set dispatch of each such node in a
region that has a save set (a cached node linked to it), in forward, and again in the replay
for replayed and cached ones; and a checkpoint call for every replayed or cached node not
linked to its predecessor (it starts a region), at least one when anything replays.
Transient replay peaks, what a region holds after its last saver and the costs of its nodes
after that saver are left out, so the bound is below every fitting schedule's simulated
recompute time.

**Rounding** (`Relaxation.schedule`). A solution reads as a schedule: each run of linked
nodes, from a replayed or cached node that is not linked to its predecessor, is a recompute
region whose save set is its cached nodes; the rest is kept. Its simulated peak may exceed
the budget (what the relaxation leaves out: `Relaxation.violated` says where), and its
recompute time is at least the solution's; when it fits and reaches the proven bound, it is
optimal over the full space.

Size: O(reads * log nodes) Booleans and clauses, memory constraints of O(storages) terms each.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

from ..cost.simulate import Estimate, gradient_steps, storage_readers
from ..cost.static import Static
from ..ir.graph import CostGraph
from ..ir.replays import legalize, unit_calls
from ..ir.schedule import KEEP, RECOMPUTE, Schedule
from .config import SolverConfig
from .relaxation_memory import MemoryConstraints

__all__ = ["UNIT_S", "Relaxation"]

#: the objective's unit, in seconds: a picosecond, so that its rounding (at most 2 units a
#: term, a few hundred terms at once) stays within a millionth of a millisecond's recompute
UNIT_S = 1e-12


def _units(seconds: float) -> int:
    """Whole `UNIT_S`, rounded down (one less for the float product's rounding)."""
    return max(0, math.floor(seconds / UNIT_S) - 1)


class Relaxation(MemoryConstraints):
    """The CP-SAT relaxation of the full space for one graph and budget (see the module
    docstring): `solve` bounds it, `schedule` rounds a solution to a schedule."""

    def __init__(self, graph: CostGraph, budget_bytes: int, *, lean: bool | None = None,
                 deadline: float | None = None, config: SolverConfig | None = None):
        """``deadline`` (a `time.perf_counter` value): building past it raises `TimeoutError`
        (the build takes up to a second on thousands of nodes; it checks between its parts).
        ``lean``: leave out of the memory constraints made up front the cached outputs
        awaiting their replay and forward's copies between their savers (`_forward_copy`),
        and make no replay-burst constraint up front (they stay pending): a weaker relaxation
        that CP-SAT bounds much sooner on large graphs, whose rounded schedules `repair` can
        still make fit. The constraints `add` puts in later hold everything (only the steps a
        rounded schedule broke, so the model stays small). None: lean beyond
        `SolverConfig.lean_nodes` compute nodes."""
        from ortools.sat.python import cp_model

        super().__init__()
        self.config = config = config or SolverConfig()
        self.g, self.budget, self.deadline = graph, budget_bytes, deadline
        self.lean = len(graph.compute_nodes) > config.lean_nodes if lean is None else lean
        self.room = room = budget_bytes - graph.base_bytes
        static = self.static = Static.of(graph)
        names = self.names = graph.compute_nodes
        self.at = {x: i for i, x in enumerate(names)}
        m = self.m = cp_model.CpModel()
        self.infeasible = room < 0
        self.replayed = {p: m.NewBoolVar(f"r_{i}") for i, p in enumerate(names)}
        self.kept: dict[int, Any] = {}
        # objective: (`UNIT_S`, literal or integer variable)
        self.terms: list[tuple[int, Any]] = []
        self._hint: list[int] = []  # the last solve's solution, by variable index
        if self.infeasible:
            return
        first = static.first_step
        # the backward steps at which each storage is needed: one window per saver whose
        # backward runs, from its first step to the step after which it lets go
        self.windows: dict[int, list[tuple[int, int]]] = {}
        # storages a replay may remake for savers in its region: (storage, producer, savers)
        self.regenerable: list[tuple[int, str, list[str]]] = []
        remade_at_stop = {sid: before_mark for sid, *_, before_mark in static.stor}
        for sid, st in graph.storages.items():
            savers = [x for x in st.savers if x in first]
            if not savers or st.producer not in self.at:
                continue
            self.windows[sid] = [(first[x], static.done[x]) for x in savers]
            p = st.producer
            if any(x not in self.at for x in savers):
                m.Add(self.keep(sid) == 1)  # the loss saved it: never replayed
            elif set(savers) == {p} and not remade_at_stop[sid]:
                continue  # a replay that stops inside p does not remake it (needs no copy)
            else:
                m.AddBoolOr([self.keep(sid), self.replayed[p]])
                self.regenerable.append((sid, p, savers))
        self.first_need = {sid: min(f for f, _ in ws) for sid, ws in self.windows.items()}
        self._check_time()
        # memory constraints not in the model yet, by label (("fwd", node position),
        # ("bwd", step), ("burst", step)): `add` puts them in, `violated` says which a
        # schedule breaks
        self.pending: dict[tuple[str, int], Callable[[], None]] = {}
        self.built: dict[tuple[str, int], Callable[[], None]] = {}  # (`tighten` builds again)
        self._regions()
        self._check_time()
        self._inputs()
        self._fits(0, self._stored(list(self.kept)))
        self._up_front = True  # (what `lean` leaves out is left out of these only)
        self._check_time()
        self._forward()
        self._check_time()
        self._backward()
        self._up_front = False
        self._flush()
        m.Minimize(sum(c * v for c, v in self.terms if c))

    def _check_time(self) -> None:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise TimeoutError("out of time building the full-space relaxation")

    def violated(self, estimate: Estimate) -> list[tuple[str, int]]:
        """Labels of the memory constraints (pending or not) at the forward nodes and
        backward steps where ``estimate`` (a simulation with its timeline) goes over the
        budget (before each, what was alive plus its own highest running total), most over
        first."""
        return [label for _, label in self.overshoots(estimate)]

    def overshoots(self, estimate: Estimate) -> list[tuple[int, tuple[str, int]]]:
        """`violated`'s labels, each with the bytes by which ``estimate`` goes over there."""
        budget, over = self.budget, []  # (by how much, label)
        prev, fwd, k, steps = self.g.base_bytes, 0, 0, gradient_steps(self.g)
        for label, cur in estimate.timeline:
            if label.startswith("bwd "):
                high = max(prev + max(0, steps[k][1] or 0), cur)
                if high > budget:
                    over += [(high - budget, ("bwd", k)), (high - budget, ("burst", k))]
                k += 1
            elif label.startswith("recompute "):
                if cur > budget:
                    over.append((cur - budget, ("burst", k)))
            else:
                eng = self.static.engine[fwd - 1] if fwd else 0  # (in prev; fwd_peak has its own)
                high = max(prev - eng + self.static.fwd_peak[fwd], cur)
                if high > budget:
                    over.append((high - budget, ("fwd", fwd)))
                fwd += 1
            prev = cur
        over.sort(key=lambda t: -t[0])  # (stable: in step order among equals)
        return over


    def _regions(self) -> None:
        """Links, cached nodes, region starts and save sets, and what they cost."""
        g, m, names, at, replayed = self.g, self.m, self.names, self.at, self.replayed
        # a save set caches every storage its nodes allocate, op temporaries included (each
        # non-view op of the node is MUST_SAVE)
        outputs = self.static.allocs
        per_saved = g.checkpoint_saved_s
        cached = self.cached = {}
        for x in names:
            if g.allocates(x):  # (a node that allocates nothing is in no save set)
                c = cached[x] = m.NewBoolVar(f"cached_{at[x]}")
                for sid in outputs[x]:
                    m.AddImplication(c, self.keep(sid))
        link: list[Any] = [None]
        starts = []
        for i, x in enumerate(names):
            start = m.NewBoolVar(f"start_{i}")
            starts.append(start)
            if i == 0:
                m.AddImplication(replayed[x], start)
                if x in cached:
                    m.AddImplication(cached[x], start)
                continue
            q = names[i - 1]
            li = m.NewBoolVar(f"link_{i}")
            link.append(li)
            for y in (q, x):  # (q comes before the last saver, so only x can be an idle one)
                if y == q or not _idle_stop(g, y):
                    m.AddBoolOr([li.Not(), replayed[y], *([cached[y]] if y in cached else [])])
            # a replayed or cached node not linked to its predecessor starts a region
            m.AddBoolOr([replayed[x].Not(), li, start])
            if x in cached:
                m.AddBoolOr([cached[x].Not(), li, start])
        self.link = link
        # cached nodes' outputs: held until their region's replay
        self.cached_out = [(sid, x) for x in cached for sid in outputs[x]]
        # with_save[i]: node i's region has a save set (a cached node linked to it); then a
        # replayed node pays the policy's dispatch in forward and in the replay
        with_save = [m.NewBoolVar(f"sac_{i}") for i in range(len(names))]
        for x, c in cached.items():
            m.AddImplication(c, with_save[at[x]])
        for i in range(1, len(names)):
            m.AddBoolOr([link[i].Not(), with_save[i - 1].Not(), with_save[i]])
            m.AddBoolOr([link[i].Not(), with_save[i].Not(), with_save[i - 1]])
        for i, x in enumerate(names):
            node = g.node(x)
            self.terms.append((_units(node.time_s), replayed[x]))
            runs = [replayed[x], *([cached[x]] if x in cached else [])]
            # a node in a region: it replays, is cached, or is linked to its predecessor
            inside = [*runs, *([link[i]] if i else [])]
            if node.saved and per_saved:  # the checkpoint's hooks on what it saves
                v = m.NewBoolVar(f"hooks_{i}")
                for lit in inside:
                    m.AddImplication(lit, v)
                self.terms.append((_units(per_saved * len(node.saved)), v))
            if node.sac_s:  # the policy's dispatch: in forward, and again in the replay
                for name, lits in (("fwd", inside), ("replay", runs)):
                    v = m.NewBoolVar(f"dispatch_{name}_{i}")
                    for lit in lits:
                        m.AddBoolOr([lit.Not(), with_save[i].Not(), v])
                    self.terms.append((_units(node.sac_s), v))
        # a storage not kept is remade for its savers by its producer's region
        for sid, p, savers in self.regenerable:
            far = max((at[x] for x in savers if at[x] > at[p]), default=None)
            if far is not None:
                m.AddBoolOr([self.keep(sid), self._run(at[p], far)])
        call = _units(g.checkpoint_call_s)
        if call and names:
            calls = m.NewIntVar(0, len(names), "calls")
            m.Add(calls >= sum(starts))
            for r in replayed.values():
                m.Add(calls >= 1).OnlyEnforceIf(r)
            self.terms.append((call, calls))
        self._within_units()

    def _within_units(self) -> None:
        """With units, a region lies in one unit call (`ir.replays`): nodes outside the calls
        neither replay nor are cached, no link crosses a call's edge."""
        call_of: list[int | None] = [None] * len(self.names)
        for k, (_, start, stop) in enumerate(unit_calls(self.g)):
            call_of[start:stop] = [k] * (stop - start)
        for i, x in enumerate(self.names if self.g.units else ()):
            if call_of[i] is None:
                self.m.Add(self.replayed[x] == 0)
                if x in self.cached:
                    self.m.Add(self.cached[x] == 0)
            if i and (call_of[i] is None or call_of[i] != call_of[i - 1]):
                self.m.Add(self.link[i] == 0)

    def _inputs(self) -> None:
        """What a replayed node reads: kept, or remade in its region (``chain``: every node
        from the producer linked), or else a region input (``inp``), held until at least the
        step after which the first node at or after the reader that saves tensors lets go."""
        g, m, at, static = self.g, self.m, self.at, self.static
        names, replayed, link = self.names, self.replayed, self.link
        next_saver: list[int | None] = [None] * (len(names) + 1)
        for i in range(len(names) - 1, -1, -1):
            next_saver[i] = i if names[i] in static.has_saved else next_saver[i + 1]
        readers = storage_readers(g)
        self.inputs: list[tuple[int, Any, int]] = []  # (storage, inp, held until step)
        for sid, st in g.storages.items():
            if st.producer not in at:
                continue
            p = at[st.producer]
            for u in readers[sid]:
                if u not in at:
                    continue
                m.AddBoolOr([replayed[u].Not(), self.keep(sid), replayed[st.producer]])
                if at[u] <= p:
                    continue
                chain = self._run(p, at[u])
                m.AddBoolOr([replayed[u].Not(), self.keep(sid), chain])
                z = next_saver[at[u]]
                if z is not None:
                    inp = m.NewBoolVar("")
                    # u is in a region when it replays, is cached or is linked (the region's
                    # checkpoint holds what any of its nodes reads from outside)
                    for lit in (replayed[u], self.cached.get(u), link[at[u]]):
                        if lit is not None:
                            m.AddBoolOr([lit.Not(), chain, inp])
                    self.inputs.append((sid, inp, static.done[names[z]]))

    # -- solving and rounding ----------------------------------------------------------------
    def solve(self, time_limit_s: float,
              on_solution: Callable[[Callable[[Any], int]], None] | None = None,
              stop: Callable[[float, float], bool] | None = None,
              checks: Sequence[tuple[float, Callable[[], bool]]] = ()
              ) -> tuple[float, bool]:
        """(bound in seconds, whether CP-SAT proved it the relaxation's optimum): ``math.inf``
        when the relaxation is infeasible (nothing fits), 0.0 when CP-SAT found no bound in
        ``time_limit_s``. ``on_solution(value)`` is called with each improving solution
        (``value(literal)`` reads it), then ``stop(objective, bound)`` (seconds): when it says
        so, CP-SAT stops there. ``checks``: (seconds, says) each: after that long, CP-SAT
        stops when ``says()`` is true."""
        import threading

        from ortools.sat.python import cp_model

        if self.infeasible:
            return math.inf, True
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = len(self.config.subsolvers)
        solver.parameters.subsolvers.extend(self.config.subsolvers)
        solver.parameters.max_time_in_seconds = max(0.05, time_limit_s)
        # (presolve's probing rounds cost seconds on large graphs and moved no bound)
        solver.parameters.cp_model_probing_level = 0
        callback = None
        if on_solution is not None:
            class _Callback(cp_model.CpSolverSolutionCallback):
                def on_solution_callback(self) -> None:
                    on_solution(self.Value)
                    if stop is not None and stop(self.ObjectiveValue() * UNIT_S,
                                                 self.BestObjectiveBound() * UNIT_S):
                        self.StopSearch()

            callback = _Callback()
        if self._hint:
            self.m.ClearHints()
            for i, v in enumerate(self._hint):
                self.m.AddHint(self.m.GetIntVarFromProtoIndex(i), v)
        timers = []
        for after, says in checks:
            timers.append(threading.Timer(
                after, lambda says=says: says() and solver.StopSearch()))
            timers[-1].daemon = True
            timers[-1].start()
        try:
            status = solver.Solve(self.m, callback)
        finally:
            for timer in timers:
                timer.cancel()
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            self._hint = list(solver.ResponseProto().solution)
        if status == cp_model.INFEASIBLE:
            return math.inf, True
        if status == cp_model.MODEL_INVALID:
            raise AssertionError(f"the full-space bound's model is invalid: {self.m.Validate()}")
        # out of time (UNKNOWN included), the best bound so far still holds
        bound = solver.BestObjectiveBound()
        return (max(0.0, bound) * UNIT_S if math.isfinite(bound) else 0.0,
                status == cp_model.OPTIMAL)

    def schedule(self, value: Callable[[Any], int]) -> Schedule:
        """The schedule a solution reads as (see the module docstring's *Rounding*)."""
        names, link, cached = self.names, self.link, self.cached
        spans: list[tuple[int, int, str, list[str]]] = []
        i, kept_from = 0, 0
        while i < len(names):
            x = names[i]
            if not (value(self.replayed[x]) or (x in cached and value(cached[x]))):
                i += 1
                continue
            j = i + 1
            while j < len(names) and value(link[j]):
                j += 1
            if kept_from < i:
                spans.append((kept_from, i, KEEP, []))
            spans.append((i, j, RECOMPUTE, [y for y in names[i:j]
                                            if y in cached and value(cached[y])]))
            i = kept_from = j
        if kept_from < len(names):
            spans.append((kept_from, len(names), KEEP, []))
        # (a region the rewriter would refuse has its cuts moved, `ir.replays`: the relaxation
        # does not model them, so its bound holds over the schedules it runs too)
        return legalize(self.g, Schedule.from_regions(
            self.g, spans, meta={"space": "the full schedule space (relax)"}))[0]



def _idle_stop(graph: CostGraph, node: str) -> bool:
    """Whether ``node``, as its region's last saver, would neither replay (none of its events
    come before its `CostGraph.replay_mark`) nor be cached: linked, yet neither."""
    return bool(graph.node(node).saved) and \
        not graph.fwd_events.get(node, ())[:graph.replay_mark(node)]
