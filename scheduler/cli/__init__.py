"""The ``scheduler`` command line.

Each verb is one ``_add_<verb>(subparsers)`` function that builds its parser and sets
``func`` to a ``_cmd_<verb>(args) -> int``; ``_VERBS`` lists the registered ones. Only verbs
that work are registered: ``profile``, ``solve``, ``apply``, ``compare``, ``bench``,
``advise`` and ``max-batch``; a new verb follows the same pattern and reuses
``_add_model_spec``.

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

from scheduler.cli.spec import SpecError, load_factory, split_spec
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


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
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


# ---------------------------------------------------------------------------- solve

_SOLVE_EPILOG = """\
examples:
  scheduler solve examples/gpt.py:build --budget 60% --out gpt.schedule.json
  scheduler solve examples/mlp.py:build --budget 6GiB --solver greedy --quiet
  scheduler solve examples/mlp.py:build --budget 0.5 --solver uniform:4

budgets: bytes ('6GiB', '512MB', '1.5e9', '1024') or a fraction of the unscheduled
predicted peak ('60%', '0.6').
"""


def _add_solve(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "solve",
        help="find the checkpointing schedule with the least recompute time within a budget",
        description="Trace and profile the model, solve for the schedule with the least recompute\n"
        "time whose predicted peak memory fits the budget, and save it as JSON.",
        epilog=_SOLVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_spec(parser)
    parser.add_argument(
        "--budget", required=True, metavar="BUDGET",
        help="peak memory of one training step: '6GiB', '512MB', '1.5e9' bytes, or '60%%' / "
        "'0.6' of the unscheduled predicted peak",
    )
    parser.add_argument(
        "--solver", default="auto", metavar="NAME",
        help="solver name (default: auto): an exact one (auto, relax, dp, cpsat, cpsat_fine) "
        "or a baseline "
        "(none, every_block, sqrt, uniform:K, greedy, knapsack)",
    )
    parser.add_argument(
        "--time-limit", type=_positive_float, default=30.0, metavar="SECONDS",
        help="the solver's time limit in seconds (default: 30)",
    )
    parser.add_argument(
        "--headroom", type=float, default=0.0, metavar="FRACTION",
        help="fraction of the budget held back for cost-model error (default: 0)",
    )
    parser.add_argument(
        "--repeats", type=_positive_int, default=None, metavar="N",
        help="timed profile steps (default: the profiler's own default)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, metavar="PATH",
        help="where to write the schedule JSON (default: <file-or-module>-<factory>.schedule.json "
        "here)",
    )
    parser.add_argument(
        "--quiet", action="store_true",
        help="print no spinner and no summary; errors still go to stderr",
    )
    parser.set_defaults(func=_cmd_solve)


def _cmd_solve(args: argparse.Namespace) -> int:
    import scheduler  # deferred: imports torch
    from scheduler.budget import budget_spec
    from scheduler.solvers import get_solver

    out: Path = args.out if args.out is not None else _default_out(args.model_spec).with_suffix(
        ".schedule.json")
    # Fail on a bad budget, solver or destination now, not after minutes of profiling.
    budget_spec(args.budget)
    get_solver(args.solver)
    if not 0 <= args.headroom < 1:
        raise ValueError(f"--headroom must be a fraction in [0, 1), got {args.headroom}")
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a directory; give a file path such as "
                         f"{str(out / 'schedule.json')!r}")

    model, inputs, loss_fn = load_factory(args.model_spec)
    kwargs: dict[str, Any] = dict(budget=args.budget, loss_fn=loss_fn, solver=args.solver,
                                  time_limit_s=args.time_limit, headroom=args.headroom)
    if args.repeats is not None:
        kwargs["repeats"] = args.repeats
    if args.quiet:
        plan = scheduler.solve(model, inputs, **kwargs)
    else:
        from rich.console import Console

        with Console(stderr=True).status(f"Solving {args.model_spec} ...") as status:
            plan = scheduler.solve(
                model, inputs, progress=lambda msg: status.update(f"{args.model_spec}: {msg} ..."),
                **kwargs)
    plan.save(out)
    if not args.quiet:
        _print_plan(plan, out)
    return EXIT_OK


def _print_plan(plan: Any, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    e = plan.estimate
    table = Table(title=f"Schedule ({plan.result.solver})", show_header=False,
                  title_justify="left")
    table.add_column("quantity", style="bold")
    table.add_column("value", justify="right")
    full = " (over the full schedule space)" if plan.status == "OPTIMAL" else ""
    table.add_row("status", plan.status + full)
    meta = plan.schedule.meta
    space = meta.get("space")
    if space and meta.get("space_optimal") and not full:
        table.add_row("optimal over", space)  # but perhaps not over the full space
    elif space:
        table.add_row("searched", space)
    gap = "n/a" if plan.gap is None else f"{plan.gap:.2%}"
    if plan.gap is None and plan.status == "FEASIBLE":
        gap += " (no lower bound)"
    elif plan.gap is not None and plan.gap >= 1.0:
        gap += " (no lower bound proven)"
    elif plan.gap:
        gap += " (to the full space's lower bound)"
    table.add_row("gap", gap)
    table.add_row("solve time", format_seconds(plan.solve_s))
    table.add_row("budget", format_bytes(plan.budget_bytes))
    table.add_row("predicted peak", f"{format_bytes(e.peak_bytes)} "
                  f"({e.peak_bytes / plan.budget_bytes:.0%} of budget)")
    table.add_row("unscheduled peak", format_bytes(plan.unconstrained_peak_bytes))
    table.add_row("recompute time", format_seconds(e.recompute_s))
    table.add_row("overhead", f"+{e.overhead:.1%}")
    table.add_row("predicted step", format_seconds(e.step_s))
    table.add_row("regions", f"{len(plan.schedule.regions)} "
                  f"({len(plan.schedule.recompute_regions)} recomputed)")
    console = Console()
    console.print(table)
    console.print(f"wrote {out}", soft_wrap=True, markup=False, highlight=False)


# ---------------------------------------------------------------------------- apply

_APPLY_EPILOG = """\
examples:
  scheduler apply examples/gpt.py:build gpt.schedule.json
  scheduler apply examples/mlp.py:build mlp-build.schedule.json --repeats 10
"""


def _add_apply(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "apply",
        help="apply a saved schedule to a model and measure it against the prediction",
        description="Apply a schedule written by 'scheduler solve' (no solving), run real\n"
        "training steps of the checkpointed model, and print predicted vs measured peak memory\n"
        "and step time.",
        epilog=_APPLY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_spec(parser)
    parser.add_argument("schedule", type=Path, metavar="SCHEDULE",
                        help="a schedule JSON file written by 'scheduler solve' or plan.save()")
    parser.add_argument(
        "--repeats", type=_positive_int, default=None, metavar="N",
        help="timed steps (default: the measurement's own default)",
    )
    parser.add_argument(
        "--quiet", action="store_true",
        help="print no spinner and no table; errors still go to stderr",
    )
    parser.set_defaults(func=_cmd_apply)


def _cmd_apply(args: argparse.Namespace) -> int:
    import scheduler  # deferred: imports torch
    from scheduler.ir.schedule import Schedule

    schedule = Schedule.load(args.schedule)  # a missing or bad file fails before the model loads
    model, inputs, loss_fn = load_factory(args.model_spec)
    kwargs: dict[str, Any] = {} if args.repeats is None else {"repeats": args.repeats}
    if args.quiet:
        module = scheduler.apply(model, schedule, inputs, loss_fn=loss_fn)
        scheduler.measure(module, inputs, **kwargs)
        return EXIT_OK
    from rich.console import Console

    with Console(stderr=True).status(f"Applying {args.schedule} to {args.model_spec} ..."):
        module = scheduler.apply(model, schedule, inputs, loss_fn=loss_fn)
        measured = scheduler.measure(module, inputs, **kwargs)
    _print_measured(schedule, measured)
    return EXIT_OK


def _print_measured(schedule: Any, measured: Any) -> None:
    from rich.console import Console
    from rich.table import Table

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
        table.add_row("budget", format_bytes(schedule.budget_bytes), fits, "")
    Console().print(table)


# ---------------------------------------------------------------------------- output paths


def _prepare_out(path: Path | None, flag: str, example: str) -> None:
    """Make ``path``'s folder and refuse a directory, before any long work starts."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a directory; give a file path such as "
                         f"{str(path / example)!r}")


def _need_matplotlib(flag: str) -> None:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"{flag} needs matplotlib, which is not installed: pip install "
                         "matplotlib (or pip install -e '.[plot]'), or leave out " + flag)


def _names(values: list[str] | None) -> list[str] | None:
    """Repeated and comma-separated names (``--strategy auto,greedy --strategy sqrt``)."""
    if values is None:
        return None
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    if not names:
        raise ValueError("--strategy/--solver was given without a name; e.g. --strategy auto")
    return names


def _add_json_and_quiet(parser: argparse.ArgumentParser) -> None:
    """``--json PATH`` (the rows) and ``--quiet`` (no progress bar, no table)."""
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="write the rows as JSON")
    parser.add_argument(
        "--quiet", action="store_true",
        help="print no progress bar and no table; errors still go to stderr",
    )


# ---------------------------------------------------------------------------- compare

_COMPARE_EPILOG = """\
examples:
  scheduler compare examples/gpt.py:build --budget 50% --plot gpt.png --json gpt.json
  scheduler compare examples/unet.py:build --budget 70% --budget 50% --csv unet.csv
  scheduler compare examples/mlp.py:build --budget 60% --strategy auto,greedy --no-measure

Every strategy is solved on one profile of the model; with measuring on, each distinct
schedule is rewritten and measured once, in the same run as the unscheduled step that
measured overheads refer to. A strategy that misses a budget is a row marked NO, not an
error; a budget that no schedule at all fits is an error naming the smallest feasible one.
"""


def _add_compare(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="compare the solved schedule with every baseline, predicted and measured",
        description="Profile the model once, solve every strategy (default: auto and every\n"
        "baseline) at every budget, rewrite and measure each schedule, and print one table:\n"
        "predicted and measured peak memory, step time and overhead over no checkpointing.",
        epilog=_COMPARE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_spec(parser)
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
        "--time-limit", type=_positive_float, default=30.0, metavar="SECONDS",
        help="each solver's time limit in seconds (default: 30)",
    )
    parser.add_argument(
        "--repeats", type=_positive_int, default=3, metavar="N",
        help="timed steps when profiling and when measuring each schedule (default: 3)",
    )
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG",
                        help="write overhead against peak memory per strategy as a PNG")
    parser.add_argument("--csv", type=Path, default=None, metavar="PATH",
                        help="write the rows as CSV")
    _add_json_and_quiet(parser)
    parser.set_defaults(func=_cmd_compare)


def _cmd_compare(args: argparse.Namespace) -> int:
    from scheduler.budget import budget_spec
    from scheduler.solvers import get_solver
    from scheduler.workflows.compare import compare

    # Fail on a bad budget, strategy or destination now, not after minutes of profiling.
    for budget in args.budget:
        budget_spec(budget)
    strategies = _names(args.strategy)
    for name in strategies or ():
        get_solver(name)
    if args.plot is not None:
        _need_matplotlib("--plot")
    _prepare_out(args.plot, "--plot", "compare.png")
    _prepare_out(args.json, "--json", "compare.json")
    _prepare_out(args.csv, "--csv", "compare.csv")

    model, inputs, loss_fn = load_factory(args.model_spec)
    comparison = compare(model, inputs, budgets=args.budget, strategies=strategies,
                         measure=not args.no_measure, loss_fn=loss_fn,
                         time_limit_s=args.time_limit, repeats=args.repeats,
                         progress=not args.quiet)
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
        from scheduler.report import console as make_console

        console = make_console()
        console.print(comparison.table())
        for path in written:
            console.print(f"wrote {path}", soft_wrap=True, markup=False, highlight=False)
    return EXIT_OK


# ---------------------------------------------------------------------------- bench

_BENCH_EPILOG = """\
examples:
  scheduler bench graphs/*.json
  scheduler bench graphs/gpt.json --budget 50% --budget 30% --solver dp,cpsat,greedy
  scheduler bench graphs/unet.json --time-limit 5 --json bench.json

Runs no model: each CostGraph file was recorded by 'scheduler profile'. 'ok' says whether an
exact solver's recompute time is at or below every baseline's that fits. Solve times depend
on how busy the machine is; compare them within one run.
"""


def _add_bench(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="solver speed and quality on recorded CostGraph files (no model run)",
        description="Run every solver on recorded CostGraph JSON files at several budgets and\n"
        "print status, predicted recompute time and peak, and solve time.",
        epilog=_BENCH_EPILOG,
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
        "--time-limit", type=_positive_float, default=10.0, metavar="SECONDS",
        help="each solver's time limit in seconds (default: 10)",
    )
    _add_json_and_quiet(parser)
    parser.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    import json

    from scheduler.ir.graph import CostGraph
    from scheduler.workflows.bench import (
        BASELINES,
        BUDGETS,
        EXACT,
        bench,
        bench_table,
        verdict,
    )

    _prepare_out(args.json, "--json", "bench.json")
    graphs = [(path.stem, CostGraph.load(path)) for path in args.graphs]
    rows = bench(graphs, budgets=args.budget or BUDGETS,
                 solvers=_names(args.solver) or (*EXACT, *BASELINES),
                 time_limit_s=args.time_limit, progress=not args.quiet)
    if args.json is not None:
        args.json.write_text(json.dumps([r.to_dict() for r in rows], indent=2) + "\n")
    if not args.quiet:
        from scheduler.report import console as make_console

        console = make_console()
        console.print(bench_table(rows))
        console.print(verdict(rows), markup=False, highlight=False)
        if args.json is not None:
            console.print(f"wrote {args.json}", soft_wrap=True, markup=False, highlight=False)
    return EXIT_OK


# ---------------------------------------------------------------------------- advise

_ADVISE_EPILOG = """\
examples:
  scheduler advise examples/gpt.py:build --device-memory 24GiB --optimizer adamw
  scheduler advise examples/mlp.py:build --device-memory 8GiB --micro-batches 2,4 --json advice.json
  scheduler advise examples/unet.py:build --device-memory 16GiB --optimizer-state 2GiB --quiet

The step is measured for real (forward, backward and one optimizer step, on a copy of the
model). When it does not fit the device less headroom, checkpointing and gradient accumulation
over 2, 4, 8 micro-batches are priced and the fastest option that fits is recommended.
"""


def _fraction(text: str) -> float:
    """'30%' or '0.3' as 0.3."""
    t = text.strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.3 or 30%, got "
                                         f"{text!r}") from None
    if not value == value or value < 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a fraction >= 0 such as 0.3 or 30%, got "
                                         f"{text!r}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    """'2,4' as (2, 4); '' as ()."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 2,4, "
                                         f"got {text!r}") from None


def _add_solver_options(parser: argparse.ArgumentParser, *, headroom: float) -> None:
    parser.add_argument(
        "--headroom", type=_fraction, default=headroom, metavar="FRACTION",
        help=f"fraction of the memory held back, '0.1' or '10%%' (default: {headroom:g})")
    parser.add_argument("--solver", default="auto", metavar="NAME",
                        help="solver for the checkpointing plans (default: auto)")
    parser.add_argument("--time-limit", type=_positive_float, default=30.0, metavar="SECONDS",
                        help="the solver's time limit in seconds (default: 30)")
    parser.add_argument("--repeats", type=_positive_int, default=1, metavar="N",
                        help="timed steps per measurement (default: 1)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the result as JSON")
    parser.add_argument("--quiet", action="store_true",
                        help="print no spinner and no report; errors still go to stderr")


def _add_advise(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "advise",
        help="where a training step's memory goes, and whether checkpointing is the remedy",
        description="Measure one real training step with its optimizer, break its peak into\n"
        "parameters, gradients, optimizer state, saved activations and the rest, and recommend\n"
        "what makes it fit the device: nothing, checkpointing, gradient accumulation, or\n"
        "remedies beyond them (sharding, lower-precision optimizer state, a smaller model).",
        epilog=_ADVISE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_spec(parser)
    parser.add_argument("--device-memory", required=True, metavar="BYTES",
                        help="the device's memory: '24GiB', '80GB', or bytes")
    parser.add_argument("--optimizer", default="adamw", metavar="NAME",
                        help="optimizer to run one step of: adamw (default), adam, sgd, "
                        "sgd_momentum, rmsprop, adagrad")
    parser.add_argument("--optimizer-state", default=None, metavar="BYTES",
                        help="the optimizer state's size instead of running --optimizer")
    parser.add_argument("--micro-batches", type=_int_list, default=None, metavar="K,K",
                        help="micro-batch counts to price for gradient accumulation "
                        "(default: 2,4,8 where they divide the batch; '' for none)")
    _add_solver_options(parser, headroom=0.1)
    parser.set_defaults(func=_cmd_advise)


def _cmd_advise(args: argparse.Namespace) -> int:
    from scheduler.measurement.breakdown import get_optimizer
    from scheduler.solvers import get_solver
    from scheduler.workflows.advise import advise, check_headroom, parse_memory

    # Fail on bad values now, not after minutes of measuring.
    parse_memory(args.device_memory, "--device-memory")
    state = (None if args.optimizer_state is None
             else parse_memory(args.optimizer_state, "--optimizer-state"))
    if state is None:
        get_optimizer(args.optimizer)
    check_headroom(args.headroom)
    get_solver(args.solver)
    model, inputs, loss_fn = load_factory(args.model_spec)
    kwargs: dict[str, Any] = dict(
        device_memory=args.device_memory, optimizer=args.optimizer,
        optimizer_state_bytes=state, loss_fn=loss_fn, headroom=args.headroom,
        micro_batches=args.micro_batches, solver=args.solver, time_limit_s=args.time_limit,
        repeats=args.repeats)
    advice = _run_quietly_or_not(args, lambda say: advise(model, inputs, progress=say,
                                                          **kwargs))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(advice.to_json())
    if not args.quiet:
        from rich.console import Console

        console = Console()
        for r in advice.renderables():
            console.print(r)
    return EXIT_OK


def _run_quietly_or_not(args: argparse.Namespace, work: Callable[[Callable[[str], None]], Any]
                        ) -> Any:
    """``work(progress)`` under a spinner, or silently with --quiet."""
    if args.quiet:
        return work(lambda _msg: None)
    from rich.console import Console

    with Console(stderr=True).status(f"{args.model_spec} ...") as status:
        return work(lambda msg: status.update(f"{args.model_spec}: {msg} ..."))


# ---------------------------------------------------------------------------- max-batch

_MAX_BATCH_EPILOG = """\
examples:
  scheduler max-batch examples/gpt.py:build --budget 8GiB
  scheduler max-batch examples/gpt.py:build --budget 8GiB --dim block_size --max-overhead 30%
  scheduler max-batch examples/unet.py:build --budget 2GiB --headroom 0 --json unet.json

The factory must take the size as a keyword (--dim, default 'batch'): build(batch=8). The
budget is the peak of one forward + backward step, as in 'scheduler solve'; leave room for
optimizer state ('scheduler advise' measures it).
"""


def _add_max_batch(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "max-batch",
        help="the largest batch size (or sequence length) whose optimal plan fits a budget",
        description="Find the largest size whose optimal checkpointing plan fits the budget less\n"
        "headroom (and stays within --max-overhead), profiling only sizes near the answer, and\n"
        "confirm it by measuring that plan.",
        epilog=_MAX_BATCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_spec(parser)
    parser.add_argument("--budget", required=True, metavar="BYTES",
                        help="peak memory of one training step: '8GiB', '512MB', or bytes")
    parser.add_argument("--dim", default="batch", metavar="KEYWORD",
                        help="the factory keyword that sets the size (default: batch)")
    parser.add_argument("--max-overhead", type=_fraction, default=None, metavar="FRACTION",
                        help="the most predicted recompute overhead allowed: '30%%' or '0.3'")
    parser.add_argument("--start", type=_positive_int, default=None, metavar="N",
                        help="the first size to profile (default: the factory's default)")
    _add_solver_options(parser, headroom=0.1)
    parser.set_defaults(func=_cmd_max_batch)


def _cmd_max_batch(args: argparse.Namespace) -> int:
    from scheduler.cli.spec import resolve_factory
    from scheduler.solvers import get_solver
    from scheduler.workflows.advise import check_headroom, parse_memory
    from scheduler.workflows.max_batch import _check_factory, max_batch

    parse_memory(args.budget, "--budget")
    check_headroom(args.headroom)
    get_solver(args.solver)
    factory = resolve_factory(args.model_spec)
    _check_factory(factory, args.dim, args.start)
    result = _run_quietly_or_not(args, lambda say: max_batch(
        factory, budget=args.budget, max_overhead=args.max_overhead, dim=args.dim,
        headroom=args.headroom, solver=args.solver, time_limit_s=args.time_limit,
        repeats=args.repeats, start=args.start, progress=say))
    if args.json is not None:
        import json

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_dict(), indent=2))
    if not args.quiet:
        print(result.summary())
    return EXIT_OK


# ---------------------------------------------------------------------------- parser and main

# Registration functions for the verbs that work today; append new verbs here.
_VERBS: tuple[Callable[[Any], None], ...] = (_add_profile, _add_solve, _add_apply, _add_compare,
                                              _add_bench, _add_advise, _add_max_batch)


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
