"""Solver speed and quality on recorded graphs: one table, all numbers from one run.

    python benchmarks/solvers.py                      # graphs/*.json, 90%..30% budgets
    python benchmarks/solvers.py graphs/gpt.json --budgets 0.5 --solvers dp,cpsat
    python benchmarks/solvers.py --synthetic 2000     # plus a synthetic DAG of 2000 nodes
    python benchmarks/solvers.py --budgets 0.9,0.7,0.5 --time-limit 10 --synthetic 2000 --write

For each graph and budget (a fraction of the unscheduled predicted peak) it runs every solver
and prints status, predicted recompute time, predicted peak over budget and solve seconds, and
whether the exact solvers' recompute time is <= every baseline's that fits (``ok``), then the
longest solve against the time limit (which every solver keeps to). Nothing is
asserted: machines are shared and timings noisy; read the ratios. The work is
`scheduler.workflows.bench.bench` (also ``scheduler bench``); this script adds the synthetic graph.
With ``--write`` the table also replaces the ``solvers`` section of ``docs/benchmarks.md``
(`_record.record`: with the date, the machine and this command line).
"""

from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# this script's folder is on sys.path: the shared writer of docs/benchmarks.md
import _record  # noqa: E402
from scheduler.ir.graph import CostGraph  # noqa: E402
from scheduler.report import console as make_console  # noqa: E402
from scheduler.workflows.bench import BASELINES, EXACT, bench, bench_table, verdict  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("graphs", nargs="*", help="CostGraph JSON files (default: graphs/*.json)")
    ap.add_argument("--budgets", default="0.9,0.8,0.7,0.6,0.5,0.4,0.3")
    ap.add_argument("--solvers", default=",".join(EXACT + BASELINES))
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--synthetic", type=int, default=0,
                    help="also a synthetic DAG with this many nodes")
    _record.add_write_option(ap)
    args = ap.parse_args(argv)
    paths = args.graphs or sorted(glob.glob("graphs/*.json"))
    graphs = [(Path(p).stem, CostGraph.load(p)) for p in paths]
    if args.synthetic:
        from scheduler.testing.synthetic import random_graph

        graphs.append((f"synthetic-dag-{args.synthetic}",
                       random_graph(args.synthetic, kind="dag", seed=0)))
    rows = bench(graphs, budgets=[float(x) for x in args.budgets.split(",")],
                 solvers=args.solvers.split(","), time_limit_s=args.time_limit, progress=True)
    table = bench_table(rows)
    lines = [verdict(rows)]
    if rows and args.time_limit:
        worst = max(rows, key=lambda r: r.solve_s)
        lines.append(f"longest solve: {worst.solve_s:.2f} s ({worst.solver} on {worst.graph} "
                     f"at {worst.budget}) with a limit of {args.time_limit:g} s")
    console = make_console()
    console.print(table)
    for line in lines:
        console.print(line)
    if args.write:
        body = _record.markdown_table(table) + "\n\n" + "\n\n".join(lines)
        path = _record.record("solvers", body, device="cpu (solvers only: recorded graphs, no model run)",
                              command=_record.command_line(__file__, argv))
        print(f"updated {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
