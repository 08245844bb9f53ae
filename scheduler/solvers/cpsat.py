"""``cpsat``: OR-Tools CP-SAT over region schedules of general graphs, with lazy checks.

**Space.** Region boundaries at `unit_points` (block boundaries, chain cuts and, on graphs
with few blocks, cuts inside blocks as cheap as a block boundary; merged so that every unit
has a node that saves tensors for backward), each region ``keep`` or ``recompute``, no save
sets. ``cpsat_fine`` searches `fine_points` instead: a boundary after any node that saves
tensors (at most `FINE_UNITS` units).

**Model.** Booleans ``cut[c]`` (a region boundary at point c) and ``rc[u]`` (unit u is
recomputed; units of one region share it). A storage is *held* past its last forward reader
when a node in a keep unit saved it, or when a recompute region other than its producer's reads
it (the checkpoint keeps region inputs). For every forward node and every backward step, the
bytes alive there, as the simulator counts them minus the replay bursts, plus the recorded
op temporaries and gradients, must fit the budget. The objective is the replayed forward time
plus the checkpoint's costs (per call, per saved tensor), in integer nanoseconds, exactly as
the simulator computes it (replay stops at a region's last node that saves something).
Held-until-step is bounded from below (a region keeps its inputs at least until the backward
of its unit's last saver).

So the model is a relaxation: it never rejects a schedule the simulator accepts, and its
objective is exact. Each solution is simulated; one that does not fit (a replay burst) is cut
off by a no-good constraint and the model is solved again. The first solution that fits is
therefore optimal over the space when CP-SAT proves it OPTIMAL (``space_optimal``; `certify`
decides against the full-space bound whether that is OPTIMAL); with the time limit hit it is
FEASIBLE with its bound over the space as ``space_bound_s``. The best fitting cheap
baseline (`WARM_STARTS`) is CP-SAT's hint, and cpsat's answer when time runs out before
CP-SAT finds a schedule that fits (FEASIBLE, with CP-SAT's bound over the space when it got
that far; on large graphs building the model can take the whole time limit, and then there
is no bound over the space).

Building the model is incremental: a storage's bytes enter the forward sums at its producer
and turn into its held literal after its last reader; in backward its literal weakens at each
holder's step. Sums that another sum implies are left out: along forward the literal part only
grows, so a node gets a constraint only when its constant part is above every later node's;
along backward it only shrinks, so a step gets one only when its constant part is above every
earlier step's (or a replay leaves copies there). Replays are probed shortest region first for
at most a tenth of the time limit; the rest get their constraint when a candidate uses one.
Dropping a constraint only weakens the relaxation; the simulator still checks every answer.
Where nothing on the unit points fits but a warm start does, that is the answer (FEASIBLE).

Every improving solution CP-SAT reports is simulated on the way; out of time, the best that
fits (or the warm start, if better) is the answer. A model with more than `LARGE_MODEL`
constraints is searched without CP-SAT's presolve for half the time (answers come within a
second, but no useful bound), then the rest of the time goes to a *bound model*, hinted with
the best answer so far: the same variables and objective with only `BOUND_STEPS` of the
memory constraints and none of the replay ones, a relaxation of the relaxation that presolves
in a fraction of a second. Its bound holds over the space; its answers are simulated and cut
off by no-goods like the full model's, so its first answer that fits, proven optimal, is
optimal over the space.

Running time: exponential in the worst case (CP-SAT); the model has O(units^2 + storages)
Booleans and O(nodes + backward steps + units^2) linear constraints. On the 2,000-node
synthetic DAG (48 units, about 14k constraints) building it with every replay probed takes
about 8 s (the probes, O(units^2 * nodes)), with a tenth of a 10 s limit for probing about
2 s; presolve of the full model then takes 5 to 7 s (its memory constraints have about 900k
terms). Within 10 s, at 90, 80, 70, 60 and 50% of the unscheduled peak, one run answered
with 0.13, 0.27, 0.43, 0.59 and 0.94 s of recompute (warm start 0.52, 0.52, 0.78, 0.78 and
0.95 s), with proven bounds over the space of 0.065, 0.151, 0.278, 0.400 and 0.532 s: gaps
over the space of 33 to 51%, not the 1% we aim for (against the full-space bound, 82 to
100%: see README). (Measured before the synthetic graphs carried checkpoint costs: given
40 s on the fully probed model at 70%, CP-SAT reached 0.42 s with a 20% gap.)
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace
from typing import Any

from ..cost.simulate import ReplayProbe, gradient_steps, simulate, storage_readers
from ..cost.static import Static
from ..ir.graph import CostGraph
from ..ir.schedule import KEEP, RECOMPUTE, Schedule
from .base import FEASIBLE, INFEASIBLE, OPTIMAL, SolveResult, finish, register
from .config import SolverConfig
from .dp import chain_cuts, crossing_counts

__all__ = ["cpsat", "cpsat_fine", "fine_points", "unit_points", "warm_start"]

_NS = 1e9


#: unit_points adds cuts inside blocks only while there are fewer units than this: each unit
#: more makes CP-SAT's search longer (the U-Net's 25 units prove in under a second each;
#: with 47 it needs more than 10 s)
EXTRA_UNITS = 24


def unit_points(graph: CostGraph, *, max_units: int = 48) -> list[int]:
    """The region boundaries of the cpsat space: ``[0, ..., n]`` over ``graph.compute_nodes``.

    Block boundaries and chain cuts; where that leaves fewer than `EXTRA_UNITS` units, also
    positions inside blocks that no more storages cross than some block boundary does
    (`crossing_counts`: cuts as cheap as a block's, such as before a transformer block's
    MLP), evenly thinned to `EXTRA_UNITS` units. Units merge until each has a node that saves
    tensors for backward."""
    names = graph.compute_nodes
    n = len(names)
    blocks = [graph.node(x).block for x in names]
    has_saver = [bool(graph.node(x).saved) for x in names]
    bounds = {c for c in range(1, n) if blocks[c] != blocks[c - 1]}
    cuts = sorted(bounds | set(chain_cuts(graph)))
    room = min(max_units, EXTRA_UNITS) - 1 - len(cuts)
    if bounds and room > 0:
        counts = crossing_counts(graph)
        cheap = max(counts[c] for c in bounds)
        extra = set(_with_savers([0, *sorted({*cuts, *(
            c for c in range(1, n) if counts[c] <= cheap)}), n], has_saver)) - {*cuts, 0, n}
        extra = sorted(extra)
        if len(extra) > room:
            extra = sorted({extra[int(i * len(extra) / room)] for i in range(room)})
        cuts = sorted({*cuts, *extra})
    if len(cuts) + 1 > max_units:
        cuts = [c for c in cuts if blocks[c] != blocks[c - 1]]
    if len(cuts) + 1 > max_units:
        step = len(cuts) / (max_units - 1)
        cuts = sorted({cuts[int(i * step)] for i in range(max_units - 1)})
    return _with_savers([0, *cuts, n], has_saver)


def _with_savers(points: list[int], has_saver: list[bool]) -> list[int]:
    """``points`` (first 0, last n) merged so that each unit has a node that saves tensors:
    a unit ends at the first point after such a node; the last unit, if it has none, joins
    the one before."""
    n = points[-1]
    merged = [0]
    for b in points[1:]:
        if any(has_saver[merged[-1]:b]) or b == n:
            merged.append(b)
    if len(merged) > 2 and not any(has_saver[merged[-2]:n]):
        merged.pop(-2)
    return merged


class _Model:
    """The CP-SAT relaxation for one graph, points and budget (see the module docstring)."""

    def __init__(self, graph: CostGraph, points: list[int], budget_bytes: int | None,
                 *, objective: bool = True, deadline: float | None = None,
                 probe_until: float | None = None, steps: int | None = None):
        """With ``budget_bytes=None`` the room above the base is a variable and the objective
        is to minimize it (the least peak of the space). Replays are probed shortest region
        first until ``probe_until`` (a `time.perf_counter` value; None: all of them); the
        others get their constraint when a candidate uses them (`add_replays`).

        ``steps``: a bound model (`BOUND_STEPS`, searched by `_solve_lazy` on large models):
        only that many of the memory constraints of forward nodes and backward steps
        (`_keep_spread`), and no replay constraints."""
        from ortools.sat.python import cp_model

        self.cp_model = cp_model
        self.g, self.points, self.deadline = graph, points, deadline
        #: a bound model's step constraints, (constant, terms), until `_keep_spread` picks
        self.deferred: list[tuple[int, list[tuple[int, Any]]]] | None = \
            None if steps is None else []
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
        static = Static.of(g)
        pos, done = static.pos, static.done
        end = len(g.bwd_steps) - 1
        unit_done = [-1] * n_units
        for x in names:
            if g.node(x).saved:
                unit_done[unit[x]] = max(unit_done[unit[x]], done[x])
        self.unit_done = unit_done
        readers_of = storage_readers(g)

        # -- holding terms of each storage: (threshold step, literal-or-True) ---------------
        self._cache: dict[Any, Any] = {}
        # (prod_pos, last_pos, bytes, held in forward, [(last step it holds, literal)])
        items: list[tuple[int, int, int, Any, list[tuple[int, Any]]]] = []
        for sid, st in g.storages.items():
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
                for ru in sorted({unit[r] for r in readers_of[sid] if r in unit} - {pu}):
                    # the frame of ru's region keeps it; in backward counted while ru's own
                    # savers are to come (the region is alive then); held longer by other
                    # units of that region, it is left out: a weaker relaxation, still valid
                    terms.append((unit_done[ru], self._frame(pu, ru)))
            held = self._or([t for _, t in terms])
            items.append((pos[st.producer], pos[st.last_use], st.bytes, held, terms))

        # -- forward: before each node's events, what is alive after the previous node ------
        # (tracked incrementally: a storage is constant bytes from its producer to its last
        # reader, then its held literal's)
        enter: dict[int, list[int]] = defaultdict(list)
        leave: dict[int, list[int]] = defaultdict(list)
        for j, (p, last, _, _, _) in enumerate(items):
            enter[p + 1].append(j)
            leave[max(last, p) + 1].append(j)
        # A node's constraint is implied by a later node's whose constant is at least as high:
        # the literal part only grows along forward (storages move from the constant to their
        # held literal). So only nodes above every later node's constant get a constraint.
        tops: list[int] = []
        const = 0
        fwd_peak = static.fwd_peak
        for i in range(len(g.nodes)):
            for j in enter.get(i, ()):
                const += items[j][2]
            for j in leave.get(i, ()):
                if items[j][3] is not True:
                    const -= items[j][2]
            tops.append(const + fwd_peak[i])
        needed, later = set(), None
        for i in range(len(tops) - 1, -1, -1):
            if later is None or tops[i] > later:
                needed.add(i)
                later = tops[i]
        coef = _Terms()
        for i in range(len(g.nodes)):
            self._check_time()
            for j in leave.get(i, ()):
                held = items[j][3]
                if held is not True and held is not False:
                    coef.add(held, items[j][2])
            if i in needed:
                self._fits(tops[i], coef.pairs(), room)

        # -- replays: every region the space allows, and the copies each leaves alive ---------
        n_steps = len(g.bwd_steps)
        copies: list[list[tuple[int, Any]]] = [[] for _ in range(n_steps)]
        self.probe = ReplayProbe(g)
        self.probed: dict[tuple[int, int], Any] = {}
        bursts = self._bursts(copies, probe_until)
        self.copies = copies

        # -- backward: each step, with its recorded gradient peak ---------------------------
        # A storage's literal at step k is the OR of its terms that still hold (last step >=
        # k): it only weakens as k grows (and the constant only falls), so a step whose
        # constant part is no higher than an earlier step's (and that has no replayed copies)
        # is implied by that step.
        changes: dict[int, list[int]] = defaultdict(list)
        lit_of: list[Any] = [False] * len(items)
        const, coef = 0, _Terms()
        for j, (_, _, b, _, terms) in enumerate(items):
            for t in {thr for thr, _ in terms if thr >= 0}:
                changes[t + 1].append(j)
            lit = lit_of[j] = self._or([t for thr, t in terms if thr >= 0])
            if lit is True:
                const += b
            elif lit is not False:
                coef.add(lit, b)
        grad_cur, highest, grads = 0, -1, gradient_steps(g)
        # what is alive before a step, kept for the steps a replay can happen at: a region
        # replays at the first backward step of its savers, so at some unit's first one
        first_of: dict[int, int] = {}
        for k, st in enumerate(g.bwd_steps):
            if st.node in unit and g.node(st.node).saved:
                first_of.setdefault(unit[st.node], k)
        replay_steps = set(first_of.values())
        alive_before: dict[int, tuple[int, list[tuple[int, Any]]]] = {}
        self.alive_before = alive_before
        for k in range(len(g.bwd_steps)):
            self._check_time()
            for j in changes.get(k, ()):
                b, terms = items[j][2], items[j][4]
                old, new = lit_of[j], self._or([t for thr, t in terms if thr >= k])
                if old is new:
                    continue
                if old is True:
                    const -= b
                elif old is not False:
                    coef.add(old, -b)
                if new is True:
                    const += b
                elif new is not False:
                    coef.add(new, b)
                lit_of[j] = new
            top, net = grads[k][1], grads[k][2]
            peak, run = grad_cur + max(0, top or 0), grad_cur + net
            if k in replay_steps:
                alive_before[k] = (grad_cur + const, coef.pairs())
            if copies[k] or const + peak > highest:
                self._fits(const + peak, coef.pairs() + copies[k], room)
            highest = max(highest, const + peak)
            grad_cur = run
        if self.deferred is not None:
            self._keep_spread(steps, room)
        else:
            for step, extra, y in bursts:
                self._burst_fits(step, extra, y)

        # -- objective: replayed forward time, ns -------------------------------------------
        if objective:
            terms = []
            call_ns = round(g.checkpoint_call_s * _NS)
            for u, (a, b) in enumerate(zip(points, points[1:])):
                full = sum(g.node(x).time_s for x in names[a:b])
                savers = [x for x in names[a:b] if g.node(x).saved]
                last = savers[-1] if savers else None
                pref = 0.0
                if last is not None:
                    upto = names[a:names.index(last) + 1]
                    pref = sum(g.node(x).time_s for x in upto)
                    if g.replay_mark(last) == 0:  # the replay stops before it runs
                        pref -= g.node(last).time_s
                # the checkpoint's hooks for each tensor the unit's nodes save
                hooks = g.checkpoint_saved_s * sum(len(g.node(x).saved) for x in names[a:b])
                # each rounded to within half a ns: the objective is within 2 ns a unit
                full_ns, pref_ns = round(full * _NS), round(pref * _NS)
                terms.append((full_ns + round(hooks * _NS)) * rc[u])
                if full_ns != pref_ns:
                    z = m.NewBoolVar(f"z{u}")
                    m.AddImplication(z, rc[u])
                    if cut[u + 1] is not None:
                        m.AddImplication(z, cut[u + 1])
                    terms.append(-(full_ns - pref_ns) * z)
                if call_ns:  # the checkpoint call, once a recompute region: at its first unit
                    if u == 0:
                        terms.append(call_ns * rc[u])
                    else:
                        first = m.NewBoolVar(f"first{u}")
                        m.AddBoolOr([rc[u].Not(), cut[u].Not(), first])
                        terms.append(call_ns * first)
            m.Minimize(sum(terms))

    def _bursts(self, copies: list[list[tuple[int, Any]]], until: float | None
                ) -> list[tuple[int, int, Any]]:
        """Replays, shortest regions first (until ``until``): see `_region`. Returns (step it
        is replayed at, the replay's own peak, y) for each, and adds to ``copies[k]`` the
        (bytes, y) of the copies it leaves alive at step k."""
        n_units = len(self.points) - 1
        bursts = []
        for span in range(n_units):
            for a in range(n_units - span):
                self._check_time()
                if until is not None and time.perf_counter() > until:
                    return bursts
                got = self._region(a, a + span, copies)
                if got is not None:
                    bursts.append(got)
        return bursts

    def _region(self, a: int, b: int, copies: list[list[tuple[int, Any]]] | None
                ) -> tuple[int, int, Any] | None:
        """Probe the recompute region over units ``a..b``: a literal ``y``, true when the
        schedule has that region; (replay step, the replay's own peak, y), or None when it is
        never replayed. Its replayed copies go into ``copies`` when given."""
        pts, cut, rc, m = self.points, self.cut, self.rc, self.m
        if (a, b) in self.probed:
            return None
        step, extra, freed = self.probe(pts[a], pts[b + 1])
        self.probed[a, b] = None
        if step is None:
            return None
        when = [rc[a], *(cut[c].Not() for c in range(a + 1, b + 1))]
        if a > 0:
            when.append(cut[a])
        if b + 1 < len(rc):
            when.append(cut[b + 1])
        y = m.NewBoolVar(f"region{a}_{b}")
        m.AddBoolOr([*(w.Not() for w in when), y])  # the region is there -> y
        self.probed[a, b] = y
        if copies is not None:
            held = sum(freed.values())
            for k in range(step, max(freed, default=-1) + 1):
                if held:
                    copies[k].append((held, y))
                held -= freed.get(k, 0)
        return step, extra, y

    def _burst_fits(self, step: int, extra: int, y: Any) -> None:
        """What is alive before the replay, plus the replay's own peak, fits (when y)."""
        base, expr = self.alive_before[step]
        terms = expr + [(h, z) for h, z in self.copies[step] if z is not y]
        if terms or not isinstance(self.room, int):
            self.m.Add(_linear(terms) + base + extra <= self.room).OnlyEnforceIf(y)
        elif base + extra > self.room:
            self.m.Add(y == 0)

    def add_replays(self, schedule: Schedule) -> None:
        """The replay constraints of ``schedule``'s recompute regions not probed yet (their
        copies are left out of other steps: a weaker relaxation, still valid)."""
        first_unit = {p: u for u, p in enumerate(self.points)}
        i = 0
        for r in schedule.regions:
            a, i = i, i + len(r.nodes)
            if r.recompute and a in first_unit and i in first_unit:
                got = self._region(first_unit[a], first_unit[i] - 1, None)
                if got is not None:
                    self._burst_fits(*got)

    def _check_time(self) -> None:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise TimeoutError("cpsat: out of time while building the model")

    def _fits(self, const: int, expr: list[tuple[int, Any]], room: Any) -> None:
        if not expr and isinstance(room, int):
            if const > room:
                self.m.AddBoolOr([])  # infeasible whatever the schedule
            return
        if self.deferred is not None:
            self.deferred.append((const, expr))
            return
        self.m.Add(_linear(expr) + const <= room)

    def _keep_spread(self, most: int, room: int) -> None:
        """Add ``most`` of the deferred step constraints: of those some schedule could break
        (constant plus every positive term above the room), evenly spaced along the step."""
        deferred, self.deferred = self.deferred or [], None
        over = [(c, e) for c, e in deferred if c + sum(b for b, _ in e if b > 0) > room]
        if len(over) > most:
            over = [over[int(i * len(over) / most)] for i in range(most)]
        for const, expr in over:
            self._fits(const, expr, room)

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
        """Warm start from ``schedule``, its region boundaries moved to the nearest unit
        points (a hint need not be feasible); returns whether none had to move."""
        bounds, i = [0], 0
        policy = []
        for r in schedule.regions:
            i += len(r.nodes)
            bounds.append(i)
            policy.append(r.recompute)
        pts = self.points
        snapped = [min(pts, key=lambda p: (abs(p - b), p)) for b in bounds]
        region = 0
        for u, p in enumerate(pts[:-1]):
            while region + 1 < len(snapped) - 1 and snapped[region + 1] <= p:
                region += 1
            self.m.AddHint(self.rc[u], policy[region])
            if self.cut[u] is not None:
                self.m.AddHint(self.cut[u], p in snapped)
        return snapped == bounds

    def forbid(self, solver: Any) -> None:
        """No-good: exclude the current assignment of cuts and policies."""
        lits = []
        for v in [*self.rc, *(c for c in self.cut if c is not None)]:
            lits.append(v.Not() if solver.Value(v) else v)
        self.m.AddBoolOr(lits)


class _Terms:
    """A linear sum of literals, by literal: (bytes, literal) pairs merged."""

    def __init__(self) -> None:
        self.by: dict[int, list[Any]] = {}

    def add(self, lit: Any, b: int) -> None:
        entry = self.by.setdefault(lit.Index(), [0, lit])
        entry[0] += b
        if entry[0] == 0:
            del self.by[lit.Index()]

    def pairs(self) -> list[tuple[int, Any]]:
        return [(b, lit) for b, lit in self.by.values()]


def _linear(pairs: list[tuple[int, Any]]) -> Any:
    """``sum(b * lit)`` as one CP-SAT expression (built in C++, not term by term)."""
    from ortools.sat.python import cp_model

    return cp_model.LinearExpr.WeightedSum([lit for _, lit in pairs], [b for b, _ in pairs])


#: models with more constraints than this are first searched without CP-SAT's presolve (on
#: the 2,000-node synthetic DAG, about 14k constraints, presolve takes 5 to 7 s)
LARGE_MODEL = 5000


def _probe_until(deadline: float | None) -> float | None:
    """Probing replays up front may take a tenth of the time left; the rest are added as
    candidates use them (on the 2,000-node synthetic DAG, probing all 1,176 regions takes
    longer than CP-SAT's search for a first answer)."""
    if deadline is None:
        return None
    return time.perf_counter() + (deadline - time.perf_counter()) / 10


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
    (``"TIMEOUT"`` when time ran out first; the bound is then CP-SAT's, when it has one).

    Every improving solution CP-SAT reports on the way is simulated (`_Incumbents`): when time
    runs out, or the last one breaks a replay the model had not probed yet, the best that fits
    is the answer (FEASIBLE)."""
    from ortools.sat.python import cp_model

    try:
        model = _Model(graph, points, budget, deadline=deadline,
                       probe_until=_probe_until(deadline))
    except TimeoutError:
        return "TIMEOUT", None, None
    if warm is not None:
        model.hint(warm)
    seen = _Incumbents(model, graph, budget)
    if deadline is not None and len(model.m.Proto().constraints) > LARGE_MODEL:
        # CP-SAT's presolve of a large model can take most of the limit before the first
        # solution: search without it for half the time (good answers, no bound),
        # then go on with a bound model, hinted with the best answer that fits
        quick = _cp_solver(time.perf_counter() + (deadline - time.perf_counter()) / 2)
        if quick is not None:
            quick.parameters.cp_model_presolve = False
            if quick.Solve(model.m, seen.callback()) == cp_model.INFEASIBLE:
                return INFEASIBLE, None, None
        try:
            model = _Model(graph, points, budget, deadline=deadline,
                           probe_until=time.perf_counter(), steps=BOUND_STEPS)
        except TimeoutError:
            return ("TIMEOUT", None, None) if seen.best is None else (
                FEASIBLE, seen.best[1], None)
        if seen.best is not None:
            model.hint(seen.best[1])
        seen.model = model
    bound = None
    while (solver := _cp_solver(deadline)) is not None:
        st = solver.Solve(model.m, seen.callback())
        if st == cp_model.INFEASIBLE:
            return INFEASIBLE, None, None
        # the master is a relaxation: its bound holds over the space (no-goods only cut off
        # schedules that do not fit), less what rounding node times to ns may have added
        got = max(0.0, solver.BestObjectiveBound() - 2 * (len(points) - 1)) / _NS
        bound = got if bound is None else max(bound, got)
        if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break
        sched = model.schedule(solver)
        est = simulate(graph, sched)
        if est.peak_bytes <= budget:
            if st == cp_model.OPTIMAL:
                return OPTIMAL, sched, est.recompute_s
            return FEASIBLE, sched, bound
        model.add_replays(sched)
        model.forbid(solver)
    if seen.best is not None:
        return FEASIBLE, seen.best[1], bound
    return "TIMEOUT", None, bound


#: the memory constraints a bound model keeps (large models, after their quick search): on
#: the 2,000-node synthetic DAG at 70% (before it carried checkpoint costs), given 5 s, 20
#: evenly spread ones gave a bound of 0.25 s and 60 gave 0.27 s (the best schedule known was
#: about 0.40 s; the full model's presolve alone takes 5 to 7 s)
BOUND_STEPS = 60


class _Incumbents:
    """The best schedule that fits (by the simulator) among the solutions CP-SAT reports."""

    def __init__(self, model: "_Model", graph: CostGraph, budget: int):
        self.model, self.graph, self.budget = model, graph, budget
        self.best: tuple[float, Schedule] | None = None

    def callback(self) -> Any:
        from ortools.sat.python import cp_model

        outer = self

        class _Callback(cp_model.CpSolverSolutionCallback):
            def on_solution_callback(self) -> None:
                if outer.best is not None and self.ObjectiveValue() / _NS >= outer.best[0]:
                    return
                sched = outer.model.schedule(self)
                est = simulate(outer.graph, sched)
                if est.peak_bytes <= outer.budget and (
                        outer.best is None or est.recompute_s < outer.best[0]):
                    outer.best = (est.recompute_s, sched)

        return _Callback()


def _min_feasible(graph: CostGraph, points: list[int], deadline: float | None) -> int | None:
    """The least peak of any schedule in the space (the master minimizes the room above the
    base; each answer is simulated and cut off if the simulator disagrees)."""
    from ortools.sat.python import cp_model

    try:
        model = _Model(graph, points, None, deadline=deadline, probe_until=_probe_until(deadline))
    except TimeoutError:
        return None
    best = None
    while (solver := _cp_solver(deadline)) is not None:
        st = solver.Solve(model.m)
        if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break
        peak = simulate(graph, model.schedule(solver)).peak_bytes
        best = peak if best is None else min(best, peak)
        if st == cp_model.OPTIMAL and best <= solver.Value(model.room) + graph.base_bytes:
            break  # the room is a lower bound on every schedule not yet seen
        model.add_replays(model.schedule(solver))
        model.forbid(solver)
    return best


#: cheap baselines (one simulation each) that warm-start cpsat and stand in when it runs out
#: of time
WARM_STARTS = ("every_block", "sqrt", "uniform:2", "uniform:4")


def warm_start(graph: CostGraph, budget_bytes: int, given: Schedule | None = None
               ) -> SolveResult | None:
    """The fitting result with the least recompute time among `WARM_STARTS` (and
    ``given``), or None."""
    from .base import get_solver

    results = [get_solver(name)(graph, budget_bytes) for name in WARM_STARTS]
    if given is not None:
        results.append(finish(graph, budget_bytes, given, solver=given.solver or "given",
                              started=time.perf_counter()))
    fitting = [r for r in results if r.status != INFEASIBLE]
    # ties go to the first listed
    return min(fitting, key=lambda r: r.estimate.recompute_s,  # type: ignore[union-attr]
               default=None)


@register("cpsat")
def cpsat(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
          ) -> SolveResult:
    """CP-SAT over region schedules at `unit_points` (see the module docstring), warm-started
    with the best fitting cheap baseline. Out of time, it returns the better of the best
    schedule found that fits and that baseline, as FEASIBLE with CP-SAT's proven bound over
    the space as ``space_bound_s`` (when there is one; no higher than the baseline's time,
    which may lie off the unit points)."""
    return _cpsat(graph, budget_bytes, time_limit_s, unit_points(graph), "cpsat",
                  "cpsat unit points")


#: `cpsat_fine` without a schedule to start from runs `cpsat` first for this share of its
#: limit: its space is finer, but CP-SAT searches it more slowly (on the 12-layer HF GPT-2 at
#: 90% of its peak, within 10 s, from the cheap baselines alone it answered 13.17 ms where
#: `cpsat` answers 3.14 in 1.4 s)
FINE_WARM_SHARE = 0.25

#: `fine_points` keeps at most this many units (the search is O(units^2) in probes)
FINE_UNITS = 96


def fine_points(graph: CostGraph, *, max_units: int = FINE_UNITS) -> list[int]:
    """`unit_points` with each unit split after every node that saves tensors but its last
    (so every unit still has one): a boundary may fall after any saver. Beyond ``max_units``
    units, the extra points are evenly thinned. Always a superset of `unit_points`."""
    base = unit_points(graph)
    names = graph.compute_nodes
    extra = [i + 1 for a, b in zip(base, base[1:])
             for i in [j for j in range(a, b) if graph.node(names[j]).saved][:-1]]
    room = max(0, max_units + 1 - len(base))
    if len(extra) > room:
        extra = [extra[int(i * len(extra) / room)] for i in range(room)]
    return sorted({*base, *extra})


@register("cpsat_fine")
def cpsat_fine(graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None,
               warm: Schedule | None = None) -> SolveResult:
    """`cpsat` over `fine_points`: a region boundary may fall after any node that saves
    tensors (up to `FINE_UNITS` units), not only where few tensors cross. A space that holds
    `cpsat`'s, so its optimum is never worse; on the recorded graphs CP-SAT finds schedules
    10 to 25% faster than `dp`'s and `cpsat`'s optima within seconds, but rarely proves them
    optimal over its space (it stops at ``time_limit_s``, FEASIBLE, often with no useful bound
    over the space; its gap is to the full-space bound like any result's). ``warm``: a
    schedule to start from besides the cheap baselines (`auto` gives its best so far); without
    one, `cpsat` runs first, for `FINE_WARM_SHARE` of the limit, and its answer is the start."""
    started = time.perf_counter()
    if warm is None:
        first = cpsat(graph, budget_bytes, time_limit_s=None if time_limit_s is None
                      else FINE_WARM_SHARE * time_limit_s)
        warm = first.schedule if first.status != INFEASIBLE else None
        if time_limit_s is not None:
            time_limit_s = max(0.0, time_limit_s - (time.perf_counter() - started))
    return _cpsat(graph, budget_bytes, time_limit_s, fine_points(graph), "cpsat_fine",
                  "a boundary after any node that saves tensors (cpsat_fine)", warm,
                  started=started)


#: with a time limit, the search stops early enough for the caller's `certify` (its bound
#: solve: `SolverConfig.bound_s`, but at most this share of the limit) to fit within it
BOUND_SHARE = 0.1


def _cpsat(graph: CostGraph, budget_bytes: int, time_limit_s: float | None,
           points: list[int], name: str, space: str, given: Schedule | None = None,
           started: float | None = None) -> SolveResult:
    at = time.perf_counter()
    started = at if started is None else started  # (its solve_s counts from there)
    deadline = search_until = None if time_limit_s is None else at + time_limit_s
    if time_limit_s is not None:
        search_until = at + time_limit_s - min(SolverConfig().bound_s,
                                               BOUND_SHARE * time_limit_s)
    warm_result = warm_start(graph, budget_bytes, given)
    warm = None if warm_result is None else warm_result.schedule
    status, sched, bound = _solve_lazy(graph, points, budget_bytes, search_until, warm)
    if sched is not None:
        sched = replace(sched, meta={**sched.meta, "space": space})
    if status == INFEASIBLE:  # proven: nothing in the space fits
        if warm is not None:  # ... but a baseline off the points does
            return finish(graph, budget_bytes, warm, solver=name, started=started,
                          status=FEASIBLE)
        return finish(graph, budget_bytes, None, solver=name, started=started,
                      status=INFEASIBLE,
                      min_feasible_bytes=_min_feasible(graph, points, deadline))
    warm_s = None if warm_result is None else warm_result.estimate.recompute_s
    if status != OPTIMAL and warm_s is not None and bound is not None:
        bound = min(bound, warm_s)  # a bound over the points and the warm start
    if status != OPTIMAL and warm_s is not None and (
            sched is None or warm_s < simulate(graph, sched).recompute_s):
        # out of time before finding a schedule that fits, or one that beats the warm start
        return finish(graph, budget_bytes, warm, solver=name, started=started,
                      status=FEASIBLE, lower_bound_s=bound)
    if sched is None:
        return finish(graph, budget_bytes, None, solver=name, started=started,
                      status=INFEASIBLE)
    return finish(graph, budget_bytes, sched, solver=name, started=started,
                  status=status, lower_bound_s=bound)
