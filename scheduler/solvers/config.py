"""The solvers' tunables in one typed, frozen config: pass ``SolverConfig(...)`` to change one."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SolverConfig"]


@dataclass(frozen=True)
class SolverConfig:
    """Tunables of the solvers, one block per solver; the defaults are the ones they use."""

    # cpsat
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
    #: certify the answer (at most `cpsat_bound_reserve_s`)
    cpsat_bound_share: float = 0.1
    #: the most time the search leaves for certifying, in s (the full-space bound's own limit)
    cpsat_bound_reserve_s: float = 0.8
    #: `cpsat_fine` without a schedule to start from runs `cpsat` first for this share of its
    #: limit: its finer space is searched more slowly, and a good start is most of the answer
    cpsat_fine_warm_share: float = 0.25
    #: cheap baselines (one simulation each) that warm-start cpsat and stand in when it runs
    #: out of time
    cpsat_warm_starts: tuple[str, ...] = ("every_block", "sqrt", "uniform:2", "uniform:4")
