"""The baselines people use today, as solvers with the shared signature.

``none``          no checkpointing.
``every_block``   one recompute region per repeated block (``transformer.h.3``), as by hand.
``uniform:K``     ``torch.utils.checkpoint.checkpoint_sequential(functions, segments=K)``.
``sqrt``          Chen et al. 2016: ``uniform:K`` with K = round(sqrt(n)).
``greedy``        Chen et al.'s memory-threshold greedy, over a sweep of thresholds.
``knapsack``      the save/recompute 0-1 knapsack of ``torch.compile``'s activation memory
                  budget, solved by PyTorch's own ``dp_knapsack``.

Each is a plain function ``(graph, budget_bytes, *, time_limit_s=None) -> SolveResult``. None of
them optimizes against `simulate`'s peak except ``greedy``, which simulates each candidate; all
report the simulated estimate of what they return and are ``FEASIBLE`` exactly when its peak
fits the budget, else ``INFEASIBLE`` (with the schedule, so a caller sees by how much it
misses). They run in well under a second on graphs of thousands of nodes, so ``time_limit_s``
is accepted and ignored.

Where the rewriter would refuse one of their recompute regions (a replay that would read a
value written in place after forward read it, `ir.replays`), its cut moves to the nearest
allowed place (`replays.legalize`, via `base.finish`; ``schedule.meta["moved_cuts"]`` says
what moved), so ``uniform:K`` and the rest plan around such writes instead of failing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from itertools import groupby

from ..cost.simulate import simulate
from ..ir.graph import CostGraph
from ..ir.replays import legalize
from ..ir.schedule import KEEP, RECOMPUTE, Schedule
from .base import SolveResult, UnknownSolverError, finish, register

__all__ = ["BASELINES", "no_checkpointing", "every_block", "sqrt_segments", "uniform", "greedy",
           "knapsack", "saved_output_bytes"]

#: the baselines `auto` also tries, by name (``none`` aside: it never helps a budget)
BASELINES = ("every_block", "sqrt", "uniform:2", "uniform:4", "greedy", "knapsack")


# -------------------------------------------------------------------------- the baselines


@register("none")
def no_checkpointing(graph: CostGraph, budget_bytes: int, *,
                     time_limit_s: float | None = None) -> SolveResult:
    """Keep everything: the unscheduled step. O(simulate)."""
    started = time.perf_counter()
    return finish(graph, budget_bytes, Schedule.none(graph), solver="none", started=started)


@register("every_block")
def every_block(graph: CostGraph, budget_bytes: int, *,
                time_limit_s: float | None = None) -> SolveResult:
    """One recompute region per maximal run of compute nodes with the same non-empty
    ``Node.block``; nodes outside blocks (stem, head) keep.

    A graph without blocks gets the ``none`` schedule (there is nothing a user would wrap),
    FEASIBLE or INFEASIBLE by its simulated peak like any other. O(n + simulate).
    """
    started = time.perf_counter()
    blocks = [graph.node(name).block for name in graph.compute_nodes]
    schedule = _from_runs(graph, blocks, lambda block: RECOMPUTE if block else KEEP)
    return finish(graph, budget_bytes, schedule, solver="every_block", started=started)


@register("uniform", parametric=True)
def uniform(arg: str) -> Callable[..., SolveResult]:
    """``uniform:K``: the solver that cuts the model like
    ``checkpoint_sequential(functions, segments=K)``.

    The "functions" are the graph's blocks (maximal runs of one non-empty ``Node.block``) when
    it has any, else its compute nodes. As in PyTorch, the first K-1 segments hold ``n // K``
    functions each and are recomputed, and the last segment holds the rest and is kept; nodes
    before the first block join the first segment, nodes after the last block the last. K
    larger than n is lowered to n (PyTorch would fail on a zero segment size).

    Raises:
        UnknownSolverError: ``K`` is not an integer >= 1.
    """
    try:
        k = int(arg)
    except ValueError:
        k = 0
    if k < 1 or str(k) != arg.strip():
        raise UnknownSolverError(
            f"bad solver 'uniform:{arg}': K must be an integer >= 1, e.g. 'uniform:4'")
    name = f"uniform:{k}"

    def solve(graph: CostGraph, budget_bytes: int, *,
              time_limit_s: float | None = None) -> SolveResult:
        started = time.perf_counter()
        return finish(graph, budget_bytes, _sequential(graph, k), solver=name, started=started)

    solve.__name__ = solve.__qualname__ = f"uniform_{k}"
    return solve


@register("sqrt")
def sqrt_segments(graph: CostGraph, budget_bytes: int, *,
                  time_limit_s: float | None = None) -> SolveResult:
    """Chen et al. 2016: ``uniform:K`` with K = round(sqrt(n)), n the number of blocks (or of
    compute nodes when the graph has no blocks). O(n + simulate)."""
    started = time.perf_counter()
    k = max(1, round(math.sqrt(len(_functions(graph)))))
    return finish(graph, budget_bytes, _sequential(graph, k), solver="sqrt", started=started)


@register("greedy")
def greedy(graph: CostGraph, budget_bytes: int, *,
           time_limit_s: float | None = None) -> SolveResult:
    """Chen et al. 2016's memory-threshold greedy, tried over a sweep of thresholds.

    For a threshold ``b``: walk the compute nodes in order adding up `saved_output_bytes`;
    when the sum exceeds ``b``, end a segment after that node (its output becomes the next
    segment's kept input) and start again from zero. Every segment is recomputed, as in Chen;
    a variant with the last segment kept (backward replays it at once, so recomputing it often
    buys little) is tried too. Thresholds: 30 geometric steps from the smallest non-zero node
    to the total, plus Chen's ``sqrt(total * largest)``. Returns the candidate with the least
    simulated recompute time that fits the budget, else the one with the lowest simulated peak
    (INFEASIBLE). O(n * 60 + 60 simulations).
    """
    started = time.perf_counter()
    mem = saved_output_bytes(graph)
    positive = [m for m in mem if m > 0]
    total = sum(positive)
    thresholds = {float(total)}
    if positive:
        lo = float(min(positive))
        thresholds.update(lo * (total / lo) ** (i / 29) for i in range(30))
        thresholds.add(math.sqrt(total * max(positive)))
    candidates: dict[tuple, Schedule] = {}
    for b in sorted(thresholds):
        cuts, acc = [], 0
        for i, m in enumerate(mem[:-1]):
            acc += m
            if acc > b:
                cuts.append(i + 1)
                acc = 0
        for last in (RECOMPUTE, KEEP):
            policies = [RECOMPUTE] * len(cuts) + [last]
            key = (tuple(cuts), last)
            if key not in candidates:
                # (compared as the schedules `finish` would return: refused cuts moved)
                candidates[key] = legalize(graph, Schedule.from_cuts(graph, cuts, policies))[0]
    # (without the timeline, a simulation takes half the time; `finish` simulates the one
    # chosen in full)
    estimates = [(simulate(graph, s, timeline=False), s) for s in candidates.values()]
    fitting = [(e, s) for e, s in estimates if e.peak_bytes <= budget_bytes]
    if fitting:
        best = min(fitting, key=lambda es: (es[0].recompute_s, es[0].peak_bytes))[1]
    else:
        best = min(estimates, key=lambda es: (es[0].peak_bytes, es[0].recompute_s))[1]
    return finish(graph, budget_bytes, best, solver="greedy", started=started)


@register("knapsack")
def knapsack(graph: CostGraph, budget_bytes: int, *,
             time_limit_s: float | None = None) -> SolveResult:
    """The save/recompute knapsack that ``torch.compile``'s ``activation_memory_budget`` solves.

    Items are the compute nodes with `saved_output_bytes` > 0: memory = those bytes, runtime =
    the node's forward time. The knapsack keeps the most runtime within the activation bytes the
    budget leaves, ``budget - (unscheduled peak - sum of item memory)``, counted as a plain sum
    with no liveness: that is the model torch.compile uses, and what this baseline is for.
    Memories are normalized by their total, as torch.compile does, so PyTorch's ``dp_knapsack``
    (which scales to integers by 10^4) runs in O(items * 10^4) time and float32 memory.

    Recomputed items become recompute regions, merged over runs of consecutive recomputed items
    (nodes that are not items, such as views, join a run when the items on both sides are
    recomputed); everything else keeps. Its real peak is whatever `simulate` says.

    Raises:
        ImportError: PyTorch is not installed.
    """
    started = time.perf_counter()
    try:
        from torch._functorch._activation_checkpointing.knapsack import dp_knapsack
    except ImportError as e:
        raise ImportError("the 'knapsack' baseline runs PyTorch's own knapsack solver: "
                          "pip install torch (or choose another solver)") from e
    mem = saved_output_bytes(graph)
    items = [i for i, m in enumerate(mem) if m > 0]
    total = sum(mem[i] for i in items)
    recomputed: set[int] = set()
    if total:
        unscheduled_peak = simulate(graph, Schedule.none(graph)).peak_bytes
        allowed = max(0, budget_bytes - (unscheduled_peak - total))
        if allowed < total:
            names = graph.compute_nodes
            _, _, rec = dp_knapsack([mem[i] / total for i in items],
                                    [graph.node(names[i]).time_s for i in items],
                                    allowed / total)
            recomputed = {items[j] for j in rec}
    policies = _fill_between(len(mem), items, recomputed)
    return finish(graph, budget_bytes, _from_runs(graph, policies), solver="knapsack",
                  started=started)


# -------------------------------------------------------------------------- shared helpers


def saved_output_bytes(graph: CostGraph) -> list[int]:
    """Per compute node (in order), the bytes of the storages it allocated that some node saves
    for backward: what keeping the node costs in a no-liveness model. O(storages)."""
    pos = {name: i for i, name in enumerate(graph.compute_nodes)}
    out = [0] * len(pos)
    for st in graph.storages.values():
        if st.savers and st.producer in pos:
            out[pos[st.producer]] += st.bytes
    return out


def _functions(graph: CostGraph) -> list[int]:
    """Start positions (in ``compute_nodes``) of the units `checkpoint_sequential` would see:
    each maximal run of one non-empty block, or each compute node if there are no blocks."""
    blocks = [graph.node(name).block for name in graph.compute_nodes]
    starts = [i for i, b in enumerate(blocks) if b and (i == 0 or blocks[i - 1] != b)]
    return starts or list(range(len(blocks)))


def _sequential(graph: CostGraph, k: int) -> Schedule:
    """``checkpoint_sequential(segments=k)`` over `_functions`: k-1 recomputed segments of
    ``n // k`` functions, the rest kept."""
    starts = _functions(graph)
    k = min(k, len(starts))
    size = len(starts) // k if k else 0
    if k <= 1:
        return Schedule.none(graph, meta={"segments": 1})
    cuts = [starts[j * size] for j in range(1, k)]
    return Schedule.from_cuts(graph, cuts, [RECOMPUTE] * (k - 1) + [KEEP],
                              meta={"segments": k})


def _fill_between(n: int, items: Sequence[int], recomputed: set[int]) -> list[str]:
    """Policies for n nodes: recomputed items recompute; a non-item recomputes when the nearest
    items before and after it are both recomputed; everything else keeps."""
    policies = [KEEP] * n
    for a, b in zip(items, items[1:]):
        if a in recomputed and b in recomputed:
            policies[a:b + 1] = [RECOMPUTE] * (b - a + 1)
    for i in recomputed:
        policies[i] = RECOMPUTE
    return policies


def _from_runs(graph: CostGraph, keys: Sequence[str],
               policy: Callable[[str], str] = lambda p: p) -> Schedule:
    """One region per maximal run of equal ``keys`` (one per compute node), with policy
    ``policy(key)``."""
    spans, start = [], 0
    for key, run in groupby(keys):
        stop = start + len(list(run))
        spans.append((start, stop, policy(key)))
        start = stop
    return Schedule.from_regions(graph, spans)
