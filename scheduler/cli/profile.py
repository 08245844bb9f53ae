"""``scheduler profile``: trace and profile a model into a CostGraph JSON file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

# The module, not its names: `run` looks the profiler hook up at each call (tests replace it).
from scheduler.cli import common
from scheduler.cli.spec import load_factory
from scheduler.quantities import format_bytes, format_seconds

__all__ = ["add_parser", "run"]

_EPILOG = """\
examples:
  scheduler profile examples/gpt.py:build --out graphs/gpt.json
  scheduler profile mypackage.models:tiny --repeats 5 --quiet
  scheduler profile examples/gpt.py:build --mode fake --times roofline --device-spec h100
"""


def add_parser(subparsers: Any) -> None:
    """Register ``profile``."""
    parser = subparsers.add_parser(
        "profile",
        help="trace and profile a model into a CostGraph JSON file",
        description="Trace the model, run one profiled training step, and save the per-node costs\n"
        "(bytes allocated, bytes saved for backward, forward time) as a CostGraph.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common.add_model_spec(parser)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="PATH",
        help="where to write the CostGraph JSON (default: <file-or-module>-<factory>.json here)",
    )
    parser.add_argument(
        "--repeats",
        type=common.positive_int,
        default=None,
        metavar="N",
        help="timed repetitions per node (default: the profiler's own default)",
    )
    common.add_profile_options(parser)
    common.add_units_option(parser)
    parser.add_argument(
        "--quiet", action="store_true", help="print no spinner and no summary; errors still go to stderr"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Profile the model, save the CostGraph, and print its summary unless --quiet."""
    out: Path = args.out if args.out is not None else common.default_out(args.model_spec)
    # Fail on an unwritable destination now, not after minutes of profiling.
    common.prepare_out(out, "--out", "graph.json")
    options = common.profile_options(args)

    model, inputs, loss_fn = load_factory(args.model_spec)
    if args.quiet:
        graph = common.profile_model(model, inputs, loss_fn=loss_fn, repeats=args.repeats,
                                     units=args.units, **options)
    else:
        from rich.console import Console

        with Console(stderr=True).status(f"Profiling {args.model_spec} ..."):
            graph = common.profile_model(model, inputs, loss_fn=loss_fn, repeats=args.repeats,
                                         units=args.units, **options)
    graph.save(out)
    if not args.quiet:
        _print_summary(graph, out)
    return common.EXIT_OK


def _print_summary(graph: Any, out: Path) -> None:
    """The graph's size, bytes and measured step as a table, then ``wrote OUT``."""
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
    meta = getattr(graph, "meta", None)
    how = meta.get("profile", {}) if isinstance(meta, dict) else {}
    if how.get("mode") == "fake":
        table.add_row("profile", f"fake tensors ({how.get('why', '')})")
        table.add_row("times", str(meta.get("times", "")))
        table.add_row("measured peak", "n/a (not run)")
        table.add_row("predicted step", maybe_seconds(graph.measured_step_s))
    else:
        if how:
            table.add_row("profile", f"real ({how.get('why', '')})")
        table.add_row("measured peak", maybe_bytes(graph.measured_peak_bytes))
        scratch = meta.get("scratch") if isinstance(meta, dict) else None
        if isinstance(scratch, dict):
            table.add_row("kernels' scratch", scratch["error"] if "error" in scratch else
                          f"{maybe_bytes(scratch.get('bytes'))} at most, in "
                          f"{len(scratch.get('nodes', {})) + len(scratch.get('steps', {}))} "
                          "nodes and steps (counted)")
        table.add_row("measured step", maybe_seconds(graph.measured_step_s))
    table.add_row("forward (sum of nodes)", format_seconds(forward_s))
    console = Console()
    console.print(table)
    # Outside the table, unwrapped: a long path must stay whole for copying.
    console.print(f"wrote {out}", soft_wrap=True, markup=False, highlight=False)
