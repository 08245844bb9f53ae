"""Measured against predicted cost of the baselines and of our plans on the example models.

For each example, the schedules of `SCHEDULES` (``none``; the ``every_block``, ``sqrt``,
``greedy`` and ``knapsack`` baselines; ``auto`` at 80%, 65% and 50% of the unscheduled peak)
are applied and measured in ``--repeats`` interleaved rounds (`measure_in_turns`: each round
times one step of every schedule), and the measured step time over the unscheduled step sits
beside the predicted one (``simulate(graph, schedule).step_s`` over the unscheduled
prediction), with the time error (predicted over measured, less 1) and the predicted and
measured peak bytes. Nothing is asserted: this is for eyes (and for spotting where the cost
model is off).

    python benchmarks/overhead.py --model gpt
    python benchmarks/overhead.py --model all --size small --repeats 3 --threads 1
    python benchmarks/overhead.py --model gpt --threads 1 --write

"measured / none" is the median step time of the applied plan over that of the unscheduled
model (both measured here, in the same rounds); "predicted / none" is the predicted step over
the predicted unscheduled step, so the two should agree. With ``--write`` the tables also
replace the ``overhead`` section of ``docs/benchmarks.md`` (`_record.record`: with the date,
the machine and this command line).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package
    sys.path.insert(0, str(ROOT))

# this script's folder is on sys.path: the shared writer of docs/benchmarks.md
import _record

EXAMPLES = ("mlp", "gpt", "unet", "hf_gpt2")
#: ``--size small``: the sizes the tests use (seconds to profile on 2 CPU cores)
SMALL: dict[str, dict[str, Any]] = {
    "mlp": dict(batch=256, dim=64, depth=3),
    "gpt": dict(batch=2, block_size=16, n_layer=2, n_head=2, n_embd=32, vocab_size=64),
    "unet": dict(batch=2, channels=3, size=16, base=4, classes=2),
    "hf_gpt2": dict(batch=2, seq_len=16, n_layer=2, n_head=2, n_embd=32, vocab_size=64),
}


def none(graph: Any) -> Any:
    """No checkpointing."""
    from scheduler.ir.schedule import Schedule

    return Schedule.none(graph)


def baseline(name: str, fraction: float = 1.0) -> Callable[[Any], Any]:
    """The baseline solver ``name`` at ``fraction`` of the unscheduled predicted peak."""
    def make(graph: Any) -> Any:
        from scheduler.solvers import get_solver

        return get_solver(name)(graph, int(unscheduled(graph).peak_bytes * fraction)).schedule
    return make


def solved(fraction: float) -> Callable[[Any], Any]:
    """Our plan (``auto``, 10 s) at ``fraction`` of the unscheduled predicted peak."""
    def make(graph: Any) -> Any:
        import scheduler

        return scheduler.solve_graph(graph, int(unscheduled(graph).peak_bytes * fraction),
                                     time_limit_s=10).schedule
    return make


def unscheduled(graph: Any) -> Any:
    from scheduler.cost.simulate import simulate

    return simulate(graph, none(graph), timeline=False)


#: the schedules of each example: no checkpointing, the baselines, and our plans; solved ones
#: at fractions of the unscheduled peak
SCHEDULES: dict[str, Callable[[Any], Any]] = {
    "none": none,
    "every_block": baseline("every_block"),
    "sqrt": baseline("sqrt"),
    "greedy 70%": baseline("greedy", 0.7),
    "knapsack 70%": baseline("knapsack", 0.7),
    "auto 80%": solved(0.8),
    "auto 65%": solved(0.65),
    "auto 50%": solved(0.5),
}


def bench(name: str, *, size: str, repeats: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Profile ``name`` once, then simulate every schedule in `SCHEDULES` and measure them in
    ``repeats`` interleaved rounds (`measure_in_turns`: a burst of load slows all alike)."""
    import scheduler
    from scheduler.budget import InfeasibleBudgetError
    from scheduler.cost.simulate import simulate
    from scheduler.measurement.step import measure_in_turns

    mod = importlib.import_module(f"examples.{name}")
    model, inputs = mod.build(**(SMALL[name] if size == "small" else {}))
    t0 = time.perf_counter()
    graph = scheduler.profile(model, inputs, repeats=repeats, units=None)
    profile_s = time.perf_counter() - t0
    un = unscheduled(graph)
    schedules, cases = {}, {}
    for label, make in SCHEDULES.items():
        try:
            schedule = make(graph)
        except InfeasibleBudgetError:
            continue
        if any(s == schedule for s in schedules.values()):
            continue  # (the same schedule as an earlier row)
        schedules[label] = schedule
        cases[label] = (model if label == "none" else scheduler.apply(model, schedule, inputs),
                        inputs)
    measured = measure_in_turns(cases, repeats=repeats)
    rows = []
    for label, schedule in schedules.items():
        est, m = simulate(graph, schedule, timeline=False), measured[label]
        ratio = m.step_s / measured["none"].step_s
        rows.append(dict(schedule=label, regions=len(schedule.regions),
                         recomputed=len(schedule.recompute_regions),
                         measured_step_s=m.step_s, ratio=ratio,
                         predicted_ratio=est.step_s / un.step_s,
                         predicted_peak=est.peak_bytes, measured_peak=m.peak_bytes))
    info = dict(nodes=len(graph.compute_nodes), tracer=graph.meta.get("tracer", "?"),
                profile_s=profile_s, device=graph.meta.get("device", "?"),
                inputs=graph.meta.get("inputs", ""))
    return rows, info


def make_table(name: str, rows: list[dict[str, Any]], info: dict[str, Any]) -> Any:
    """The rich ``Table`` of one example's rows."""
    import torch
    from rich.table import Table

    from scheduler.quantities import format_bytes, format_seconds

    table = Table(title=f"{name}: {info['nodes']} nodes ({info['tracer']}), inputs "
                        f"{info['inputs']}, {info['device']}, {torch.get_num_threads()} "
                        f"threads, profiled in {info['profile_s']:.1f} s", title_justify="left")
    for col in ("schedule", "regions (recomputed)", "step", "measured / none",
                "predicted / none", "time error", "predicted peak", "measured peak",
                "peak error"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for r in rows:
        err = r["predicted_peak"] / r["measured_peak"] - 1 if r["measured_peak"] else float("nan")
        table.add_row(r["schedule"], f"{r['regions']} ({r['recomputed']})",
                      format_seconds(r["measured_step_s"]), f"{r['ratio']:.3f}x",
                      f"{r['predicted_ratio']:.3f}x",
                      f"{r['predicted_ratio'] / r['ratio'] - 1:+.1%}",
                      format_bytes(r["predicted_peak"]), format_bytes(r["measured_peak"]),
                      f"{err:+.1%}")
    return table


def print_table(table: Any) -> None:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
        console = Console(width=132)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Measured step time and peak memory of baseline checkpointing schedules "
                    "against the simulator's predictions, per example model.")
    parser.add_argument("--model", choices=[*EXAMPLES, "all"], default="all",
                        help="which example to run (default: all)")
    parser.add_argument("--size", choices=["default", "small"], default="default",
                        help="the example's default size, or the small one the tests use")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed steps per measurement; the median is reported (default 5)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's own choice); 1 gives "
                             "steadier times on a machine other jobs are loading")
    _record.add_write_option(parser)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be at least 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    parts, devices = [], []
    for name in EXAMPLES if args.model == "all" else (args.model,):
        if name == "hf_gpt2" and importlib.util.find_spec("transformers") is None:
            print(f"{name}: skipped (pip install transformers)")
            parts.append(f"{name}: skipped (transformers is not installed)")
            continue
        rows, info = bench(name, size=args.size, repeats=args.repeats)
        table = make_table(name, rows, info)
        print_table(table)
        parts.append(_record.markdown_table(table))
        devices.append(str(info["device"]))
    if args.write:
        path = _record.record("overhead", "\n\n".join(parts),
                              device=", ".join(dict.fromkeys(devices)) or "none",
                              command=_record.command_line(__file__, argv))
        print(f"updated {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
