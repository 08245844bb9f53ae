"""The ``scheduler`` command line.

One module per verb: ``profile``, ``solve``, ``apply``, ``compare``, ``bench``, ``advise`` and
``max_batch`` (``max-batch``). Each has ``add_parser(subparsers)``, which builds the verb's
parser and sets ``func`` to its ``run(args) -> int``; `VERBS` lists them. A new verb follows
the same pattern and reuses `scheduler.cli.common` (``add_model_spec``, the argument types).

Errors a user can fix (a bad MODEL_SPEC, an untraceable model, nothing requiring grad, a bad or
missing file, an unwritable path, a bad budget or schedule: `common.user_errors`, decided by
type) print one line, ``scheduler: error: ...``, and exit with code 2; ``--debug`` (alias
``--traceback``, before or after the verb) raises them instead, with the full trace. Any other
exception is a bug: its traceback is printed, then a line asking for a report, and the exit
code is 1.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from scheduler.cli import advise, apply, bench, compare, max_batch, profile, solve
from scheduler.cli.common import (
    EXIT_BUG,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    describe_user_error,
    user_errors,
)

__all__ = ["build_parser", "main"]

# The verbs in the order `scheduler --help` lists them; append new ones here.
VERBS = (profile, solve, apply, compare, bench, advise, max_batch)


def _version() -> str:
    try:
        return version("scheduler")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The ``scheduler`` argument parser with every registered verb."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Find the activation-checkpointing schedule with the least recompute time\n"
        "whose peak memory fits a budget.",
        epilog="example:\n  scheduler profile examples/gpt.py:build --out graphs/gpt.json\n"
        "  scheduler solve examples/gpt.py:build --budget 60% --out gpt.schedule.json\n"
        "  scheduler apply examples/gpt.py:build gpt.schedule.json\n"
        "  scheduler compare examples/gpt.py:build --budget 50% --plot gpt.png\n"
        "  scheduler bench graphs/*.json\n"
        "  scheduler advise examples/gpt.py:build --device-memory 24GiB\n"
        "  scheduler max-batch examples/gpt.py:build --budget 1GiB\n\n"
        "Run 'scheduler VERB --help' for a verb's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--debug", "--traceback", dest="debug", action="store_true",
                        help="on an error, show the full Python traceback")
    subparsers = parser.add_subparsers(dest="command", metavar="VERB", required=True)
    for verb in VERBS:
        verb.add_parser(subparsers)
    for sub in subparsers.choices.values():  # also accepted after the verb
        sub.add_argument("--debug", "--traceback", dest="debug", action="store_true",
                         default=argparse.SUPPRESS,
                         help="on an error, show the full Python traceback")
    return parser


def _report_bug(exc: BaseException) -> None:
    traceback.print_exception(exc, file=sys.stderr)
    print(f"{PROG}: internal error: {type(exc).__name__}: {describe_user_error(exc)}\n"
          f"{PROG}: this is a bug in scheduler {_version()} (Python {sys.version.split()[0]}); "
          "please report it with the command line and the traceback above",
          file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line and return its exit code (0 success, 1 a bug, 2 bad input,
    130 interrupted).

    Example:
        >>> main(["profile", "examples/gpt.py:build", "--out", "graphs/gpt.json"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and argparse's own usage errors
        return exc.code if isinstance(exc.code, int) else (EXIT_OK if exc.code is None else EXIT_USAGE)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if args.debug:
            raise
        if not isinstance(exc, user_errors()):
            _report_bug(exc)
            return EXIT_BUG
        message = describe_user_error(exc)
        if isinstance(exc, FileNotFoundError) and exc.filename and str(exc.filename) not in message:
            message = f"{message}: {exc.filename}"
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
