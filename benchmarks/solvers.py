"""Solver speed and quality on recorded graphs: one table, all numbers from one run.

    python benchmarks/solvers.py                      # graphs/*.json, 90%..30% budgets
    python benchmarks/solvers.py graphs/gpt.json --budgets 0.5 --solvers dp,cpsat
    python benchmarks/solvers.py --synthetic 2000     # plus a synthetic DAG of 2000 nodes

For each graph and budget (a fraction of the unscheduled predicted peak) it runs every solver
and prints status, predicted recompute time, predicted peak over budget and solve seconds, and
whether the exact solvers' recompute time is <= every baseline's that fits (``ok``). Nothing is
asserted: machines are shared and timings noisy; read the ratios.
"""

from __future__ import annotations

import argparse
import glob
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from scheduler.graph import CostGraph  # noqa: E402
from scheduler.schedule import Schedule  # noqa: E402
from scheduler.simulate import simulate  # noqa: E402
from scheduler.solvers import INFEASIBLE, get_solver  # noqa: E402

EXACT = ("dp", "cpsat", "auto")
BASELINES = ("none", "every_block", "sqrt", "uniform:4", "greedy", "knapsack")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("graphs", nargs="*", help="CostGraph JSON files (default: graphs/*.json)")
    ap.add_argument("--budgets", default="0.9,0.8,0.7,0.6,0.5,0.4,0.3")
    ap.add_argument("--solvers", default=",".join(EXACT + BASELINES))
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--synthetic", type=int, default=0,
                    help="also a synthetic DAG with this many nodes")
    args = ap.parse_args(argv)
    paths = args.graphs or sorted(glob.glob("graphs/*.json"))
    graphs = [(Path(p).stem, CostGraph.load(p)) for p in paths]
    if args.synthetic:
        from scheduler.synthetic import random_graph

        graphs.append((f"synthetic-dag-{args.synthetic}",
                       random_graph(args.synthetic, kind="dag", seed=0)))
    solvers = args.solvers.split(",")
    fracs = [float(x) for x in args.budgets.split(",")]
    console = Console()
    table = Table(title="solvers on recorded graphs (predicted by the simulator)")
    for col in ("graph", "budget", "solver", "status", "recompute ms", "peak/budget", "solve s"):
        table.add_column(col, justify="right" if col not in ("graph", "solver", "status")
                         else "left")
    verdicts = []
    for name, g in graphs:
        none_peak = simulate(g, Schedule.none(g)).peak_bytes
        for frac in fracs:
            budget = int(none_peak * frac)
            results = {}
            for s in solvers:
                t0 = time.perf_counter()
                r = get_solver(s)(g, budget, time_limit_s=args.time_limit)
                dt = time.perf_counter() - t0
                results[s] = r
                est = r.estimate
                table.add_row(
                    name, f"{frac:.0%}", s, r.status,
                    f"{est.recompute_s * 1e3:.2f}" if est else "-",
                    f"{est.peak_bytes / budget:.3f}" if est else
                    (f"min {r.min_feasible_bytes / budget:.3f}" if r.min_feasible_bytes
                     else "-"),
                    f"{dt:.2f}")
            fit = [r.estimate.recompute_s for s, r in results.items()
                   if s in BASELINES and r.status != INFEASIBLE]
            for s in EXACT:
                if s in results:
                    r = results[s]
                    ok = (r.status != INFEASIBLE and all(r.estimate.recompute_s <= f + 1e-12
                                                         for f in fit)) or not fit
                    verdicts.append((name, frac, s, ok))
            table.add_section()
    console.print(table)
    bad = [v for v in verdicts if not v[3]]
    console.print(f"exact solvers at or below every fitting baseline: "
                  f"{len(verdicts) - len(bad)}/{len(verdicts)}"
                  + ("" if not bad else f"; not: {bad}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
