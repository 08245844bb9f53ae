"""The CP-SAT model that `cpsat` searches: region schedules over unit points, one graph and budget.

**Variables.** Booleans ``cut[c]`` (a region boundary at point c) and ``rc[u]`` (unit u is
recomputed; units of one region share it). A storage is *held* past its last forward reader
when a node in a keep unit saved it, or when a recompute region other than its producer's reads
it (the checkpoint keeps region inputs).

**Constraints.** For every forward node and every backward step, the bytes alive there, as the
simulator counts them minus the replay bursts, plus the recorded op temporaries and gradients,
must fit the budget; each replay, with the copies it leaves alive, must fit at its step.
Held-until-step is bounded from below (a region keeps its inputs at least until the backward
of its unit's last saver).

**Objective.** The replayed forward time plus the checkpoint's costs (per call, per saved
tensor), in integer nanoseconds, exactly as the simulator computes it (replay stops at a
region's last node that saves something).

So the model is a relaxation: it never rejects a schedule the simulator accepts, and its
objective is exact (within 2 ns a unit, from rounding node times).

Building is incremental: a storage's bytes enter the forward sums at its producer and turn into
its held literal after its last reader; in backward its literal weakens at each holder's step.
Sums that another sum implies are left out: along forward the literal part only grows, so a
node gets a constraint only when its constant part is above every later node's; along backward
it only shrinks, so a step gets one only when its constant part is above every earlier step's
(or a replay leaves copies there). Replays are probed shortest region first until a given
time; the rest get their constraint when a candidate uses one (`CpsatModel.add_replays`).
Dropping a constraint only weakens the relaxation; the simulator still checks every answer.

Size: O(units^2 + storages) Booleans and O(nodes + backward steps + units^2) linear
constraints; probing every replay is O(units^2 * nodes).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, NamedTuple

from ..cost.simulate import ReplayProbe, gradient_steps, storage_readers
from ..cost.static import Static
from ..ir.graph import CostGraph
from ..ir.replays import recompute_limits
from ..ir.schedule import Schedule
from .cpsat_literals import Literals, Terms, linear
from .cpsat_space import NS, region_schedule, replay_steps, snap, unit_costs_ns, units

__all__ = ["CpsatModel"]


class _Holding(NamedTuple):
    """One storage: positions of its producer and last forward reader, its bytes, the literal
    (or constant) that holds it past that reader, and its backward terms."""

    producer: int
    last: int
    nbytes: int
    held: Any
    #: (last backward step it holds, literal or True) for each reason it is held
    terms: list[tuple[int, Any]]


class CpsatModel:
    """The CP-SAT relaxation for one graph, points and budget (see the module docstring).

    Built top to bottom: the space's data (`cpsat_space`), the variables (`_policies`, the room),
    the constraints (`_holdings`, `_forward`, `_replays`, `_backward`) and the objective
    (`_recompute_ns`). Between solves: `schedule` reads a solution, `hint` warm-starts,
    `add_replays` and `forbid` tighten the model."""

    def __init__(self, graph: CostGraph, points: list[int], budget_bytes: int | None,
                 *, objective: bool = True, deadline: float | None = None,
                 probe_until: float | None = None, steps: int | None = None):
        """With ``budget_bytes=None`` the room above the base is a variable and the objective
        is to minimize it (the least peak of the space). Replays are probed shortest region
        first until ``probe_until`` (a `time.perf_counter` value; None: all of them); the
        others get their constraint when a candidate uses them (`add_replays`). Past
        ``deadline``, building raises `TimeoutError`.

        ``steps``: a bound model (searched by `cpsat.solve_lazy` on large models): only that
        many of the memory constraints of forward nodes and backward steps (`_keep_spread`),
        and no replay constraints."""
        from ortools.sat.python import cp_model

        # -- data ----------------------------------------------------------------------------
        self.g, self.points, self.deadline = graph, points, deadline
        self.static = Static.of(graph)
        self.unit, self.unit_done = units(graph, points)
        #: a bound model's step constraints, (constant, terms), until `_keep_spread` picks
        self.deferred: list[tuple[int, list[tuple[int, Any]]]] | None = \
            None if steps is None else []
        self.m = cp_model.CpModel()

        # -- variables -----------------------------------------------------------------------
        self.rc, self.cut = self._policies()
        self.lits = Literals(self.m, self.rc, self.cut)
        self.room: Any = (self.m.NewIntVar(0, 2 ** 50, "room") if budget_bytes is None
                          else budget_bytes - graph.base_bytes)

        # -- constraints ---------------------------------------------------------------------
        items = self._holdings()
        self._forward(items)
        bursts = self._replays(probe_until)
        self._backward(items)
        if steps is not None:
            self._keep_spread(steps)
        else:
            for step, extra, y in bursts:
                self._burst_fits(step, extra, y)

        # -- objective -----------------------------------------------------------------------
        if budget_bytes is None:
            self.m.Minimize(self.room)
        elif objective:
            self.m.Minimize(self._recompute_ns())

    # -- building ------------------------------------------------------------------------------

    def _policies(self) -> tuple[list[Any], list[Any]]:
        """``rc[u]`` and ``cut[c]`` (None at both ends), units of one region sharing their
        policy, with no boundary between two keep units."""
        m, n_units = self.m, len(self.points) - 1
        rc = [m.NewBoolVar(f"rc{u}") for u in range(n_units)]
        cut = [None] + [m.NewBoolVar(f"cut{c}") for c in self.points[1:-1]] + [None]
        for u in range(n_units - 1):
            m.Add(rc[u] == rc[u + 1]).OnlyEnforceIf(cut[u + 1].Not())
            m.AddBoolOr([rc[u], rc[u + 1]]).OnlyEnforceIf(cut[u + 1])  # no keep|keep cut
        # no recompute region the rewriter would refuse (`ir.replays`): one that starts at
        # unit u ends by the last unit within its limit
        limits = recompute_limits(self.g)
        for u in range(n_units):
            reach = limits[self.points[u]]
            last = max((v for v in range(u, n_units) if self.points[v + 1] <= reach),
                       default=u - 1)
            if last < n_units - 1:
                starts = [cut[u].Not()] if cut[u] is not None else []
                m.AddBoolOr([*starts, rc[u].Not(), *(cut[v + 1] for v in range(u, last + 1))])
        return rc, cut

    def _holdings(self) -> list[_Holding]:
        """Each storage that counts (not freed inside its node), with its holding terms."""
        g, unit, done, pos = self.g, self.unit, self.static.done, self.static.pos
        end = len(g.bwd_steps) - 1
        readers_of = storage_readers(g)
        items = []
        for sid, st in g.storages.items():
            if st.inner_free:
                continue
            terms: list[tuple[int, Any]] = []
            if st.output and st.producer == g.meta.get("loss_node"):
                terms.append((end, True))  # the step holds the loss until backward ends
            for s in st.savers:
                if s in unit:
                    terms.append((done[s], self.rc[unit[s]].Not()))
                else:  # the loss: always keep
                    terms.append((done[s], True))
            if st.output and st.producer in unit:
                pu = unit[st.producer]
                for ru in sorted({unit[r] for r in readers_of[sid] if r in unit} - {pu}):
                    # the frame of ru's region keeps it; in backward counted while ru's own
                    # savers are to come (the region is alive then); held longer by other
                    # units of that region, it is left out: a weaker relaxation, still valid
                    terms.append((self.unit_done[ru], self.lits.frame(pu, ru)))
            held = self.lits.any_of([t for _, t in terms])
            items.append(_Holding(pos[st.producer], pos[st.last_use], st.bytes, held, terms))
        return items

    def _forward(self, items: list[_Holding]) -> None:
        """Before each node's events, what is alive after the previous node, plus the node's
        own peak, fits: a storage counts as constant bytes from its producer to its last
        reader, then as its held literal's. Only nodes whose constant part is above every
        later node's get a constraint (the literal part only grows along forward)."""
        g = self.g
        enter: dict[int, list[int]] = defaultdict(list)
        leave: dict[int, list[int]] = defaultdict(list)
        for j, h in enumerate(items):
            enter[h.producer + 1].append(j)
            leave[max(h.last, h.producer) + 1].append(j)
        tops: list[int] = []
        const = 0
        fwd_peak = self.static.fwd_peak
        for i in range(len(g.nodes)):
            for j in enter.get(i, ()):
                const += items[j].nbytes
            for j in leave.get(i, ()):
                if items[j].held is not True:
                    const -= items[j].nbytes
            tops.append(const + fwd_peak[i])
        needed, later = set(), None
        for i in range(len(tops) - 1, -1, -1):
            if later is None or tops[i] > later:
                needed.add(i)
                later = tops[i]
        coef = Terms()
        for i in range(len(g.nodes)):
            self._check_time()
            for j in leave.get(i, ()):
                held = items[j].held
                if held is not True and held is not False:
                    coef.add(held, items[j].nbytes)
            if i in needed:
                self._fits(tops[i], coef.pairs())

    def _replays(self, until: float | None) -> list[tuple[int, int, Any]]:
        """Probe replays, shortest regions first, until ``until``: see `_region`. Returns
        (step it is replayed at, the replay's own peak, y) for each, and keeps in
        ``self.copies[k]`` the (bytes, y) of the copies each leaves alive at step k."""
        self.copies: list[list[tuple[int, Any]]] = [[] for _ in self.g.bwd_steps]
        self.probe = ReplayProbe(self.g)
        self.probed: dict[tuple[int, int], Any] = {}
        n_units = len(self.points) - 1
        bursts = []
        for span in range(n_units):
            for a in range(n_units - span):
                self._check_time()
                if until is not None and time.perf_counter() > until:
                    return bursts
                got = self._region(a, a + span, self.copies)
                if got is not None:
                    bursts.append(got)
        return bursts

    def _backward(self, items: list[_Holding]) -> None:
        """Each backward step, with its recorded gradient peak and the copies replays leave
        there, fits. A storage's literal at step k is the OR of its terms that still hold
        (last step >= k): it only weakens as k grows (and the constant only falls), so a step
        whose constant part is no higher than an earlier step's (and that has no replayed
        copies) is implied by that step and left out. Keeps what is alive before each step a
        replay can happen at in ``self.alive_before``."""
        g = self.g
        changes: dict[int, list[int]] = defaultdict(list)
        lit_of: list[Any] = [False] * len(items)
        const, coef = 0, Terms()
        for j, h in enumerate(items):
            for t in {thr for thr, _ in h.terms if thr >= 0}:
                changes[t + 1].append(j)
            lit = lit_of[j] = self.lits.any_of([t for thr, t in h.terms if thr >= 0])
            if lit is True:
                const += h.nbytes
            elif lit is not False:
                coef.add(lit, h.nbytes)
        grad_cur, highest, grads = 0, -1, gradient_steps(g)
        at_replay = replay_steps(g, self.unit)
        self.alive_before: dict[int, tuple[int, list[tuple[int, Any]]]] = {}
        for k in range(len(g.bwd_steps)):
            self._check_time()
            for j in changes.get(k, ()):
                b, terms = items[j].nbytes, items[j].terms
                old, new = lit_of[j], self.lits.any_of([t for thr, t in terms if thr >= k])
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
            if k in at_replay:
                self.alive_before[k] = (grad_cur + const, coef.pairs())
            if self.copies[k] or const + peak > highest:
                self._fits(const + peak, coef.pairs() + self.copies[k])
            highest = max(highest, const + peak)
            grad_cur = run

    def _recompute_ns(self) -> Any:
        """The objective: replayed forward time plus the checkpoint's costs, in ns
        (`unit_costs_ns`)."""
        g, m, rc, cut = self.g, self.m, self.rc, self.cut
        terms = []
        call_ns = round(g.checkpoint_call_s * NS)
        for u, (cost, tail) in enumerate(unit_costs_ns(g, self.points)):
            terms.append(cost * rc[u])
            if tail:  # z: the unit ends its recompute region, whose replay stops before
                z = m.NewBoolVar(f"z{u}")
                m.AddImplication(z, rc[u])
                if cut[u + 1] is not None:
                    m.AddImplication(z, cut[u + 1])
                terms.append(-tail * z)
            if call_ns:  # the checkpoint call, once a recompute region: at its first unit
                if u == 0:
                    terms.append(call_ns * rc[u])
                else:
                    first = m.NewBoolVar(f"first{u}")
                    m.AddBoolOr([rc[u].Not(), cut[u].Not(), first])
                    terms.append(call_ns * first)
        return sum(terms)

    # -- replays -------------------------------------------------------------------------------

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
            self.m.Add(linear(terms) + base + extra <= self.room).OnlyEnforceIf(y)
        elif base + extra > self.room:
            self.m.Add(y == 0)

    def add_replays(self, schedule: Schedule) -> None:
        """The replay constraints of ``schedule``'s recompute regions not probed yet (their
        copies are left out of other steps: a weaker relaxation, still valid)."""
        if schedule.nested:
            raise ValueError("cpsat's replay constraints are for flat schedules; this one "
                             f"nests regions (depth {schedule.depth})")
        first_unit = {p: u for u, p in enumerate(self.points)}
        i = 0
        for r in schedule.regions:
            a, i = i, i + len(r.nodes)
            if r.recompute and a in first_unit and i in first_unit:
                got = self._region(first_unit[a], first_unit[i] - 1, None)
                if got is not None:
                    self._burst_fits(*got)

    # -- helpers -----------------------------------------------------------------------------------

    def _check_time(self) -> None:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise TimeoutError("cpsat: out of time while building the model")

    def _fits(self, const: int, expr: list[tuple[int, Any]]) -> None:
        """``const + expr`` fits the room (a bound model defers it to `_keep_spread`)."""
        if not expr and isinstance(self.room, int):
            if const > self.room:
                self.m.AddBoolOr([])  # infeasible whatever the schedule
            return
        if self.deferred is not None:
            self.deferred.append((const, expr))
            return
        self.m.Add(linear(expr) + const <= self.room)

    def _keep_spread(self, most: int) -> None:
        """Add ``most`` of the deferred step constraints: of those some schedule could break
        (constant plus every positive term above the room), evenly spaced along the step."""
        deferred, self.deferred = self.deferred or [], None
        over = [(c, e) for c, e in deferred if c + sum(b for b, _ in e if b > 0) > self.room]
        if len(over) > most:
            over = [over[int(i * len(over) / most)] for i in range(most)]
        for const, expr in over:
            self._fits(const, expr)

    # -- solutions -----------------------------------------------------------------------------

    def schedule(self, solver: Any) -> Schedule:
        """The schedule of ``solver``'s current values (a solver or a solution callback)."""
        last = len(self.rc) - 1
        ends = [u == last or bool(solver.Value(self.cut[u + 1])) for u in range(last + 1)]
        return region_schedule(self.g, self.points, ends,
                               [bool(solver.Value(v)) for v in self.rc])

    def hint(self, schedule: Schedule) -> bool:
        """Warm start from ``schedule``, its region boundaries moved to the nearest unit
        points (`snap`; a hint need not be feasible); returns whether none had to move."""
        policy, is_bound, exact = snap(schedule, self.points)
        for u, rc in enumerate(self.rc):
            self.m.AddHint(rc, policy[u])
            if self.cut[u] is not None:
                self.m.AddHint(self.cut[u], is_bound[u])
        return exact

    def forbid(self, solver: Any) -> None:
        """No-good: exclude the current assignment of cuts and policies."""
        lits = []
        for v in [*self.rc, *(c for c in self.cut if c is not None)]:
            lits.append(v.Not() if solver.Value(v) else v)
        self.m.AddBoolOr(lits)

