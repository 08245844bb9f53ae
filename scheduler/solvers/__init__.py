"""Solvers: exact (``auto``, ``relax``, ``dp``, ``cpsat``, ``cpsat_fine``) and the baselines
people use today (``none``, ``every_block``, ``sqrt``, ``uniform:K``, ``greedy``,
``knapsack``), all with one signature; see `base`."""

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

__all__ = ["FEASIBLE", "INFEASIBLE", "OPTIMAL", "SolveResult", "UnknownSolverError",
           "available", "get_solver", "register"]
