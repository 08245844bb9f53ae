"""The solvers' tunables, in one typed config.

`auto`, `relax`, `repair`, `dp`, the full-space bound and `certify` take
``config: SolverConfig | None`` (keyword-only; None: these defaults) and pass it down. The
defaults are what the recorded graphs in ``graphs/`` and the examples were tuned on; each says
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

    # -- the full-space bound (`bound.full_space_bound`, `certify.certify`) -----------------
    #: CP-SAT seconds for the bound `certify` solves: about a second a budget (stopped
    #: early, the best bound found by then still holds)
    bound_s: float = 0.8
    #: `certify` starts no bound solve with less time left: building the model takes that
    min_bound_s: float = 0.05

    # -- the relaxation (`relaxation.Relaxation`) -------------------------------------------
    #: memory constraints of each kind made up front (the rest when a rounded schedule breaks
    #: them): each holds a term per storage, and many make every solve slower
    max_steps: int = 10
    #: CP-SAT's workers: ``max_lp`` (LP cuts) raises the bound, ``lb_tree_search`` (least
    #: bound first) raises it where the cuts stall
    subsolvers: tuple[str, ...] = ("max_lp", "lb_tree_search")
    #: compute nodes beyond which the relaxation is lean: CP-SAT proves a lean one in seconds
    #: where it bounds the full one only loosely
    lean_nodes: int = 300
    #: readers and savers this many nodes after a producer at most tie the nodes between into
    #: its replay's region (a region's replay serves only its own savers)
    link_span: int = 64

    # -- relax's search loop (`relax.relax_and_round`) --------------------------------------
    #: solves at most, each with what the last rounded schedule broke
    rounds: int = 8
    #: the first solve stops at this share of the limit when its schedule breaks the budget,
    #: leaving the rest to `repair` and to the solves with what it broke
    first_share: float = 0.75
    #: ... at this share when that schedule is far over but one found is within `strip_reach`
    #: without save sets (`repair` needs seconds from there on large graphs)
    strip_share: float = 0.6
    #: seconds a solve may take without a time limit (its bound holds either way)
    solve_s: float = 60.0
    #: a lean solve stops within this share of its bound when its schedule breaks the budget:
    #: the time left goes to `repair`
    lean_gap: float = 0.005
    #: left-out constraints a lean relaxation takes in after its first solve (each makes the
    #: next solve slower; the most broken first)
    lean_add: int = 1

    # -- repair (`repair.repair`) -----------------------------------------------------------
    #: best changes of the step before that a repair step simulates again, besides the new
    #: ones: tens of simulations a step, not hundreds
    repair_top: int = 24
    #: the first repair step tries this many times `repair_top` changes, in a prior's order
    repair_first: int = 4
    #: over the budget by more than this share, a schedule is over at many steps at once:
    #: repaired without its save sets, which then go back a node at a time
    strip_over: float = 0.02
    #: over by more than `strip_over`, relax repairs the last solution whose schedule without
    #: save sets is over by at most this share
    strip_reach: float = 0.03

    # -- auto ------------------------------------------------------------------------------
    #: share of the limit for `relax`, first: it proves most recorded graphs within it
    relax_share: float = 0.75
    #: share of the limit for `cpsat_fine`, last (none without a limit: it seldom proves
    #: optimality, so it would not stop)
    fine_share: float = 0.2
    #: seconds left below which `auto` starts no `cpsat` or `cpsat_fine` (`cpsat` still runs,
    #: for this long, when nothing fits yet)
    min_solve_s: float = 0.5
    #: on a graph with units, `auto` answers with `chain`'s schedule at once where chain
    #: proves it OPTIMAL over its space and no cheap baseline does better: deterministic and
    #: in seconds, but chain's space misses schedules the rest finds (a tiny 4-layer Qwen3 at
    #: 50%, its table at 2 tracked anchors: 9.615 ms of recompute in 1 s, where `relax`
    #: finds 9.251 ms in 30 s, docs/benchmarks.md's ``chain_first``; 32 Llama-3-8B-shaped
    #: layers at 30 GiB: +11.58% against +10.81%); off (the default), chain's schedule is one
    #: candidate among the rest's
    chain_first: bool = False
    #: the most *tracked* anchors that may cross one of ``chain``'s unit cuts
    #: (`chaincuts.tracked_anchors`: residual streams nothing saves, as in a bf16 model whose
    #: norms cast the layer's input), 0 to 2, or None (the default): the most whose table
    #: takes at most ``chain_work`` node-simulations. 0 cuts only where every anchor is
    #: secured; 1 reaches inside bf16 layers (32 Llama-3-8B-shaped layers: 67 -> 803
    #: boundaries, 40 GiB +2.42% -> +1.39% recompute, `relax`'s full-space optimum) at many
    #: times the time (table 0.4 -> 9 s, search 0.3 -> 5 s there); see docs/solvers.md
    chain_tracked: int | None = None
    #: with ``chain_tracked=None``, the most node-simulations (the table's planned
    #: simulations of the whole step times its compute nodes) the richer tables may take:
    #: about 3 s on this project's 2-core CPU (a tiny 4-layer Qwen3 at 2 tracked anchors:
    #: 207,030; 32 Llama-3-8B-shaped layers at 1: 651,456, so they keep 0); a count, not a
    #: clock, so that the space is the same on every run and machine
    chain_work: int = 300_000

    # -- dp --------------------------------------------------------------------------------
    #: a recompute region's slowest nodes `dp` may cache: each one more multiplies its region
    #: table; 2 lowers the MLP's optimum by a fifth
    save_top: int = 2

    # -- cpsat and cpsat_fine (`cpsat`, `cpsat_model`, `cpsat_space`) ---------------------
    #: `unit_points` keeps at most this many units (the model has O(units^2) region literals)
    cpsat_max_units: int = 48
    #: `unit_points` adds cuts inside blocks only up to this many units: about 25 prove
    #: optimal within a second, twice as many may not within 10 s
    cpsat_extra_units: int = 24
    #: `fine_points` keeps at most this many units (its replay probes grow as units^2)
    cpsat_fine_units: int = 96
    #: share of the time left spent probing replays up front (probing every region of a large
    #: graph takes longer than CP-SAT's first answer); the rest are added as candidates use them
    cpsat_probe_share: float = 0.1
    #: a model with more constraints than this is first searched without CP-SAT's presolve,
    #: which alone takes seconds on models several times this size
    cpsat_large_model: int = 5000
    #: share of the time left that a large model's search without presolve gets (good answers,
    #: no bound); a bound model gets the rest
    cpsat_quick_share: float = 0.5
    #: memory constraints a bound model keeps, evenly spread: a few dozen give most of the
    #: full model's bound and presolve in a fraction of a second
    cpsat_bound_steps: int = 60
    #: CP-SAT's search workers: a small portfolio that also fits a two-core machine
    cpsat_workers: int = 2
    #: with a time limit, the search ends this share of it early, leaving the caller time to
    #: certify the answer (at most `bound_s`, the bound's own limit)
    cpsat_bound_share: float = 0.1
    #: `cpsat_fine` without a schedule to start from runs `cpsat` first for this share of its
    #: limit: its finer space is searched more slowly, and a good start is most of the answer
    cpsat_fine_warm_share: float = 0.25
    #: cheap baselines (one simulation each) that warm-start cpsat and stand in when it runs
    #: out of time
    cpsat_warm_starts: tuple[str, ...] = ("every_block", "sqrt", "uniform:2", "uniform:4")
