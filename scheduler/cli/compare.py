"""``scheduler compare``: the solved schedule against every baseline, predicted and measured,
in one table (and optionally JSON, CSV and a plot)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from scheduler.cli.common import (
    EXIT_OK,
    add_json_and_quiet,
    add_model_spec,
    add_profile_options,
    add_units_option,
    names,
    need_matplotlib,
    positive_int,
    prepare_out,
    profile_options,
    time_limit,
)
from scheduler.cli.spec import load_factory
from scheduler.report import console as make_console

__all__ = ["add_parser", "run"]

_EPILOG = """\
examples:
  scheduler compare examples/gpt.py:build --budget 50% --plot gpt.png --json gpt.json
  scheduler compare examples/unet.py:build --budget 70% --budget 50% --csv unet.csv
  scheduler compare examples/mlp.py:build --budget 60% --strategy auto,greedy --no-measure

Every strategy is solved on one profile of the model; with measuring on, each distinct
schedule is rewritten and measured once, in the same run as the unscheduled step that
measured overheads refer to. A strategy that misses a budget is a row marked NO, not an
error; a budget that no schedule at all fits is an error naming the smallest feasible one.
"""


def add_parser(subparsers: Any) -> None:
    """Register ``compare``."""
    parser = subparsers.add_parser(
        "compare",
        help="compare the solved schedule with every baseline, predicted and measured",
        description="Profile the model once, solve every strategy (default: auto and every\n"
        "baseline) at every budget, rewrite and measure each schedule, and print one table:\n"
        "predicted and measured peak memory, step time and overhead over no checkpointing.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_spec(parser)
    parser.add_argument(
        "--budget", action="append", required=True, metavar="BUDGET",
        help="a budget (repeat for several): '6GiB', '512MB', '1.5e9' bytes, or '50%%' / '0.5' "
        "of the unscheduled predicted peak",
    )
    parser.add_argument(
        "--strategy", action="append", default=None, metavar="NAME",
        help="a solver name (repeat, or separate with commas); default: auto, none, "
        "every_block, sqrt, uniform:2, uniform:4, greedy, knapsack",
    )
    parser.add_argument("--no-measure", action="store_true",
                        help="predictions only: do not run the schedules")
    parser.add_argument(
        "--time-limit", type=time_limit, default=30.0, metavar="SECONDS",
        help="each solver's time limit in seconds (default: 30)",
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=3, metavar="N",
        help="timed steps when profiling and when measuring each schedule (default: 3)",
    )
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG",
                        help="write overhead against peak memory per strategy as a PNG")
    parser.add_argument("--csv", type=Path, default=None, metavar="PATH",
                        help="write the rows as CSV")
    add_profile_options(parser)
    add_units_option(parser)
    add_json_and_quiet(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Compare the strategies, write the files asked for, and print the table unless --quiet."""
    from scheduler.budget import budget_spec
    from scheduler.solvers import get_solver
    from scheduler.workflows.compare import compare

    # Fail on a bad budget, strategy or destination now, not after minutes of profiling.
    for budget in args.budget:
        budget_spec(budget)
    strategies = names(args.strategy)
    for name in strategies or ():
        get_solver(name)
    if args.plot is not None:
        need_matplotlib("--plot")
    prepare_out(args.plot, "--plot", "compare.png")
    prepare_out(args.json, "--json", "compare.json")
    prepare_out(args.csv, "--csv", "compare.csv")

    options = profile_options(args)
    model, inputs, loss_fn = load_factory(args.model_spec)
    comparison = compare(model, inputs, budgets=args.budget, strategies=strategies,
                         measure=not args.no_measure, loss_fn=loss_fn,
                         time_limit_s=args.time_limit, repeats=args.repeats,
                         progress=not args.quiet, units=args.units, **options)
    written = []
    if args.json is not None:
        comparison.to_json(args.json)
        written.append(args.json)
    if args.csv is not None:
        comparison.to_csv(args.csv)
        written.append(args.csv)
    if args.plot is not None:
        comparison.plot(args.plot)
        written.append(args.plot)
    if not args.quiet:
        console = make_console()
        console.print(comparison.table())
        for path in written:
            console.print(f"wrote {path}", soft_wrap=True, markup=False, highlight=False)
    return EXIT_OK
