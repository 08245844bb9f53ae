"""The solvers' tunables, in one typed config.

`auto`, `relax`, `repair`, `dp`, the full-space bound and `certify` take
``config: SolverConfig | None`` (None: these defaults) and pass it down. The defaults are
what the recorded graphs in ``graphs/`` and the examples were tuned on; each says in one line
why it is what it is. Changing one changes what the solvers search or how they share their
time, never whether a result is correct: bounds stay bounds and schedules are simulated.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SolverConfig"]


@dataclass(frozen=True)
class SolverConfig:
    """Tunables of the solvers (seconds in ``_s`` fields, shares of a time limit in
    ``_share`` fields)."""

    # -- the full-space bound and certify ---------------------------------------------------
    #: CP-SAT seconds `certify` gives the full-space bound (stopped early, the best bound
    #: found by then still holds): short, so that certifying costs about a second a budget
    bound_s: float = 0.8
    #: `certify` starts no bound solve with less time than this left (CP-SAT needs about
    #: that to build and presolve the relaxation of a small graph)
    min_bound_s: float = 0.05

    # -- the relaxation (`relaxation.Relaxation`) -------------------------------------------
    #: memory constraints of each kind (forward nodes, backward steps, replay bursts) the
    #: relaxation starts with; the others go in when a rounded schedule breaks them (each
    #: holds a term per storage, so many up front make every solve slower)
    max_steps: int = 10
    #: CP-SAT's workers: ``max_lp`` (LP cuts and reduced-cost fixing) raises the bound,
    #: ``lb_tree_search`` (explores the least-bound node first) raises it where the cuts stall
    subsolvers: tuple[str, ...] = ("max_lp", "lb_tree_search")
    #: graphs with more compute nodes than this get a lean relaxation (fewer terms up front),
    #: which CP-SAT proves in seconds where it bounds the full one only loosely
    lean_nodes: int = 300
    #: a replay's copy serves only savers in the replayed node's region: for savers and
    #: readers at most this many nodes after the producer, the nodes between are tied to it
    link_span: int = 64

    # -- relax's search loop (`relax.relax_and_round`) --------------------------------------
    #: solves of the relaxation at most (each adds what the last rounded schedule broke, or
    #: tightens it where it broke the budget)
    rounds: int = 8
    #: the first solve stops at this share of the limit when its last schedule breaks the
    #: budget, leaving the rest to `repair` and to the solves with what it broke
    first_share: float = 0.75
    #: ... and at this share when that schedule is far over the budget but one found is within
    #: `strip_reach` without its save sets (`repair` needs seconds from there on large graphs)
    strip_share: float = 0.6
    #: without a time limit, each solve stops after this long (its bound holds either way)
    solve_s: float = 60.0
    #: a lean relaxation's solve stops once its best solution is within this share of its
    #: bound and rounds to a schedule over the budget: the time left goes to `repair`
    lean_gap: float = 0.005
    #: after its first solve, a lean relaxation takes in this many of the left-out constraints
    #: its rounded schedule broke (the most broken first); each makes the next solve slower
    lean_add: int = 1

    # -- repair (`repair.repair`) -----------------------------------------------------------
    #: after its first step, a repair step simulates this many of the best changes of the
    #: step before, besides the new ones (tens of simulations a step, not hundreds)
    repair_top: int = 24
    #: the first repair step tries this many times `repair_top` changes, in a prior's order
    repair_first: int = 4
    #: a schedule over the budget by more than this share is repaired without its save sets,
    #: which then go back a node at a time (over at many steps at once, no single change helps)
    strip_over: float = 0.02
    #: `relax` repairs the last solution whose schedule without save sets is over by at most
    #: this share, when the last one is over by more than `strip_over`
    strip_reach: float = 0.03

    # -- auto ------------------------------------------------------------------------------
    #: the share of the time limit `auto` gives `relax` first (it returns early when relax
    #: proves its schedule optimal, which on the recorded graphs takes most of that share)
    relax_share: float = 0.75
    #: the share of the time limit `auto` gives `cpsat_fine` last (none without a limit: it
    #: rarely proves optimality, so it would not stop)
    fine_share: float = 0.2
    #: with a time limit, `auto` starts `cpsat` and `cpsat_fine` only with this much left
    #: (`cpsat` with less when nothing fits yet: for this long), so that it keeps to the limit
    min_solve_s: float = 0.5

    # -- dp --------------------------------------------------------------------------------
    #: how many of a recompute region's slowest nodes `dp` may cache (none, its slowest, ...):
    #: each one more multiplies the region table; 2 lowers the MLP's optimum by a fifth
    save_top: int = 2

    # cpsat: fields added by cpsat.py's owner
