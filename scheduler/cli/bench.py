"""``scheduler bench``: solver speed and quality on recorded CostGraph files (no model run)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from scheduler.cli.common import (
    EXIT_OK,
    add_json_and_quiet,
    names,
    prepare_out,
    time_limit,
)
from scheduler.files import write_atomic
from scheduler.report import console as make_console

__all__ = ["add_parser", "run"]

_EPILOG = """\
examples:
  scheduler bench graphs/*.json
  scheduler bench graphs/gpt.json --budget 50% --budget 30% --solver dp,cpsat,greedy
  scheduler bench graphs/unet.json --time-limit 5 --json bench.json

Runs no model: each CostGraph file was recorded by 'scheduler profile'. 'ok' says whether an
exact solver's recompute time is at or below every baseline's that fits. Solve times depend
on how busy the machine is; compare them within one run.
"""


def add_parser(subparsers: Any) -> None:
    """Register ``bench``."""
    parser = subparsers.add_parser(
        "bench",
        help="solver speed and quality on recorded CostGraph files (no model run)",
        description="Run every solver on recorded CostGraph JSON files at several budgets and\n"
        "print status, predicted recompute time and peak, and solve time.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("graphs", nargs="+", type=Path, metavar="GRAPH",
                        help="CostGraph JSON files written by 'scheduler profile'")
    parser.add_argument(
        "--budget", action="append", default=None, metavar="BUDGET",
        help="a budget (repeat for several; default: 90%%, 70%%, 50%%, 30%%); fractions refer "
        "to each graph's unscheduled predicted peak",
    )
    parser.add_argument(
        "--solver", action="append", default=None, metavar="NAME",
        help="a solver name (repeat, or separate with commas); default: dp, cpsat, auto and "
        "every baseline",
    )
    parser.add_argument(
        "--time-limit", type=time_limit, default=10.0, metavar="SECONDS",
        help="each solver's time limit in seconds (default: 10)",
    )
    add_json_and_quiet(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the solvers on the graphs, write --json, and print the table and verdict unless
    --quiet."""
    from scheduler.ir.graph import CostGraph
    from scheduler.workflows.bench import (
        BASELINES,
        BUDGETS,
        EXACT,
        bench,
        bench_table,
        verdict,
    )

    prepare_out(args.json, "--json", "bench.json")
    graphs = [(path.stem, CostGraph.load(path)) for path in args.graphs]
    rows = bench(graphs, budgets=args.budget or BUDGETS,
                 solvers=names(args.solver) or (*EXACT, *BASELINES),
                 time_limit_s=args.time_limit, progress=not args.quiet)
    if args.json is not None:
        write_atomic(args.json, json.dumps([r.to_dict() for r in rows], indent=2) + "\n")
    if not args.quiet:
        console = make_console()
        console.print(bench_table(rows))
        console.print(verdict(rows), markup=False, highlight=False)
        if args.json is not None:
            console.print(f"wrote {args.json}", soft_wrap=True, markup=False, highlight=False)
    return EXIT_OK
