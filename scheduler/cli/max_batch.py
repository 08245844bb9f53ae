"""``scheduler max-batch``: the largest batch size (or sequence length) whose optimal plan fits
a budget."""

from __future__ import annotations

import argparse
import json
from typing import Any

from scheduler.cli.common import (
    EXIT_OK,
    add_model_spec,
    add_parallel_option,
    add_solver_options,
    fraction,
    positive_int,
    run_quietly_or_not,
)
from scheduler.cli.spec import resolve_factory
from scheduler.files import write_atomic

__all__ = ["add_parser", "run"]

_EPILOG = """\
examples:
  scheduler max-batch examples/gpt.py:build --budget 8GiB
  scheduler max-batch examples/gpt.py:build --budget 8GiB --dim block_size --max-overhead 30%
  scheduler max-batch examples/unet.py:build --budget 2GiB --headroom 0 --json unet.json
  scheduler max-batch examples/gpt.py:build --budget 8GiB --parallel fsdp2:8+adamw

The factory must take the size as a keyword (--dim, default 'batch'): build(batch=8). The
budget is the peak of one forward + backward step, as in 'scheduler solve'; leave room for
optimizer state ('scheduler advise' measures it). With --parallel the budget is one rank's
(optimizer state counted with +adamw) and the answer is predicted, not measured.
"""


def add_parser(subparsers: Any) -> None:
    """Register ``max-batch``."""
    parser = subparsers.add_parser(
        "max-batch",
        help="the largest batch size (or sequence length) whose optimal plan fits a budget",
        description="Find the largest size whose optimal checkpointing plan fits the budget less\n"
        "headroom (and stays within --max-overhead), profiling only sizes near the answer, and\n"
        "confirm it by measuring that plan.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_spec(parser)
    parser.add_argument("--budget", required=True, metavar="BYTES",
                        help="peak memory of one training step: '8GiB', '512MB', or bytes")
    parser.add_argument("--dim", default="batch", metavar="KEYWORD",
                        help="the factory keyword that sets the size (default: batch)")
    parser.add_argument("--max-overhead", type=fraction, default=None, metavar="FRACTION",
                        help="the most predicted recompute overhead allowed: '30%%' or '0.3'")
    parser.add_argument("--start", type=positive_int, default=None, metavar="N",
                        help="the first size to profile (default: the factory's default)")
    add_parallel_option(parser, "; the answer is then predicted, not measured")
    add_solver_options(parser, headroom=0.1)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Search the sizes, write --json, and print the summary unless --quiet."""
    from scheduler.parallel import parse_parallel
    from scheduler.solvers import get_solver
    from scheduler.workflows.advise import check_headroom, parse_memory
    from scheduler.workflows.max_batch import check_factory, max_batch

    # Fail on bad values and a factory without the size keyword now, before any profiling.
    parse_memory(args.budget, "--budget")
    check_headroom(args.headroom)
    get_solver(args.solver)
    parse_parallel(args.parallel)
    factory = resolve_factory(args.model_spec)
    check_factory(factory, args.dim, args.start)
    result = run_quietly_or_not(args, lambda say: max_batch(
        factory, budget=args.budget, max_overhead=args.max_overhead, dim=args.dim,
        headroom=args.headroom, solver=args.solver, time_limit_s=args.time_limit,
        repeats=args.repeats, start=args.start, progress=say, parallel=args.parallel))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, json.dumps(result.to_dict(), indent=2))
    if not args.quiet:
        print(result.summary())
    return EXIT_OK
