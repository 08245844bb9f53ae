"""Solvers: exact (``auto``, ``chain`` for graphs with units, ``relax``, ``dp``, ``cpsat``, ``cpsat_fine``) and the baselines
people use today (``none``, ``every_block``, ``sqrt``, ``uniform:K``, ``greedy``,
``knapsack``), all with one signature (see `base`); `certify.certify` judges a result against
the full-space lower bound; `SolverConfig` holds their tunables.

Importing this package imports every solver family below, which registers its solvers in
`base`'s registry (so `get_solver` finds them whichever module was imported first).
"""

from . import (  # noqa: F401  (they register solvers)
    auto, blockdp, brute, chain, cpsat, dp, floor, heuristics, relax)
from .base import (
    FEASIBLE,
    INFEASIBLE,
    OPTIMAL,
    SolveResult,
    UnknownSolverError,
    available,
    get_solver,
    register,
)
from .config import SolverConfig

__all__ = ["FEASIBLE", "INFEASIBLE", "OPTIMAL", "SolveResult", "SolverConfig",
           "UnknownSolverError", "available", "get_solver", "register"]
