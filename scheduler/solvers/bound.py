"""A proven lower bound on recompute time over the *full* schedule space.

The full space is every schedule `Schedule` can express on one level: region boundaries after
any compute node, each region ``keep`` or ``recompute``, and any save set. The exact solvers
search smaller spaces (`dp`: chain cuts and a few save sets; `cpsat`: unit points and no save
sets), so their own optimality proofs say nothing about schedules outside them. This module
bounds every schedule of the full space at once, so that a result can be called OPTIMAL only
when it is proven so over the full space (`finish` asks it), and its gap is honest otherwise.

**Relaxation.** Booleans ``r[p]``: node p runs again in a replay; ``a[s]``: the storage s
that forward made is itself used by backward (it stays alive from forward until the first
backward step that uses it; for a storage nothing saves: it is alive when forward ends).
Every schedule of the full space maps to values that satisfy:

* a storage that a node saves for backward (a node whose backward runs) is kept, or its
  producer runs again in a region that holds its savers too (a saver outside every region,
  the loss, always keeps it): every node from the producer to the saver is *linked* to its
  predecessor (same recompute region, at or before its last saver), and a linked node
  replays or is cached by a save set (its outputs kept);
* a node that runs again reads each of its inputs kept or run again too (a region's inputs
  are held, its save-set outputs cached: both alive when forward ends);
* when forward ends, the kept storages fit the budget;
* at a backward step, its gradients (which no schedule changes), the storages some node
  whose backward spans that step saved (alive in every schedule), and the kept storages not
  needed yet fit the budget (for up to `MAX_STEPS` steps, those no earlier step implies).

The objective is what those replays cost at least (in whole nanoseconds, rounded down): each
replayed node's forward time and the checkpoint's cost per tensor it saves, each cached
node's save-set dispatch and per-tensor cost, and a checkpoint call for every replayed node
not linked to its predecessor (it starts a region), at least one when anything replays
(`_regions`). Replay bursts, held region inputs after forward, op temporaries and the other
nodes' save-set dispatch cost are left out, so the bound is below every fitting schedule's
simulated recompute time, and usually below the optimum: read a gap against it as "at most
this far from optimal", not as the distance.

It is checked against brute force over the full space on small graphs, and against random
schedules with save sets on the recorded graphs, and `finish` checks it against every
exact solver's result (`BoundWarning`). On the recorded graphs CP-SAT proves its optimum in
0.05 to 1 s; on a 2,000-node synthetic DAG it does not within `BOUND_S`, and the best bound
found by then stands.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from ..graph import CostGraph
from ..simulate import _Static, gradient_steps, storage_readers

__all__ = ["BOUND_S", "LINK_SPAN", "MAX_STEPS", "WORKERS", "BoundWarning", "full_space_bound"]


class BoundWarning(RuntimeWarning):
    """The bound came out above the recompute time of a schedule that fits: a bug in the
    relaxation for this graph. The result then carries no bound (and is not OPTIMAL)."""

#: CP-SAT time for one bound (it is proven in well under a second on the recorded graphs;
#: on larger ones the best bound found by then is still a valid bound)
BOUND_S = 2.0

#: at most this many backward steps get a memory constraint (evenly spread over those that
#: are not implied by earlier ones): each has a term per storage not needed yet, and on
#: thousands of nodes all of them make a model CP-SAT cannot bound in `BOUND_S`
MAX_STEPS = 40

#: CP-SAT workers: with 8, its portfolio proves the recorded graphs' bounds in under a second
#: (even on 2 cores); with 2 it leaves them at the trivial bound for seconds
WORKERS = 8


def full_space_bound(graph: CostGraph, budget_bytes: int, *, time_limit_s: float = BOUND_S
                     ) -> float:
    """A proven lower bound, in seconds, on the recompute time of every schedule of the full
    space whose simulated peak fits ``budget_bytes``; ``math.inf`` when it proves that none
    fits; 0.0 when CP-SAT finds no bound in ``time_limit_s``. Remembered per graph and
    budget."""
    memo = _Static.of(graph).full_bounds
    if budget_bytes not in memo:
        memo[budget_bytes] = _solve(graph, budget_bytes, time_limit_s)
    return memo[budget_bytes]


def _ns(seconds: float) -> int:
    """Whole nanoseconds, rounded down (one less for the float product's rounding)."""
    return max(0, math.floor(seconds * 1e9) - 1)


def _solve(graph: CostGraph, budget: int, time_limit_s: float) -> float:
    from ortools.sat.python import cp_model

    room = budget - graph.base_bytes
    if room < 0:
        return math.inf
    static = _Static.of(graph)
    first, done = static.first_step, static.done
    names = graph.compute_nodes
    compute = set(names)
    readers = storage_readers(graph)
    storages = graph.storages
    m = cp_model.CpModel()
    replayed = {p: m.NewBoolVar(f"r_{i}") for i, p in enumerate(names)}
    kept: dict[int, Any] = {}

    def keep(sid: int) -> Any:
        if sid not in kept:
            kept[sid] = m.NewBoolVar(f"a_{sid}")
        return kept[sid]

    # the backward steps at which each storage is needed: one window per saver whose backward
    # runs, from its first step to the step after which it lets go
    windows: dict[int, list[tuple[int, int]]] = {}
    regenerable: list[tuple[int, str, list[str]]] = []  # (storage, producer, savers)
    # whether a replay that stops at a storage's producer (its last saver) allocates it
    remade_at_stop = {sid: before_mark for sid, *_, before_mark in static.stor}
    for sid, st in storages.items():
        savers = [x for x in st.savers if x in first]
        if not savers or st.producer not in compute:
            continue
        windows[sid] = [(first[x], done[x]) for x in savers]
        p = st.producer
        if any(x not in compute for x in savers):
            m.Add(keep(sid) == 1)  # the loss saved it: never replayed
        elif set(savers) == {p} and not remade_at_stop[sid]:
            # a replay that stops inside p does not remake it (and then needs no copy)
            continue
        else:
            m.AddBoolOr([keep(sid), replayed[p]])
            regenerable.append((sid, p, savers))
    for sid, st in storages.items():
        if st.producer not in compute:
            continue
        for u in readers[sid]:
            if u in compute:
                m.AddBoolOr([replayed[u].Not(), keep(sid), replayed[st.producer]])

    calls = _regions(graph, m, replayed, keep, regenerable)  # (it keeps storages too)

    def fits(const: int, sids: list[int]) -> None:
        if const > room:
            m.AddBoolOr([])  # nothing fits
        elif sids:
            m.Add(sum(storages[s].bytes * kept[s] for s in sids) <= room - const)

    fits(0, list(kept))  # when forward ends
    # backward steps, each kept only when its constant part exceeds every earlier step's
    # (later steps need no more of the kept storages than earlier ones)
    first_need = {sid: min(f for f, _ in ws) for sid, ws in windows.items()}
    starts: dict[int, list[int]] = defaultdict(list)
    ends: dict[int, list[int]] = defaultdict(list)
    for sid, ws in windows.items():
        for f, d in ws:
            starts[f].append(sid)
            ends[d].append(sid)
    needed: dict[int, int] = defaultdict(int)  # storage -> windows open now
    needed_bytes, grads, best = 0, 0, 0
    candidates: list[tuple[int, int]] = []  # (step, constant part)
    for k, (_, top, net) in enumerate(gradient_steps(graph)):
        for sid in starts[k]:
            needed[sid] += 1
            if needed[sid] == 1:
                needed_bytes += storages[sid].bytes
        const = grads + (top or 0) + needed_bytes
        if const > best:
            best = const
            candidates.append((k, const))
        grads += net
        for sid in ends[k]:
            needed[sid] -= 1
            if needed[sid] == 0:
                needed_bytes -= storages[sid].bytes

    if len(candidates) > MAX_STEPS:  # evenly spread, the highest constant part among them
        top_at = max(range(len(candidates)), key=lambda i: candidates[i][1])
        picked = {int(i * len(candidates) / MAX_STEPS) for i in range(MAX_STEPS - 1)}
        candidates = [candidates[i] for i in sorted(picked | {top_at})]
    for k, const in candidates:
        fits(const, [s for s in kept if s in first_need and first_need[s] > k])

    per_saved = graph.checkpoint_saved_s
    terms = [(_ns(graph.node(p).time_s + per_saved * len(graph.node(p).saved)), v)
             for p, v in replayed.items()]
    terms += calls
    m.Minimize(sum(c * v for c, v in terms if c))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = WORKERS
    solver.parameters.max_time_in_seconds = max(0.05, time_limit_s)
    status = solver.Solve(m)
    if status == cp_model.INFEASIBLE:
        return math.inf
    if status == cp_model.MODEL_INVALID:
        raise AssertionError(f"the full-space bound's model is invalid: {m.Validate()}")
    # out of time (UNKNOWN included), the best bound so far still holds
    bound = solver.BestObjectiveBound()
    return max(0.0, bound) / 1e9 if math.isfinite(bound) else 0.0


#: a copy made by a replay serves only savers in the replayed node's region: for savers at most
#: this many nodes after the producer, the nodes between must share that region
LINK_SPAN = 64


def _regions(graph: CostGraph, m: Any, replayed: dict[str, Any], keep: Any,
             regenerable: list[tuple[int, str, list[str]]]) -> list[tuple[int, Any]]:
    """Regions, as far as the relaxation needs them; returns objective terms.

    ``link[i]``: nodes i-1 and i lie in one recompute region, both at or before its last
    saver, so each of them replays or is cached by the save set, or (node i only) is that
    last saver and stops the replay before running (`_idle_stop`) (``cached[x]``: its outputs
    are kept from forward; it pays the selective-checkpoint dispatch in forward and in the
    replay, and the checkpoint's cost per tensor it saves; a node that allocates nothing is
    in no save set). A replayed node without a link to its predecessor starts a region: one
    checkpoint call each (distinct starts, distinct regions), at least one when anything
    replays. A storage that is not kept is remade for its savers by a replay of its
    producer's region, so each saver lies in that region: every node from the producer to
    the saver is linked (for savers within `LINK_SPAN` nodes)."""
    names = graph.compute_nodes
    at = {x: i for i, x in enumerate(names)}
    outputs: dict[str, list[int]] = defaultdict(list)
    for sid, st in graph.storages.items():
        if st.output and not st.inner_free:
            outputs[st.producer].append(sid)
    per_saved = graph.checkpoint_saved_s
    terms: list[tuple[int, Any]] = []
    cached: dict[str, Any] = {}
    for x in names:
        if graph.allocates(x):
            c = cached[x] = m.NewBoolVar(f"cached_{at[x]}")
            for sid in outputs[x]:
                m.AddImplication(c, keep(sid))
            node = graph.node(x)
            cost = _ns(2 * (node.sac_s or 0.0) + per_saved * len(node.saved))
            if cost:
                terms.append((cost, c))
    link: list[Any] = [None]
    starts = [replayed[names[0]]] if names else []
    for i in range(1, len(names)):
        q, x = names[i - 1], names[i]
        li = m.NewBoolVar(f"link_{i}")
        link.append(li)
        for y in (q, x):  # (q comes before the last saver, so only x can be an idle one)
            if y == q or not _idle_stop(graph, y):
                m.AddBoolOr([li.Not(), replayed[y], *([cached[y]] if y in cached else [])])
        start = m.NewBoolVar(f"start_{i}")
        m.AddBoolOr([replayed[x].Not(), li, start])
        starts.append(start)
    for sid, p, savers in regenerable:
        for saver in savers:
            if 0 < at[saver] - at[p] <= LINK_SPAN:
                for i in range(at[p] + 1, at[saver] + 1):
                    m.AddBoolOr([keep(sid), link[i]])
    call = _ns(graph.checkpoint_call_s)
    if call and names:
        calls = m.NewIntVar(0, len(names), "calls")
        m.Add(calls >= sum(starts))
        for r in replayed.values():
            m.Add(calls >= 1).OnlyEnforceIf(r)
        terms.append((call, calls))
    return terms


def _idle_stop(graph: CostGraph, node: str) -> bool:
    """Whether ``node``, as its region's last saver, would neither replay (none of its events
    come before its `CostGraph.replay_mark`) nor be cached: linked, yet neither."""
    return bool(graph.node(node).saved) and \
        not graph.fwd_events.get(node, ())[:graph.replay_mark(node)]

