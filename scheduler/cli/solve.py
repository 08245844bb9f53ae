"""``scheduler solve``: the checkpointing schedule with the least recompute time within a
budget, saved as JSON."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from scheduler.cli.common import (
    EXIT_OK,
    add_model_spec,
    add_profile_options,
    add_units_option,
    default_out,
    positive_int,
    prepare_out,
    profile_options,
    time_limit,
)
from scheduler.cli.spec import load_factory
from scheduler.quantities import format_bytes, format_seconds

__all__ = ["add_parser", "print_floor", "print_plan", "run", "run_floor"]

_EPILOG = """\
examples:
  scheduler solve examples/gpt.py:build --budget 60% --out gpt.schedule.json
  scheduler solve examples/mlp.py:build --budget 6GiB --solver greedy --quiet
  scheduler solve examples/mlp.py:build --budget 0.5 --solver uniform:4
  scheduler solve examples/gpt.py:build --budget 2GiB --mode fake --device cuda
  scheduler solve examples/gpt.py:build --floor --json
  scheduler solve examples/gpt.py:build --budget 75% --units auto   # inside its forward
  scheduler profile examples/gpt.py:build --mode fake --out g.json
  scheduler solve g.json --budget 60%                # a saved profile: no model code runs

budgets: bytes ('6GiB', '512MB', '1.5e9', '1024') or a fraction of the unscheduled
predicted peak ('60%', '0.6').
"""


def add_parser(subparsers: Any) -> None:
    """Register ``solve``."""
    parser = subparsers.add_parser(
        "solve",
        help="find the checkpointing schedule with the least recompute time within a budget",
        description="Trace and profile the model, solve for the schedule with the least recompute\n"
        "time whose predicted peak memory fits the budget, and save it as JSON.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_spec(parser, graphs=True)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--budget", default=None, metavar="BUDGET",
        help="peak memory of one training step: '6GiB', '512MB', '1.5e9' bytes, or '60%%' / "
        "'0.6' of the unscheduled predicted peak (required unless --floor)",
    )
    which.add_argument(
        "--floor", action="store_true",
        help="print the smallest budget that fits (the least peak of any schedule found), the "
        "proven lower bound beside it, its status and space, instead of solving at a budget",
    )
    parser.add_argument(
        "--json", action="store_true",
        help="with --floor: print the floor as JSON",
    )
    parser.add_argument(
        "--solver", default="auto", metavar="NAME",
        help="solver name (default: auto): an exact one (auto, relax, dp, cpsat, cpsat_fine) "
        "or a baseline "
        "(none, every_block, sqrt, uniform:K, greedy, knapsack)",
    )
    parser.add_argument(
        "--time-limit", type=time_limit, default=30.0, metavar="SECONDS",
        help="seconds for solving (every solve to the schedule; not profiling or applying "
        "the plan; default: 30)",
    )
    parser.add_argument(
        "--headroom", type=float, default=0.0, metavar="FRACTION",
        help="fraction of the budget held back for cost-model error (default: 0)",
    )
    parser.add_argument(
        "--execution", choices=("eager", "compiled"), default="eager",
        help="how the plan's step runs, which sets what a replay costs: eager (default), or "
        "compiled for torch.compile(plan.module) (matmuls, convolutions and attention replay "
        "at full cost, fused ops for free); the budget is then the compiled step's peak, "
        "measured by compiling candidate plans where the model runs here",
    )
    parser.add_argument(
        "--no-measure-compiled", dest="measure_compiled", action="store_false",
        help="with --execution compiled: do not compile and measure; the budget holds for the "
        "eager step's predicted peak",
    )
    add_units_option(parser)
    parser.add_argument(
        "--repeats", type=positive_int, default=None, metavar="N",
        help="timed profile steps (default: the profiler's own default)",
    )
    add_profile_options(parser)
    parser.add_argument(
        "--out", type=Path, default=None, metavar="PATH",
        help="where to write the schedule JSON (default: <file-or-module>-<factory>.schedule.json "
        "here)",
    )
    parser.add_argument(
        "--quiet", action="store_true",
        help="print no spinner and no summary; errors still go to stderr",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Profile and solve the model, save the plan's schedule, and print it unless --quiet;
    with --floor, print the floor instead."""
    from scheduler.budget import budget_spec
    from scheduler.plan import solve
    from scheduler.solvers import get_solver

    if args.floor:
        return run_floor(args)
    graph = saved_graph(args)
    if graph is not None:
        return run_graph(args, graph)

    out: Path = args.out if args.out is not None else default_out(args.model_spec).with_suffix(
        ".schedule.json")
    # Fail on a bad budget, solver or destination now, not after minutes of profiling.
    budget_spec(args.budget)
    get_solver(args.solver)
    if not 0 <= args.headroom < 1:
        raise ValueError(f"--headroom must be a fraction in [0, 1), got {args.headroom}")
    prepare_out(out, "--out", "schedule.json")
    options = profile_options(args)

    model, inputs, loss_fn = load_factory(args.model_spec)
    kwargs: dict[str, Any] = dict(budget=args.budget, loss_fn=loss_fn, solver=args.solver,
                                  time_limit_s=args.time_limit, headroom=args.headroom,
                                  execution=args.execution, units=args.units,
                                  measure_compiled=args.measure_compiled, **options)
    if args.repeats is not None:
        kwargs["repeats"] = args.repeats
    if args.quiet:
        plan = solve(model, inputs, **kwargs)
    else:
        from rich.console import Console

        with Console(stderr=True).status(f"Solving {args.model_spec} ...") as status:
            plan = solve(
                model, inputs, progress=lambda msg: status.update(f"{args.model_spec}: {msg} ..."),
                **kwargs)
    plan.save(out)
    if not args.quiet:
        print_plan(plan, out)
    return EXIT_OK


def run_floor(args: argparse.Namespace) -> int:
    """``--floor``: profile the model and print its floor (table, or JSON with --json)."""
    import json

    from scheduler.workflows.floor import floor

    graph = saved_graph(args)
    if graph is not None:
        found = floor(graph, time_limit_s=args.time_limit)
    else:
        model, inputs, loss_fn = load_factory(args.model_spec)
        kwargs: dict[str, Any] = dict(loss_fn=loss_fn, time_limit_s=args.time_limit,
                                      units=args.units, **profile_options(args))
        if args.repeats is not None:
            kwargs["repeats"] = args.repeats
        found = floor(model, inputs, **kwargs)
    if args.json:
        print(json.dumps(found.to_dict(), indent=2))
    elif not args.quiet:
        print_floor(found)
    return EXIT_OK


def saved_graph(args: argparse.Namespace) -> Any:
    """The `CostGraph` MODEL_SPEC names when it is a ``.json`` file (``scheduler profile``'s
    output), else None. The options that say how to profile a model do not apply to it."""
    if not args.model_spec.endswith(".json"):
        return None
    from scheduler.ir.graph import CostGraph

    given = [flag for flag, value, default in (
        ("--mode", args.mode, "auto"), ("--times", args.times, None),
        ("--device", args.device, None), ("--device-spec", args.device_spec, None),
        ("--repeats", args.repeats, None), ("--units", args.units, "default"),
        ("--parallel", args.parallel, None))
        if value != default]
    if given:
        raise ValueError(f"{', '.join(given)} say how to profile a model, but "
                         f"{args.model_spec} is a profiled graph already: drop them, or pass "
                         "them to 'scheduler profile'")
    return CostGraph.load(args.model_spec)


def run_graph(args: argparse.Namespace, graph: Any) -> int:
    """Solve a saved `CostGraph` (no model, no torch model code), save the schedule, and
    print it unless --quiet."""
    from types import SimpleNamespace

    from scheduler.budget import budget_spec
    from scheduler.cost.simulate import simulate
    from scheduler.ir.schedule import Schedule
    from scheduler.plan import solve_graph
    from scheduler.units import UnitChoice

    out: Path = args.out if args.out is not None else Path(args.model_spec).with_suffix(
        ".schedule.json")
    budget_spec(args.budget)
    prepare_out(out, "--out", "schedule.json")
    result = solve_graph(graph, args.budget, solver=args.solver, time_limit_s=args.time_limit,
                         headroom=args.headroom, execution=args.execution)
    result.schedule.save(out)
    if not args.quiet:
        print_plan(SimpleNamespace(
            estimate=result.estimate, result=result, status=result.status, gap=result.gap,
            schedule=result.schedule, solve_s=result.solve_s, budget_bytes=result.budget_bytes,
            unconstrained_peak_bytes=simulate(graph, Schedule.none(graph)).peak_bytes,
            graph=graph, units=UnitChoice(graph.units, "recorded in the profiled graph")),
            out)
    return EXIT_OK


def print_floor(found: Any) -> None:
    """The floor as a table: the least peak found, the proven bounds, status and space."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Floor: the smallest budget that fits", show_header=False,
                  title_justify="left")
    table.add_column("quantity", style="bold")
    table.add_column("value")
    table.add_row("floor", f"{format_bytes(found.bytes)} ({found.bytes} bytes), a schedule "
                  f"found by {found.by}")
    again = found.reproducible_bytes
    table.add_row("in a new process", "not promised: the time limit cut the deterministic "
                  "search short; give more time" if again is None else
                  f"{format_bytes(again)} ({again} bytes) solves (deterministic search, same "
                  "time limit)")
    table.add_row("proven bound", f"{format_bytes(found.lower_bound_bytes)} "
                  f"({found.lower_bound_bytes} bytes) over {found.space}")
    table.add_row("any schedule", f"{format_bytes(found.universal_bytes)} "
                  f"({found.universal_bytes} bytes) at least")
    proven = ("the floor is the least that fits (proven)" if found.status == "OPTIMAL" else
              "between the bound and the floor: unknown, give more time")
    table.add_row("status", f"{found.status}: {proven}")
    table.add_row("solve time", format_seconds(found.solve_s))
    Console().print(table)


def print_plan(plan: Any, out: Path) -> None:
    """The plan as a table (status, the space searched, gap, budget, peak, recompute, step,
    regions), then ``wrote OUT``."""
    from rich.console import Console
    from rich.table import Table

    e = plan.estimate
    table = Table(title=f"Schedule ({plan.result.solver})", show_header=False,
                  title_justify="left")
    table.add_column("quantity", style="bold")
    table.add_column("value", justify="right")
    within = getattr(getattr(plan, "units", None), "paths", ())
    full = ("" if plan.status != "OPTIMAL" else " (over every schedule within the units)"
            if within else " (over the full schedule space)")
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
    phases = getattr(plan, "phases_s", None)
    if phases:  # (what the time limit does not hold: profiling, applying the plan)
        table.add_row("profile, variants, apply",
                      f"{format_seconds(phases.get('profile', 0.0))}, "
                      f"{format_seconds(phases.get('variants', 0.0))}, "
                      f"{format_seconds(phases.get('apply', 0.0))}")
    table.add_row("budget", format_bytes(plan.budget_bytes))
    table.add_row("predicted peak", f"{format_bytes(e.peak_bytes)} "
                  f"({e.peak_bytes / plan.budget_bytes:.0%} of budget)")
    table.add_row("unscheduled peak", format_bytes(plan.unconstrained_peak_bytes))
    meta = getattr(getattr(plan, "graph", None), "meta", None)
    how = meta.get("profile", {}) if isinstance(meta, dict) else {}
    if how:
        times = f", {meta.get('times')} times" if how.get("mode") == "fake" else ""
        table.add_row("profile", f"{how['mode']}{times} ({how.get('why', '')})")
    if isinstance(meta, dict) and meta.get("parallel"):
        table.add_row("per rank of", meta["parallel"])
    compiled = plan.schedule.meta.get("execution") == "compiled"
    if compiled:
        table.add_row("time model", "compiled: replays as under torch.compile(plan.module)")
        peak = getattr(plan, "compiled_peak_bytes", None)
        table.add_row("compiled peak", "not measured (the budget holds for the predicted peak)"
                      if peak is None else f"{format_bytes(peak)} measured "
                      f"({peak / plan.budget_bytes:.0%} of budget; torch.compile, inductor)")
    table.add_row("recompute time", format_seconds(e.recompute_s))
    table.add_row("overhead", f"+{e.overhead:.1%}" + (" (of the eager step)" if compiled else ""))
    if not compiled:  # (the eager step plus compiled replays is no step that runs)
        table.add_row("predicted step", format_seconds(e.step_s))
    table.add_row("regions", f"{len(plan.schedule.regions)} "
                  f"({len(plan.schedule.recompute_regions)} recomputed)")
    units = getattr(plan, "units", None)
    if units is not None and units.paths:
        table.add_row("runs", f"inside the model's own forward, in its units: {units.why}")
    console = Console()
    console.print(table)
    console.print(f"wrote {out}", soft_wrap=True, markup=False, highlight=False)
