"""``scheduler apply``: apply a saved schedule to a model and measure it against the
prediction."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scheduler.cli.common import EXIT_OK, add_model_spec, positive_int
from scheduler.cli.spec import load_factory
from scheduler.ir.schedule import Schedule
from scheduler.quantities import format_bytes, format_seconds

__all__ = ["add_parser", "run"]

_EPILOG = """\
examples:
  scheduler apply examples/gpt.py:build gpt.schedule.json
  scheduler apply examples/mlp.py:build mlp-build.schedule.json --repeats 10
"""


def add_parser(subparsers: Any) -> None:
    """Register ``apply``."""
    parser = subparsers.add_parser(
        "apply",
        help="apply a saved schedule to a model and measure it against the prediction",
        description="Apply a schedule written by 'scheduler solve' (no solving), run real\n"
        "training steps of the checkpointed model, and print predicted vs measured peak memory\n"
        "and step time.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_spec(parser)
    parser.add_argument("schedule", type=Path, metavar="SCHEDULE",
                        help="a schedule JSON file written by 'scheduler solve' or plan.save()")
    parser.add_argument(
        "--repeats", type=positive_int, default=None, metavar="N",
        help="timed steps (default: the measurement's own default)",
    )
    parser.add_argument(
        "--quiet", action="store_true",
        help="print no spinner and no table; errors still go to stderr",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Rewrite the model with the saved schedule, measure it, and print predicted against
    measured unless --quiet."""
    from scheduler.measurement.step import measure
    from scheduler.plan import apply

    schedule = Schedule.load(args.schedule)  # a missing or bad file fails before the model loads
    model, inputs, loss_fn = load_factory(args.model_spec)
    kwargs: dict[str, Any] = {} if args.repeats is None else {"repeats": args.repeats}
    if args.quiet:
        module = apply(model, schedule, inputs, loss_fn=loss_fn)
        measure(module, inputs, **kwargs)
        return EXIT_OK
    from rich.console import Console

    with Console(stderr=True).status(f"Applying {args.schedule} to {args.model_spec} ..."):
        module = apply(model, schedule, inputs, loss_fn=loss_fn)
        measured = measure(module, inputs, **kwargs)
    _print_measured(schedule, measured)
    return EXIT_OK


def _print_measured(schedule: Any, measured: Any) -> None:
    """Predicted, measured and their ratio for peak memory and step time, and the budget."""
    from rich.console import Console
    from rich.table import Table

    from scheduler.measurement.step import over_budget_warning

    predicted = schedule.estimate or {}
    table = Table(title=f"{schedule.solver or 'schedule'} ({schedule.status or 'no status'}), "
                  f"measured on {measured.device}", title_justify="left")
    table.add_column("", style="bold")
    table.add_column("predicted", justify="right")
    table.add_column("measured", justify="right")
    table.add_column("measured / predicted", justify="right")

    def row(label: str, key: str, value: float, fmt: Callable[[Any], str]) -> None:
        p = predicted.get(key)
        ratio = f"{value / p:.3f}" if p else "n/a"
        table.add_row(label, "n/a" if p is None else fmt(p), fmt(value), ratio)

    row("peak memory", "peak_bytes", measured.peak_bytes, format_bytes)
    row("step time", "step_s", measured.step_s, format_seconds)
    if schedule.budget_bytes:
        fits = "fits" if measured.peak_bytes <= schedule.budget_bytes else "EXCEEDS"
        if over_budget_warning(schedule, measured.peak_bytes):
            fits += " (a bug: please report it with this schedule file)"
        elif over_budget_warning(schedule, measured.peak_bytes,
                                 allocator_peak_bytes=measured.allocator_peak_bytes):
            fits += (f", but EXCEEDS by the allocator's count "
                     f"({format_bytes(measured.allocator_peak_bytes)}: memory outside the "
                     "tensors, see the warning)")
        table.add_row("budget", format_bytes(schedule.budget_bytes), fits, "")
    Console().print(table)
