"""``cpsat``: OR-Tools CP-SAT over region schedules of general graphs, with lazy checks.

**Space.** Region boundaries at `unit_points` (block boundaries and chain cuts, merged so that
every unit has a node that saves tensors for backward), each region ``keep`` or ``recompute``,
no save sets.

**Model.** Booleans ``cut[c]`` (a region boundary at point c) and ``rc[u]`` (unit u is
recomputed; units of one region share it). A storage is *held* past its last forward reader
when a node in a keep unit saved it, or when a recompute region other than its producer's reads
it (the checkpoint keeps region inputs). For every forward node and every backward step, the
bytes alive there, as the simulator counts them minus the replay bursts, plus the recorded
op temporaries and gradients, must fit the budget. The objective is the replayed forward time
(integer nanoseconds), exactly as the simulator computes it (replay stops at a region's last
node that saves something). Held-until-step is bounded from below (a region keeps its inputs at
least until the backward of its unit's last saver).

So the model is a relaxation: it never rejects a schedule the simulator accepts, and its
objective is exact. Each solution is simulated; one that does not fit (a replay burst) is cut
off by a no-good constraint and the model is solved again. The first solution that fits is
therefore optimal over the space when CP-SAT proves it OPTIMAL; with the time limit hit it is
FEASIBLE with the proven gap. The best fitting cheap baseline (`WARM_STARTS`) is CP-SAT's hint,
and cpsat's answer when time runs out before CP-SAT finds a schedule that fits (FEASIBLE, with
CP-SAT's bound when it got that far; on large graphs building the model can take the whole
time limit, and then there is no bound).

Running time: exponential in the worst case (CP-SAT); the model has O(units + storages *
thresholds) Booleans and O(nodes + backward steps) linear constraints.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from ..graph import CostGraph
from ..schedule import KEEP, RECOMPUTE, Schedule
from ..simulate import ReplayProbe, simulate
from .base import FEASIBLE, INFEASIBLE, OPTIMAL, SolveResult, finish, register
from .dp import chain_cuts

__all__ = ["cpsat", "unit_points"]

_NS = 1e9


def unit_points(graph: CostGraph, *, max_units: int = 48) -> list[int]:
    """The region boundaries of the cpsat space: ``[0, ..., n]`` over ``graph.compute_nodes``."""
    names = graph.compute_nodes
    n = len(names)
    blocks = [graph.node(x).block for x in names]
    cuts = sorted({c for c in range(1, n) if blocks[c] != blocks[c - 1]} | set(chain_cuts(graph)))
    if len(cuts) + 1 > max_units:
        cuts = [c for c in cuts if blocks[c] != blocks[c - 1]]
    if len(cuts) + 1 > max_units:
        step = len(cuts) / (max_units - 1)
        cuts = sorted({cuts[int(i * step)] for i in range(max_units - 1)})
    has_saver = [bool(graph.node(x).saved) for x in names]
    pts = [0, *cuts, n]
    merged = [0]
    for a, b in zip(pts, pts[1:]):  # drop the right end of units with no saver
        if any(has_saver[a:b]) or b == n:
            merged.append(b)
    if len(merged) > 2 and not any(has_saver[merged[-2]:n]):
        merged.pop(-2)
    return merged


class _Model:
    """The CP-SAT relaxation for one graph, points and budget (see the module docstring)."""

    def __init__(self, graph: CostGraph, points: list[int], budget_bytes: int | None,
                 *, objective: bool = True, deadline: float | None = None):
        """With ``budget_bytes=None`` the room above the base is a variable and the objective
        is to minimize it (the least peak of the space)."""
        from ortools.sat.python import cp_model

        self.cp_model = cp_model
        self.g, self.points, self.deadline = graph, points, deadline
        g = graph
        m = self.m = cp_model.CpModel()
        names = g.compute_nodes
        n_units = len(points) - 1
        unit = {}
        for u, (a, b) in enumerate(zip(points, points[1:])):
            for x in names[a:b]:
                unit[x] = u
        self.unit = unit
        self.rc = [m.NewBoolVar(f"rc{u}") for u in range(n_units)]
        self.cut = [None] + [m.NewBoolVar(f"cut{c}") for c in points[1:-1]] + [None]
        rc, cut = self.rc, self.cut
        for u in range(n_units - 1):
            m.Add(rc[u] == rc[u + 1]).OnlyEnforceIf(cut[u + 1].Not())
            m.AddBoolOr([rc[u], rc[u + 1]]).OnlyEnforceIf(cut[u + 1])  # no keep|keep cut
        if budget_bytes is None:
            room: Any = m.NewIntVar(0, 2 ** 50, "room")
            objective = False
            m.Minimize(room)
        else:
            room = budget_bytes - g.base_bytes
        self.room = room
        pos = {x.name: i for i, x in enumerate(g.nodes)}
        last_step: dict[str, int] = {}
        for i, st in enumerate(g.bwd_steps):
            if st.node:
                last_step[st.node] = i
        end = len(g.bwd_steps) - 1
        done = {x: last_step.get(x, end) for x in pos}
        unit_done = [-1] * n_units
        for x in names:
            if g.node(x).saved:
                unit_done[unit[x]] = max(unit_done[unit[x]], done[x])
        self.unit_done = unit_done
        users: dict[str, list[str]] = defaultdict(list)
        for x in g.nodes:
            for y in x.inputs:
                users[y].append(x.name)

        # -- holding terms of each storage: (threshold step, literal-or-True) ---------------
        self._cache: dict[Any, Any] = {}
        fwd_alive: list[tuple[int, int, int, Any]] = []  # (prod_pos, last_pos, bytes, held)
        bwd_terms: list[tuple[int, list[tuple[int, Any]]]] = []
        for st in g.storages.values():
            if st.inner_free:
                continue
            terms: list[tuple[int, Any]] = []
            if st.output and st.producer == g.meta.get("loss_node"):
                terms.append((end, True))  # the step holds the loss until backward ends
            for s in st.savers:
                if s in unit:
                    terms.append((done[s], rc[unit[s]].Not()))
                else:  # the loss: always keep
                    terms.append((done[s], True))
            if st.output and st.producer in unit:
                pu = unit[st.producer]
                readers = set(users.get(st.producer, ()))
                for v in st.views:
                    readers.update(users.get(v, ()))
                for ru in sorted({unit[r] for r in readers if r in unit} - {pu}):
                    terms.append((("frame", pu, ru), self._frame(pu, ru)))
            held = self._or([t for _, t in terms])
            fwd_alive.append((pos[st.producer], pos[st.last_use], st.bytes, held))
            bwd_terms.append((st.bytes, terms))

        # -- forward: before each node's events, what is alive after the previous node ------
        for i, x in enumerate(g.nodes):
            self._check_time()
            run = peak = 0
            for kind, sid in g.fwd_events.get(x.name, ()):
                run += g.storages[sid].bytes if kind == "a" else -g.storages[sid].bytes
                peak = max(peak, run)
            const, expr = 0, []
            for p, last, b, held in fwd_alive:
                if p >= i:
                    continue
                if last >= i or held is True:
                    const += b
                elif held is not False:
                    expr.append((b, held))
            self._fits(const + peak, expr, room)
        # -- backward: each step, with its recorded gradient peak ---------------------------
        grad_cur, gid_bytes = 0, {}
        self.alive_before: list[tuple[int, list[tuple[int, Any]]]] = []
        self.step_peak: list[int] = []  # gradient peak of each step above its start
        for k, step in enumerate(g.bwd_steps):
            self._check_time()
            self.alive_before.append((grad_cur, []))
            run = peak = grad_cur
            for kind, gid, b in step.events:
                if kind == "a":
                    gid_bytes[gid] = b
                    run += b
                else:
                    run -= gid_bytes.pop(gid, 0)
                peak = max(peak, run)
            grad_cur = run
            const, expr = 0, []
            for b, terms in bwd_terms:
                live = [t if not isinstance(thr, tuple) else self._frame_at(thr[1], thr[2], k)
                        for thr, t in terms if isinstance(thr, tuple) or thr >= k]
                if not live:
                    continue
                lit = self._or(live)
                if lit is True:
                    const += b
                else:
                    expr.append((b, lit))
            self._fits(const + peak, expr, room)
            self.alive_before[k] = (self.alive_before[k][0] + const, expr)
            self.step_peak.append(peak - self.alive_before[k][0] + const)
        self._bursts(room)

        # -- objective: replayed forward time, ns -------------------------------------------
        if objective:
            terms = []
            for u, (a, b) in enumerate(zip(points, points[1:])):
                full = sum(g.node(x).time_s for x in names[a:b])
                savers = [x for x in names[a:b] if g.node(x).saved]
                last = savers[-1] if savers else None
                pref = 0.0
                if last is not None:
                    upto = names[a:names.index(last) + 1]
                    pref = sum(g.node(x).time_s for x in upto)
                    if not any(s.source == last for s in g.node(last).saved):
                        pref -= g.node(last).time_s
                full_ns, pref_ns = round(full * _NS), round(pref * _NS)
                terms.append(full_ns * rc[u])
                if full_ns != pref_ns:
                    z = m.NewBoolVar(f"z{u}")
                    m.AddImplication(z, rc[u])
                    if cut[u + 1] is not None:
                        m.AddImplication(z, cut[u + 1])
                    terms.append(-(full_ns - pref_ns) * z)
            m.Minimize(sum(terms))

    def _bursts(self, room: int) -> None:
        """Replays. For every region the space allows, ``y`` is true when it is a recompute
        region; then its replay's own peak must fit on top of what is alive when backward
        replays it, and the copies it leaves alive count in every later step until freed."""
        pts, cut, rc, m = self.points, self.cut, self.rc, self.m
        n_units = len(pts) - 1
        n_steps = len(self.alive_before)
        copies: list[list[tuple[int, Any]]] = [[] for _ in range(n_steps)]
        bursts = []
        probe = ReplayProbe(self.g)
        for a in range(n_units):
            self._check_time()
            for b in range(a, n_units):
                step, extra, freed = probe(pts[a], pts[b + 1])
                if step is None:
                    continue
                when = [rc[a], *(cut[c].Not() for c in range(a + 1, b + 1))]
                if a > 0:
                    when.append(cut[a])
                if b + 1 < n_units:
                    when.append(cut[b + 1])
                y = m.NewBoolVar(f"region{a}_{b}")
                m.AddBoolOr([*(w.Not() for w in when), y])  # the region is there -> y
                bursts.append((step, extra, y))
                held = sum(freed.values())
                for k in range(step, max(freed, default=-1) + 1):
                    if held:
                        copies[k].append((held, y))
                    held -= freed.get(k, 0)
        for step, extra, y in bursts:  # alive before the replay, plus the replay's peak
            const, expr = self.alive_before[step]
            earlier = [(h, z) for h, z in copies[step] if z is not y]
            terms = expr + earlier
            if terms or not isinstance(room, int):
                m.Add(sum(x * lit for x, lit in terms) + const + extra <= room).OnlyEnforceIf(y)
            elif const + extra > room:
                m.Add(y == 0)
        for k, (const, expr) in enumerate(self.alive_before):  # steps, with held copies
            if copies[k]:
                peak = self.step_peak[k]
                self._fits(const + peak, expr + copies[k], room)

    def _check_time(self) -> None:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise TimeoutError("cpsat: out of time while building the model")

    def _fits(self, const: int, expr: list[tuple[int, Any]], room: Any) -> None:
        if not expr and isinstance(room, int):
            if const > room:
                self.m.AddBoolOr([])  # infeasible whatever the schedule
            return
        self.m.Add(sum(b * lit for b, lit in expr) + const <= room)

    def _frame(self, pu: int, ru: int) -> Any:
        """Literal: unit ``ru`` is recomputed and a region boundary separates it from ``pu``."""
        key = ("frame", pu, ru)
        if key not in self._cache:
            lo, hi = sorted((pu, ru))
            v = self.m.NewBoolVar(f"frame{pu}_{ru}")
            cuts = [self.cut[c] for c in range(lo + 1, hi + 1)]
            # v -> rc[ru] and v -> some cut; and rc[ru] and a cut -> v
            self.m.AddImplication(v, self.rc[ru])
            self.m.AddBoolOr(cuts).OnlyEnforceIf(v)
            for c in cuts:
                self.m.AddBoolOr([self.rc[ru].Not(), c.Not(), v])
            self._cache[key] = v
        return self._cache[key]

    def _frame_at(self, pu: int, ru: int, k: int) -> Any:
        """Literal: ``pu``'s storage is still held at backward step ``k`` by the frame of the
        recompute region containing unit ``ru``: that region is separated from ``pu`` and one of
        its units w has a saver whose backward runs at step ``k`` or later."""
        ws = tuple(w for w in range(pu + 1, len(self.rc)) if self.unit_done[w] >= k)
        if not ws:
            return False
        key = ("frame_at", pu, ru, ws)
        if key not in self._cache:
            v = self.m.NewBoolVar("hold")
            self.m.AddImplication(v, self._frame(pu, ru))
            for c in range(pu + 1, ru + 1):
                for w in ws:
                    lo, hi = sorted((w, ru))
                    between = [self.cut[x] for x in range(lo + 1, hi + 1)]
                    self.m.AddBoolOr([self.rc[ru].Not(), self.cut[c].Not(), *between, v])
            self._cache[key] = v
        return self._cache[key]

    def _or(self, lits: list[Any]) -> Any:
        """A literal that is true when any of ``lits`` is (True/False for constants)."""
        if any(x is True for x in lits):
            return True
        lits = [x for x in lits if x is not False]
        if not lits:
            return False
        if len(lits) == 1:
            return lits[0]
        key = ("or", tuple(sorted(x.Index() for x in lits)))
        if key not in self._cache:
            v = self.m.NewBoolVar("or")
            for x in lits:
                self.m.AddImplication(x, v)
            self.m.AddBoolOr(lits).OnlyEnforceIf(v)
            self._cache[key] = v
        return self._cache[key]

    def schedule(self, solver: Any) -> Schedule:
        pts = self.points
        spans, start = [], 0
        for u in range(len(pts) - 1):
            last = u == len(pts) - 2 or solver.Value(self.cut[u + 1])
            if last:
                pol = RECOMPUTE if solver.Value(self.rc[u]) else KEEP
                spans.append((pts[start], pts[u + 1], pol))
                start = u + 1
        return Schedule.from_regions(self.g, spans, meta={"space": "cpsat unit points"})

    def hint(self, schedule: Schedule) -> bool:
        """Warm start from ``schedule`` when its region boundaries are all unit points;
        returns whether it could."""
        bounds, i = [0], 0
        policy = []
        for r in schedule.regions:
            i += len(r.nodes)
            bounds.append(i)
            policy.append(r.recompute)
        if not set(bounds) <= set(self.points):
            return False
        region = 0
        for u, p in enumerate(self.points[:-1]):
            while bounds[region + 1] <= p:
                region += 1
            self.m.AddHint(self.rc[u], policy[region])
            if self.cut[u] is not None:
                self.m.AddHint(self.cut[u], p in bounds)
        return True

    def forbid(self, solver: Any) -> None:
        """No-good: exclude the current assignment of cuts and policies."""
        lits = []
        for v in [*self.rc, *(c for c in self.cut if c is not None)]:
            lits.append(v.Not() if solver.Value(v) else v)
        self.m.AddBoolOr(lits)


def _cp_solver(deadline: float | None) -> Any:
    """A CP-SAT solver with the time left until ``deadline``; None when none is left."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 2
    if deadline is not None:
        left = deadline - time.perf_counter()
        if left <= 0:
            return None
        solver.parameters.max_time_in_seconds = left
    return solver


def _solve_lazy(graph: CostGraph, points: list[int], budget: int, deadline: float | None,
                warm: Schedule | None = None
                ) -> tuple[str, Schedule | None, float | None]:
    """(status, schedule, lower bound in s) for the budget; status of the master problem
    (``"TIMEOUT"`` when time ran out first; the bound is then CP-SAT's, when it has one)."""
    from ortools.sat.python import cp_model

    try:
        model = _Model(graph, points, budget, deadline=deadline)
    except TimeoutError:
        return "TIMEOUT", None, None
    if warm is not None:
        model.hint(warm)
    bound = None
    while (solver := _cp_solver(deadline)) is not None:
        st = solver.Solve(model.m)
        if st == cp_model.INFEASIBLE:
            return INFEASIBLE, None, None
        # the master is a relaxation: its bound holds over the space (no-goods only cut off
        # schedules that do not fit)
        bound = solver.BestObjectiveBound() / _NS
        if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break
        sched = model.schedule(solver)
        if simulate(graph, sched).peak_bytes <= budget:
            return (OPTIMAL if st == cp_model.OPTIMAL else FEASIBLE), sched, bound
        model.forbid(solver)
    return "TIMEOUT", None, bound


def _min_feasible(graph: CostGraph, points: list[int], deadline: float | None) -> int | None:
    """The least peak of any schedule in the space (the master minimizes the room above the
    base; each answer is simulated and cut off if the simulator disagrees)."""
    from ortools.sat.python import cp_model

    try:
        model = _Model(graph, points, None, deadline=deadline)
    except TimeoutError:
        return None
    best = None
    while (solver := _cp_solver(deadline)) is not None:
        st = solver.Solve(model.m)
        if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break
        peak = simulate(graph, model.schedule(solver)).peak_bytes
        best = peak if best is None else min(best, peak)
        if st == cp_model.OPTIMAL and peak == solver.Value(model.room) + graph.base_bytes:
            break
        model.forbid(solver)
    return best


#: cheap baselines (one simulation each) that warm-start cpsat and stand in when it runs out
#: of time
WARM_STARTS = ("every_block", "sqrt", "uniform:2", "uniform:4")


def _warm_start(graph: CostGraph, budget_bytes: int) -> Schedule | None:
    """The fitting schedule with the least recompute time among `WARM_STARTS`, or None."""
    from .base import get_solver

    best = None
    for name in WARM_STARTS:
        r = get_solver(name)(graph, budget_bytes)
        if r.status != INFEASIBLE and (best is None
                                       or r.estimate.recompute_s < best.estimate.recompute_s):
            best = r
    return None if best is None else best.schedule


@register("cpsat")
def cpsat(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
          ) -> SolveResult:
    """CP-SAT over region schedules at `unit_points` (see the module docstring), warm-started
    with the best fitting cheap baseline, which it returns as FEASIBLE (with CP-SAT's proven
    bound, when there is one) if it runs out of time before finding a schedule that fits."""
    started = time.perf_counter()
    deadline = None if time_limit_s is None else started + time_limit_s
    points = unit_points(graph)
    warm = _warm_start(graph, budget_bytes)
    status, sched, bound = _solve_lazy(graph, points, budget_bytes, deadline, warm)
    if status == INFEASIBLE:  # proven: nothing in the space fits
        return finish(graph, budget_bytes, None, solver="cpsat", started=started,
                      status=INFEASIBLE,
                      min_feasible_bytes=_min_feasible(graph, points, deadline))
    if sched is None:  # out of time before finding a schedule that fits
        if warm is not None:
            return finish(graph, budget_bytes, warm, solver="cpsat", started=started,
                          status=FEASIBLE, lower_bound_s=bound)
        return finish(graph, budget_bytes, None, solver="cpsat", started=started,
                      status=INFEASIBLE)
    return finish(graph, budget_bytes, sched, solver="cpsat", started=started,
                  status=status, lower_bound_s=bound)
