"""A proven lower bound on recompute time over the *full* schedule space, and the schedules
its relaxation suggests.

The full space is every schedule `Schedule` can express on one level: region boundaries after
any compute node, each region ``keep`` or ``recompute``, and any save set. The exact solvers
search smaller spaces (`dp`: chain cuts and a few save sets; `cpsat`: unit points and no save
sets), so their own optimality proofs say nothing about schedules outside them. This module
bounds every schedule of the full space at once, so that a result can be called OPTIMAL only
when it is proven so over the full space (`finish` asks it), and its gap is honest otherwise.

**Relaxation** (`Relaxation`). Booleans ``r[p]``: node p runs again in a replay; ``a[s]``:
the storage s that forward made is itself used by backward (it stays alive from forward until
the first backward step that uses it; for a storage nothing saves: it is alive when forward
ends); ``link[i]``: nodes i-1 and i lie in one recompute region, both at or before its last
saver; ``cached[x]``: x is in its region's save set (its outputs kept from forward). Every
schedule of the full space maps to values that satisfy:

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
* in forward, before each node's events: the storages between their producer and last reader
  (alive in every schedule), the node's own highest running total and the kept storages whose
  last reader ran fit the budget; so do the kept storages when forward ends;
* at a backward step: its gradients (which no schedule changes), the storages some node whose
  backward spans that step saved (alive in every schedule), the kept storages not needed yet,
  forward's copies of storages needed before and again after it (unless their producer
  replays in one region with every later saver, `Relaxation._forward_copy`), cached outputs
  whose region has not replayed yet, and the region inputs still held fit the budget; at
  the first backward step of a saver z, so do the copies that z's region's replay made (a
  storage not kept whose producer is linked to z, needed after that step).

Those memory constraints go in lazily: `MAX_STEPS` of each kind up front (evenly spread over
those no earlier or later one implies), the others when a rounded schedule breaks the budget
there (`Relaxation.violated`, `Relaxation.add`, `relax_and_round`). Leaving one out only
weakens the relaxation. In a lean relaxation, each goes in as a sum built on the largest one
before whose terms are all among its own (`CHAINED`): consecutive steps hold nearly the same
storages.

The objective is what those replays cost at least (in whole picoseconds, `UNIT_S`, rounded
down): each replayed node's forward time; the checkpoint's hooks on the tensors saved by each
node in a region (replayed, cached or linked); the save-set dispatch of each such node in a
region that has a save set (a cached node linked to it), in forward, and again in the replay
for replayed and cached ones; and a checkpoint call for every replayed or cached node not
linked to its predecessor (it starts a region), at least one when anything replays.
Transient replay peaks, what a region holds after its last saver and the costs of its nodes
after that saver are left out, so the bound is below every fitting schedule's simulated
recompute time.

**Rounding** (`Relaxation.schedule`). A solution of the relaxation reads as a schedule: each
run of linked nodes, from a replayed or cached node that is not linked to its predecessor, is
a recompute region whose save set is its cached nodes; the rest is kept. Its simulated peak
may exceed the budget (what the relaxation leaves out), and its recompute time is at least
the solution's; when it fits and reaches the proven bound, it is optimal over the full space
(`relax`).

It is checked against brute force over the full space on small graphs, and against random
schedules with save sets and local changes of `relax`'s schedules on the recorded graphs,
and `finish` checks it against every exact solver's result (`BoundWarning`). On the recorded
graphs of up to 140 nodes CP-SAT proves it, with the constraints its rounded schedules broke,
in 1 to 10 s at most budgets; on larger ones, or within `BOUND_S`, the best bound found by
then stands.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..cost.simulate import Estimate, gradient_steps, simulate, storage_readers
from ..cost.static import Static
from ..ir.graph import CostGraph
from ..ir.schedule import KEEP, RECOMPUTE, Schedule

__all__ = ["BOUND_S", "LINK_SPAN", "MAX_STEPS", "SUBSOLVERS", "BoundWarning", "Relaxation",
           "far_reads", "full_space_bound", "relax_and_round", "remember_bound",
           "remembered_bound"]


class BoundWarning(RuntimeWarning):
    """The bound came out above the recompute time of a schedule that fits: a bug in the
    relaxation for this graph. The result then carries no bound (and is not OPTIMAL)."""


#: CP-SAT time for the bound `finish` gives every exact solver's result (one solve; stopped
#: early, the best bound found by then is still valid). Short, so that `dp` stays within about
#: a second a budget; `relax` (and `auto`, which runs it first) bounds with more time, and a
#: better bound it finds replaces this one
BOUND_S = 0.8

#: this many forward nodes, backward steps and replay steps each get a memory constraint up
#: front (evenly spread over those that are not implied by others); the rest when a rounded
#: schedule breaks them. Each has a term per storage it may hold: with 40 up front (and none
#: added later), CP-SAT took 94 s over four recorded graphs at 90, 70 and 50%, with 10, 40 s
#: (but weaker bounds, which the constraints added later make up)
MAX_STEPS = 10

#: CP-SAT's workers, one each: the bound comes from the LP-heavy ``max_lp`` (its cuts and
#: reduced-cost fixing), and ``lb_tree_search`` (a search that explores the node with the least
#: objective bound first) raises it where ``max_lp``'s cuts stall; schedules come from them and
#: from CP-SAT's LNS and local-search helpers, which it runs between them. On 2 cores, with
#: ``quick_restart`` in place of ``lb_tree_search``, `relax` at 10 s proved the 600-node
#: 12-layer HF GPT-2 at 90% of its peak optimal in 8 of 14 runs (5.0 to 10.1 s) and the GPT
#: graph at 50% in 2 of 3; with these two, in 10 of 10 (4.8 to 7.0 s) and 7 of 9 (7.3 to
#: 9.9 s; the other two at its optimum with a 2.3% gap), and `auto` alone proved them in 4 of 4
#: (3.7 to 5.3 s) and 2 of 2. ``lb_tree_search`` with ``quick_restart`` (no ``max_lp``) proved
#: neither in 3 and 2 runs. On the four recorded graphs of up to 140 nodes, at 90 and 70% (and
#: the U-Net at 50%) these two proved each in 0.1 to 1.7 s, as fast as or faster than with
#: ``quick_restart``, which had proved them about twice as fast as CP-SAT's default portfolio
#: of 8 (it time-shares the cores with workers that never move the bound)
SUBSOLVERS = ("max_lp", "lb_tree_search")

#: graphs with more compute nodes than this get a lean `Relaxation` (on the 600-node HF GPT-2
#: at 90% of its peak, CP-SAT proved the lean one at 2.312 ms in 4.4 s; in 20 s it bounded the
#: full one only to 2.227 ms)
LEAN_NODES = 300

#: solves of the relaxation `relax_and_round` makes at most (each adds the memory constraints
#: the last rounded schedule broke, or tightens it where it broke the budget)
ROUNDS = 8

#: the first solve has the whole time limit, but stops at this share of it when its last
#: solution rounds to a schedule that breaks the budget: the rest is for `repair` and for
#: solves with the constraints that schedule broke. One whose schedules fit goes on, to prove
#: its bound: on the 600-node 12-layer HF GPT-2 at 90% of its peak, `relax` at 10 s (with
#: ``quick_restart`` for ``lb_tree_search`` in `SUBSOLVERS`) proved 2.354 ms optimal in 7 of 11
#: runs (5.3 to 10.1 s), in 3 of 11 when the first solve stopped at this share regardless
FIRST_SHARE = 0.75

#: the first solve stops sooner, at this share of the limit, when its last solution rounds
#: to a schedule over the budget by more than `repair.STRIP_OVER` and one of its solutions
#: rounds to a schedule that, without its save sets, is over by `repair.STRIP_REACH` at
#: most: `repair` makes that fit from there, but needs seconds on large graphs. On the
#: 2,000-node synthetic DAG at 50% of its peak, the solutions CP-SAT finds in the first 10 s
#: round to schedules at twice the budget, those after 10 to 15 s to 382 ms at 1.12 times
#: it, which `repair` took to 509 ms in 5 to 7 s
STRIP_SHARE = 0.6

#: without a time limit, each solve stops after this long (its bound is valid either way)
SOLVE_S = 60.0

#: a copy made by a replay serves only savers in the replayed node's region: for savers (and
#: readers) at most this many nodes after the producer, the nodes between must share that
#: region
LINK_SPAN = 64

#: CP-SAT's probing in presolve (``cp_model_probing_level``): off. On the 2,000-node synthetic
#: DAG at 90% of its peak its three rounds took 3.5 s of presolve; without them CP-SAT had the
#: same bound (33.01 ms) at 4.7 s instead of 6.6 s, and recorded graphs solved as fast or faster
PROBING = 0

#: a lean relaxation's memory constraints go in as sums that build on each other
#: (`Relaxation._flush`); False, or not lean: each on its own. On 2 cores, CP-SAT proved the
#: 2,000-node synthetic DAG's relaxation at 90% of its peak in 6.3 to 9.4 s (six runs; each on
#: its own, 8.1 to 11.6 s in four), the 600-node 12-layer HF GPT-2's at 70% in 3.8 and 3.9 s
#: (6.1 and 4.8 s). On the recorded graphs of up to 140 nodes (not lean) it proved the first
#: solve as fast, but the solves after it, with the (full) constraints a rounded schedule broke,
#: went slower: within 10 s, `relax` on the GPT graph at 50% answered 11.90 ms in five of six
#: runs with each on its own, chained 11.99 to 12.01 ms in three of seven (nothing in the rest)
CHAINED = True

#: a lean relaxation's solve stops once its best solution is within this share of its bound
#: and rounds to a schedule that breaks the budget: the time left goes to `repair` it. On the
#: 2,000-node DAG at 70% of its peak, within 10 s, two runs that stopped so (at any rounding)
#: fitted (168.0 and 168.3 ms), one of two without it did (168.2 ms; the other answered a
#: baseline's 776 ms). One whose schedule fits goes on, to prove it optimal
LEAN_GAP = 0.005


#: after its first solve, a lean relaxation takes in only this many of the memory constraints
#: its rounded schedule broke that it left out (the most broken first, no replay-burst ones);
#: later solves, and full relaxations, up to `MAX_STEPS`. Each holds everything (cached
#: outputs too), and the next solve is slower for each: on the 2,000-node synthetic DAG at
#: 90% of its peak, within 10 s, one (backward step 4) raised the bound from 33.02 to 33.55 ms
#: in 11 runs of 12 (that relaxation's optimum, 33.65 ms, took CP-SAT 12 to 28 s from
#: scratch; counting forward's copies between their savers, `Relaxation._forward_copy`, it
#: rose to 33.71 ms in 2 runs of 4), three or ten left it at 33.02. One in every solve left
#: 320-node DAGs short of solves (at 90%, 8.76 ms against 6.32 with ten; this way 5.78)
LEAN_ADD = 1


def far_reads(graph: CostGraph) -> float:
    """The share of the reads of compute nodes' outputs, by compute nodes, that come more than
    `LINK_SPAN` nodes after the producer (0.0 when there are no reads). Each ties the regions
    of all the nodes between in the relaxation, which CP-SAT then solves slowly: on the
    2,000-node synthetic DAG (a fifth of its reads), it took 5 to 12 s to prove it at 90% of
    the peak, and its first solves rounded to schedules that broke the budget."""
    at = {x: i for i, x in enumerate(graph.compute_nodes)}
    reads = far = 0
    for sid, readers in storage_readers(graph).items():
        p = at.get(graph.storages[sid].producer)
        if p is None:
            continue
        for u in readers:
            if u in at:
                reads += 1
                far += at[u] - p > LINK_SPAN
    return far / reads if reads else 0.0


def full_space_bound(graph: CostGraph, budget_bytes: int, *, time_limit_s: float = BOUND_S
                     ) -> float:
    """A proven lower bound, in seconds, on the recompute time of every schedule of the full
    space whose simulated peak fits ``budget_bytes``; ``math.inf`` when it proves that none
    fits; 0.0 when CP-SAT finds no bound in ``time_limit_s``. Remembered per graph and
    budget (a better bound found later, by `relax`, replaces it); one solved with less time
    than ``time_limit_s`` is solved again, and the better kept."""
    static = Static.of(graph)
    memo, spent = static.full_bounds, static.full_bound_s
    if budget_bytes not in memo or (
            memo[budget_bytes] < math.inf and spent.get(budget_bytes, math.inf) < time_limit_s):
        memo[budget_bytes] = max(memo.get(budget_bytes, 0.0),
                                 _solve(graph, budget_bytes, time_limit_s))
        spent[budget_bytes] = time_limit_s
    return memo[budget_bytes]


def remembered_bound(graph: CostGraph, budget_bytes: int) -> float | None:
    """The best bound remembered for ``graph`` and ``budget_bytes``, or None."""
    return Static.of(graph).full_bounds.get(budget_bytes)


def remember_bound(graph: CostGraph, budget_bytes: int, bound: float) -> float:
    """Keep ``bound`` for `full_space_bound` when it beats the one remembered; returns the
    best."""
    static = Static.of(graph)
    memo = static.full_bounds
    if bound <= memo.get(budget_bytes, 0.0):
        return memo.get(budget_bytes, 0.0)  # (no bound at all is not remembered)
    static.full_bound_s.pop(budget_bytes, None)  # (`full_space_bound` solves it no more)
    memo[budget_bytes] = bound
    return bound


def _solve(graph: CostGraph, budget: int, time_limit_s: float) -> float:
    return relax_and_round(graph, budget, time_limit_s, rounds=1).bound


@dataclass(frozen=True)
class Relaxed:
    """What `relax_and_round` found: a proven ``bound`` (seconds; ``math.inf``: nothing
    fits), whether it is the relaxation's ``proven`` optimum (all memory constraints the
    rounded schedules broke included), and the best ``schedule`` that fits among those read
    off its solutions (None if none did), with its simulated recompute time."""

    bound: float
    proven: bool
    schedule: Schedule | None
    recompute_s: float = math.inf


def relax_and_round(graph: CostGraph, budget_bytes: int, time_limit_s: float | None,
                    *, rounds: int = ROUNDS) -> Relaxed:
    """Solve the relaxation at the budget, lazily: each solution is rounded to a schedule and
    simulated; the memory constraints it breaks that the model left out go in, and it is
    solved again (hinted with the last solution), up to ``rounds`` solves or ``time_limit_s``
    (None: each solve may take `SOLVE_S`; the first one stops at `FIRST_SHARE` of the limit
    when its last schedule breaks the budget, at `STRIP_SHARE` when that is far over and
    one it found is within `repair`'s reach without its save sets). A last schedule over the
    budget goes to `repair` (or, when far over, that one). Each solve's bound is valid, so
    the best is kept. When a rounded schedule breaks no constraint the model lacks (what the
    relaxation leaves out), the model is tightened by its overshoot where it broke the budget
    (`Relaxation.tighten`): the next solves give schedules, not bounds."""
    from .base import reaches
    from .repair import STRIP_OVER, STRIP_REACH, repair, stripped

    started = time.perf_counter()
    best: tuple[float, Schedule] | None = None
    bound, proven = 0.0, False
    try:
        rel = Relaxation(graph, budget_bytes, deadline=None if time_limit_s is None
                         else started + time_limit_s)
    except TimeoutError:
        return Relaxed(0.0, False, None)  # (no bound, no schedule)
    build_s = time.perf_counter() - started
    bounds = True  # (whether the model still bounds the budget: `Relaxation.tighten`)
    added = False  # (whether constraints a rounded schedule broke went in: `LEAN_ADD`)

    # each solve leaves half the model's build time (which grows with the graph, as
    # simulating its schedules does) for what comes after it within the limit; another starts
    # only with as much again for itself
    margin = build_s / 2

    def no_time() -> bool:
        return time_limit_s is not None and (
            time.perf_counter() - started + max(0.1, 2 * margin) > time_limit_s)

    def time_left() -> float:  # (for a solve or `repair`: the limit's rest but the margin)
        return SOLVE_S if time_limit_s is None else \
            time_limit_s - (time.perf_counter() - started) - margin

    for round_ in range(rounds):
        if no_time():
            break
        limit = time_left()
        found: list[Schedule] = []
        simulated: dict[int, Estimate] = {}  # (by position in found: each simulated once)

        def estimate(i: int) -> Estimate:
            if i not in simulated:
                simulated[i] = simulate(graph, found[i])
            return simulated[i]

        def stop(objective: float, lower: float) -> bool:  # (see `LEAN_GAP`)
            return rel.lean and objective - lower <= LEAN_GAP * objective and \
                estimate(len(found) - 1).peak_bytes > budget_bytes

        def overshoots() -> bool:  # (see `FIRST_SHARE`)
            return bool(found) and estimate(len(found) - 1).peak_bytes > budget_bytes

        stripped_peaks: dict[int, int] = {}  # (by position in found)

        def to_repair() -> int:
            """The solution to repair: the last one, but when its schedule breaks the budget
            by more than `repair.STRIP_OVER`, the last whose schedule without save sets
            breaks it by `repair.STRIP_REACH` at most, if any (-1: the last one)."""
            if estimate(len(found) - 1).peak_bytes <= (1 + STRIP_OVER) * budget_bytes:
                return -1
            for i in range(len(found) - 1, -1, -1):
                if i not in stripped_peaks:
                    stripped_peaks[i] = simulate(graph, stripped(found[i]),
                                                 timeline=False).peak_bytes
                if stripped_peaks[i] <= (1 + STRIP_REACH) * budget_bytes:
                    return i
            return -1

        def strippable() -> bool:  # (see `STRIP_SHARE`)
            return bool(found) and to_repair() >= 0

        first = time_limit_s is not None and not round_ and rounds > 1
        lb, optimum = rel.solve(limit, on_solution=lambda value: found.append(
            rel.schedule(value)), stop=stop,
            checks=[(STRIP_SHARE * limit, strippable), (FIRST_SHARE * limit, overshoots)]
            if first else ())
        if bounds:
            if lb == math.inf:
                return Relaxed(math.inf, True, None)
            bound, proven = max(bound, lb), optimum
        last = None
        for i, sched in enumerate(found):
            last = est = estimate(i)
            if est.peak_bytes <= budget_bytes and (best is None or est.recompute_s < best[0]):
                best = (est.recompute_s, sched)
        if last is None or (best is not None and reaches(best[0], bound)):
            break
        if last.peak_bytes <= budget_bytes:
            break  # it fits: another solve would start over (with less time), or is done
        if best is None or best[0] > last.recompute_s:  # repaired, it may do better
            left = time_left()
            fixed = repair(graph, found[to_repair()], budget_bytes, left) if left > 0 else None
            if fixed is not None:
                est = simulate(graph, fixed)
                if best is None or est.recompute_s < best[0]:
                    best = (est.recompute_s, fixed)
                    if reaches(best[0], bound):
                        break
        if no_time():
            break
        over = rel.overshoots(last)
        broken = [x for _, x in over if x in rel.pending][:MAX_STEPS]
        if rel.lean and not added:  # (see `LEAN_ADD`)
            broken = [x for x in broken if x[0] != "burst"][:LEAN_ADD]
        if bounds and rel.add(broken):
            added = True
            continue  # (the worst few: each costs a pass over the storages to build)
        # what breaks the budget is what the relaxation leaves out: cut it off at those steps
        bounds = False
        if not rel.tighten(over[:MAX_STEPS]):
            break
    if best is None:
        return Relaxed(bound, proven, None)
    return Relaxed(bound, proven, best[1], best[0])


#: the objective's unit, in seconds: a picosecond, so that its rounding (at most 2 units a
#: term, a few hundred terms at once) stays within a millionth of a millisecond's recompute
UNIT_S = 1e-12


def _units(seconds: float) -> int:
    """Whole `UNIT_S`, rounded down (one less for the float product's rounding)."""
    return max(0, math.floor(seconds / UNIT_S) - 1)


class Relaxation:
    """The CP-SAT relaxation of the full space for one graph and budget (see the module
    docstring): `solve` bounds it, `schedule` rounds a solution to a schedule."""

    def __init__(self, graph: CostGraph, budget_bytes: int, *, lean: bool | None = None,
                 deadline: float | None = None):
        """``deadline`` (a `time.perf_counter` value): building past it raises `TimeoutError`
        (on the 2,000-node synthetic DAG the build takes 0.5 to 0.8 s, in parts of up to 0.2 s,
        between which it checks). ``lean``: leave out of the memory constraints made up
        front the cached outputs awaiting their replay and forward's copies between their
        savers (`_forward_copy`), and make no replay-burst constraint up front (they stay
        pending): a weaker relaxation that CP-SAT bounds much sooner on large graphs. (With
        those copies up front, `relax` on the 2,000-node synthetic DAG at 90% of its peak came
        within 1% of its bound at 10 s in 5 runs of 5, but at 50% its solutions within 30 s
        rounded to schedules that `repair` could not make fit, where without them it did in
        most runs.) The constraints `add` puts in later hold everything (only the
        steps a rounded schedule broke, so the model stays small). None: lean beyond
        `LEAN_NODES` compute nodes."""
        from ortools.sat.python import cp_model

        self.g, self.budget, self.deadline = graph, budget_bytes, deadline
        self.lean = len(graph.compute_nodes) > LEAN_NODES if lean is None else lean
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
        self._ors: dict[tuple[int, ...], Any] = {}  # `_or`'s literals, by their operands
        self._hint: list[int] = []  # the last solve's solution, by variable index
        # `_cached_alive`'s: savers by step, linked runs, its literals
        self._early: dict[int, list[int]] = {}
        self._runs: dict[tuple[int, int], Any] = {}  # `_run`'s literals
        self._spans: dict[tuple[int, int], Any] = {}  # `_span`'s literals
        self._alive: dict[tuple[str, tuple[int, ...]], Any] = {}
        self._copies: dict[tuple[int, int], Any] = {}  # `_forward_copy`'s literals
        # `_fits`'s constraints not in the model yet (room, terms by literal index), and those
        # in it: (terms, their sum's variable, its largest value)
        self._batch: list[tuple[int, dict[int, list[Any]]]] = []
        self._sums: list[tuple[frozenset[tuple[int, int]], Any, int]] = []
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

    def violated(self, estimate: Estimate) -> list[tuple[str, int]]:
        """Labels of the memory constraints (pending or not) at the forward nodes and
        backward steps where ``estimate`` (a simulation with its timeline) goes over the
        budget (before each, what was alive plus its own highest running total), most over
        first."""
        return [label for _, label in self.overshoots(estimate)]

    def overshoots(self, estimate: Estimate) -> list[tuple[int, tuple[str, int]]]:
        """`violated`'s labels, each with the bytes by which ``estimate`` goes over there."""
        g, budget = self.g, self.budget
        over: list[tuple[int, tuple[str, int]]] = []  # (by how much, label)
        prev, fwd, k = g.base_bytes, 0, 0
        steps = gradient_steps(g)
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
                high = max(prev + self.static.fwd_peak[fwd], cur)
                if high > budget:
                    over.append((high - budget, ("fwd", fwd)))
                fwd += 1
            prev = cur
        over.sort(key=lambda t: -t[0])  # (stable: in step order among equals)
        return over

    # -- variables ---------------------------------------------------------------------------
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
        on each other (`CHAINED`): smallest first, each is the largest one put in before whose
        terms are all among its own, plus the rest. Consecutive forward nodes and backward
        steps hold nearly the same storages, so this about halves the terms the model carries
        (on the 2,000-node synthetic DAG, 20,000 instead of 41,000) and CP-SAT solves it
        sooner."""
        batch, self._batch = self._batch, []
        chained = CHAINED and self.lean
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

    def _forward(self) -> None:
        """Forward: before each node's events (see the module docstring). Along forward only
        the kept part grows, so a node gets a constraint only when its constant part is above
        every later node's (at most `MAX_STEPS`)."""
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
        self.add([("fwd", i) for i in _spread(needed, key=lambda i: sum(tops[i][:2]))])

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
        savers, for replay bursts (at most `MAX_STEPS` each)."""
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
        self.add([("bwd", k) for k, _ in _spread(higher, key=lambda t: t[1])])
        if not self.lean:
            self.add([("burst", k) for k, _ in _spread([(k, consts[k]) for k in bursts],
                                                       key=lambda t: t[1])])

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
                 if self.first_need[sid] > k and abs(at[p] - z) <= LINK_SPAN]
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
        solver.parameters.num_workers = len(SUBSOLVERS)
        solver.parameters.subsolvers.extend(SUBSOLVERS)
        solver.parameters.max_time_in_seconds = max(0.05, time_limit_s)
        solver.parameters.cp_model_probing_level = PROBING
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
        return Schedule.from_regions(self.g, spans,
                                     meta={"space": "the full schedule space (relax)"})


def _spread(items: list[Any], *, key: Callable[[Any], int]) -> list[Any]:
    """At most `MAX_STEPS` of ``items``, evenly spread, the highest by ``key`` among them."""
    if len(items) <= MAX_STEPS:
        return items
    top = max(range(len(items)), key=lambda i: key(items[i]))
    picked = {int(i * len(items) / MAX_STEPS) for i in range(MAX_STEPS - 1)}
    return [items[i] for i in sorted(picked | {top})]


def _idle_stop(graph: CostGraph, node: str) -> bool:
    """Whether ``node``, as its region's last saver, would neither replay (none of its events
    come before its `CostGraph.replay_mark`) nor be cached: linked, yet neither."""
    return bool(graph.node(node).saved) and \
        not graph.fwd_events.get(node, ())[:graph.replay_mark(node)]
