"""The ``scheduler`` command line.

Each verb is one ``_add_<verb>(subparsers)`` function that builds its parser and sets
``func`` to a ``_cmd_<verb>(args) -> int``; ``_VERBS`` lists the registered ones. Only verbs
that work are registered. Still to come, from DESIGN.md: ``solve``, ``apply``, ``compare``,
``advise`` and ``bench``; each will follow the same pattern and reuse ``_add_model_spec``.

Errors a user can fix (a bad MODEL_SPEC, a bad value, a missing file) print one line,
``scheduler: error: ...``, and exit with code 2; ``--traceback`` shows the full trace instead.
"""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from scheduler._spec import SpecError, load_factory, split_spec
from scheduler.units import format_bytes, format_seconds

__all__ = ["build_parser", "main"]

PROG = "scheduler"
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

_USER_ERRORS = (SpecError, ValueError, FileNotFoundError)


def _profile(model: Any, inputs: tuple[Any, ...], *, loss_fn: Any, repeats: int | None) -> Any:
    """Call ``scheduler.profile``; the tests replace this hook with a fake."""
    import scheduler  # deferred: importing the profiler imports torch

    profile_fn = getattr(scheduler, "profile", None)
    if isinstance(profile_fn, types.ModuleType):  # the submodule, where __init__ does not re-export
        profile_fn = getattr(profile_fn, "profile", None)
    if not callable(profile_fn):
        raise RuntimeError("scheduler.profile is not available in this installation")
    kwargs: dict[str, Any] = {"loss_fn": loss_fn}
    if repeats is not None:
        kwargs["repeats"] = repeats
    return profile_fn(model, inputs, **kwargs)


# ---------------------------------------------------------------------------- argument types


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _add_model_spec(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_spec",
        metavar="MODEL_SPEC",
        help="'path/to/file.py:factory' or 'package.module:factory'; the factory takes no "
        "arguments and returns (model, inputs) or (model, inputs, loss_fn)",
    )


def _default_out(spec: str) -> Path:
    target, attr = split_spec(spec)
    stem = Path(target).stem if target.endswith(".py") else target.rsplit(".", 1)[-1]
    return Path(f"{stem}-{attr}.json")


# ---------------------------------------------------------------------------- profile

_PROFILE_EPILOG = """\
examples:
  scheduler profile examples/gpt.py:build --out graphs/gpt.json
  scheduler profile mypackage.models:tiny --repeats 5 --quiet
"""


def _add_profile(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="trace and profile a model into a CostGraph JSON file",
        description="Trace the model, run one profiled training step, and save the per-node costs\n"
        "(bytes allocated, bytes saved for backward, forward time) as a CostGraph.",
        epilog=_PROFILE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_spec(parser)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="PATH",
        help="where to write the CostGraph JSON (default: <file-or-module>-<factory>.json here)",
    )
    parser.add_argument(
        "--repeats",
        type=_positive_int,
        default=None,
        metavar="N",
        help="timed repetitions per node (default: the profiler's own default)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="print no spinner and no summary; errors still go to stderr"
    )
    parser.set_defaults(func=_cmd_profile)


def _cmd_profile(args: argparse.Namespace) -> int:
    out: Path = args.out if args.out is not None else _default_out(args.model_spec)
    # Fail on an unwritable destination now, not after minutes of profiling.
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a directory; give a file path such as {str(out / 'graph.json')!r}")

    model, inputs, loss_fn = load_factory(args.model_spec)
    if args.quiet:
        graph = _profile(model, inputs, loss_fn=loss_fn, repeats=args.repeats)
    else:
        from rich.console import Console

        with Console(stderr=True).status(f"Profiling {args.model_spec} ..."):
            graph = _profile(model, inputs, loss_fn=loss_fn, repeats=args.repeats)
    graph.save(out)
    if not args.quiet:
        _print_profile_summary(graph, out)
    return EXIT_OK


def _print_profile_summary(graph: Any, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    def maybe_bytes(n: int | None) -> str:
        return "n/a" if n is None else format_bytes(n)

    def maybe_seconds(s: float | None) -> str:
        return "n/a" if s is None else format_seconds(s)

    nodes = list(graph.nodes)
    forward_s = sum(float(getattr(n, "time_s", 0.0) or 0.0) for n in nodes)
    table = Table(title="CostGraph", show_header=False, title_justify="left")
    table.add_column("quantity", style="bold")
    table.add_column("value", justify="right")
    table.add_row("nodes", str(len(nodes)))
    table.add_row("parameters", maybe_bytes(graph.param_bytes))
    table.add_row("inputs", maybe_bytes(graph.input_bytes))
    table.add_row("saved activations", maybe_bytes(graph.saved_bytes()))
    table.add_row("measured peak", maybe_bytes(graph.measured_peak_bytes))
    table.add_row("measured step", maybe_seconds(graph.measured_step_s))
    table.add_row("forward (sum of nodes)", format_seconds(forward_s))
    console = Console()
    console.print(table)
    # Outside the table, unwrapped: a long path must stay whole for copying.
    console.print(f"wrote {out}", soft_wrap=True, markup=False, highlight=False)


# ---------------------------------------------------------------------------- parser and main

# Registration functions for the verbs that work today; append new verbs here.
_VERBS: tuple[Callable[[Any], None], ...] = (_add_profile,)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

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
        epilog="example:\n  scheduler profile examples/gpt.py:build --out graphs/gpt.json\n\n"
        "Run 'scheduler VERB --help' for a verb's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument(
        "--traceback", action="store_true", help="on an error, show the full Python traceback"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="VERB", required=True)
    for add_verb in _VERBS:
        add_verb(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line and return its exit code (0 success, 2 bad input, 130 interrupted).

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
    except _USER_ERRORS as exc:
        if args.traceback:
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        if isinstance(exc, FileNotFoundError) and exc.filename and str(exc.filename) not in message:
            message = f"{message}: {exc.filename}"
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
