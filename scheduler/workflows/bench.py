"""``bench``: solver speed and quality on recorded `CostGraph` files, no model run.

For each graph and budget, every solver runs on the graph; a row holds its status, predicted
recompute time and peak (all from `simulate`, via the solver's result), the least peak it
proved feasible when it found nothing, and its wall time. Exact solvers (``dp``, ``cpsat``,
``auto``) are also checked against the baselines: their recompute time must be at or below
every baseline's that fits (``ok``). Used by ``scheduler bench`` and ``benchmarks/solvers.py``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from .. import report
from ..budget import budget_spec, parse_budget
from ..cost.simulate import simulate
from ..ir.graph import CostGraph
from ..ir.schedule import Schedule
from ..solvers.auto import BASELINES as _AUTO_BASELINES
from ..solvers.base import INFEASIBLE, get_solver
from ..solvers.certify import solve_and_certify
from ..quantities import check_time_limit, format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from rich.table import Table

__all__ = ["BenchRow", "BUDGETS", "EXACT", "BASELINES", "bench", "bench_table", "verdict"]

#: the solvers whose answers are checked against the baselines
EXACT: tuple[str, ...] = ("dp", "cpsat", "relax", "auto")
#: the baselines, ``none`` first
BASELINES: tuple[str, ...] = ("none", *_AUTO_BASELINES)
#: default budgets: fractions of each graph's unscheduled predicted peak
BUDGETS: tuple[str, ...] = ("90%", "70%", "50%", "30%")


@dataclass(frozen=True)
class BenchRow:
    """One solver on one graph at one budget.

    Attributes:
        graph: the graph's name (its file's stem).
        nodes: its compute nodes.
        budget: the budget as given; budget_bytes: in bytes.
        solver: the solver name; status: its status.
        recompute_s, peak_bytes: the predicted cost of its schedule (None: no schedule).
        min_feasible_bytes: with INFEASIBLE, the least budget its space fits, where it knows.
        gap: its proven gap to the full schedule space's lower bound, where it has one.
        solve_s: wall seconds of the call.
        ok: for exact solvers, whether its recompute time is at or below every fitting
            baseline's (None for baselines).
    """

    graph: str
    nodes: int
    budget: str
    budget_bytes: int
    solver: str
    status: str
    recompute_s: float | None
    peak_bytes: int | None
    min_feasible_bytes: int | None
    gap: float | None
    solve_s: float
    ok: bool | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bench(graphs: Sequence[tuple[str, CostGraph]], *, budgets: Sequence[Any] = BUDGETS,
          solvers: Sequence[str] = (*EXACT, *BASELINES), time_limit_s: float | None = 30.0,
          progress: bool = False) -> list[BenchRow]:
    """Run every solver on every graph at every budget.

    Args:
        graphs: ``(name, graph)`` pairs.
        budgets: budgets as `parse_budget` reads them; fractions refer to each graph's
            unscheduled predicted peak.
        solvers: solver names.
        time_limit_s: each solver's time limit.
        progress: show a progress bar on stderr.

    Returns:
        The rows, graph by graph, budget by budget, solvers in the order given.

    Raises:
        UnknownSolverError, ValueError: a bad solver name or budget (checked before any run).
    """
    for b in budgets:
        budget_spec(b)
    check_time_limit(time_limit_s)
    for s in solvers:
        get_solver(s)
    rows: list[BenchRow] = []
    total = len(graphs) * len(budgets) * len(solvers)
    with report.progress_bar(enabled=progress, total=total) as step:
        for name, graph in graphs:
            unconstrained = simulate(graph, Schedule.none(graph)).peak_bytes
            for budget in budgets:
                budget_bytes = parse_budget(budget, unconstrained)
                here = []
                for s in solvers:
                    step(f"{name} at {budget}: {s}")
                    t0 = time.perf_counter()
                    r = solve_and_certify(graph, budget_bytes, s, time_limit_s=time_limit_s)
                    dt = time.perf_counter() - t0
                    e = r.estimate
                    here.append(BenchRow(
                        graph=name, nodes=len(graph.compute_nodes), budget=str(budget),
                        budget_bytes=budget_bytes, solver=s, status=r.status,
                        recompute_s=None if e is None else e.recompute_s,
                        peak_bytes=None if e is None else e.peak_bytes,
                        min_feasible_bytes=r.min_feasible_bytes, gap=r.gap, solve_s=dt,
                        ok=None))
                    step(advance=1)
                rows += _judge(here)
    return rows


def _judge(rows: list[BenchRow]) -> list[BenchRow]:
    """Fill ``ok`` of the exact solvers' rows from the baselines' rows at the same budget."""
    fitting = [r.recompute_s for r in rows
               if r.solver not in EXACT and r.status != INFEASIBLE and r.recompute_s is not None]
    out = []
    for r in rows:
        if r.solver in EXACT:
            beats = r.status != INFEASIBLE and all(r.recompute_s <= f + 1e-12 for f in fitting)
            r = replace(r, ok=beats or not fitting)
        out.append(r)
    return out


def verdict(rows: Sequence[BenchRow]) -> str:
    """One line: how many exact answers are at or below every fitting baseline, and which not."""
    judged = [r for r in rows if r.ok is not None]
    bad = [f"{r.graph} {r.budget} {r.solver}" for r in judged if not r.ok]
    return (f"exact solvers at or below every fitting baseline: {len(judged) - len(bad)}/"
            f"{len(judged)}" + (f"; not: {', '.join(bad)}" if bad else ""))


def bench_table(rows: Sequence[BenchRow], *, title: str = "solvers on recorded graphs "
                "(predicted by the simulator)") -> "Table":
    """A rich ``Table`` of the rows, a section per (graph, budget)."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in ("graph", "budget", "solver", "status", "recompute ms", "peak / budget",
                "gap", "solve s", "ok"):
        text = col in ("graph", "solver", "status", "ok")
        table.add_column(col, justify="left" if text else "right",
                         no_wrap=text or col == "budget")
    previous = None
    for r in rows:
        if previous is not None and (r.graph, r.budget) != previous:
            table.add_section()
        previous = (r.graph, r.budget)
        if r.peak_bytes is not None:
            peak = f"{r.peak_bytes / r.budget_bytes:.3f}"
        elif r.min_feasible_bytes is not None:
            peak = f"min {r.min_feasible_bytes / r.budget_bytes:.3f}"
        else:
            peak = "-"
        table.add_row(f"{r.graph} ({r.nodes})", f"{r.budget} ({format_bytes(r.budget_bytes)})",
                      r.solver, r.status,
                      "-" if r.recompute_s is None else f"{r.recompute_s * 1e3:.2f}", peak,
                      "-" if r.gap is None else f"{r.gap:.1%}", f"{r.solve_s:.2f}",
                      "" if r.ok is None else ("yes" if r.ok else "NO"))
    return table
