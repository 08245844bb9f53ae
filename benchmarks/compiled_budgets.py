"""Issue 38 item 1: plans for ``torch.compile`` whose compiled step keeps to the budget.

    python benchmarks/compiled_budgets.py                          # gpt, hf_gpt2, unet at 55/70/85%
    python benchmarks/compiled_budgets.py --examples gpt --budgets 0.5,0.6,0.7,0.8,0.9 --write
    python benchmarks/compiled_budgets.py --quick                  # tiny models, one budget

For each example (``peers.EXAMPLES``) and budget (a fraction of the unscheduled predicted
peak), ``scheduler.solve(..., execution="compiled")`` with ``measure_compiled`` (the default):
the plan compiled and measured, solved again at other targets until the fastest that keeps
to the budget (`scheduler.compiled_fit`). Beside what it reports, the plan's compiled step is
measured again independently: dynamo reset, the FX-graph and AOT-autograd caches off, a new
``torch.compile(plan.module)``, its peak from the profiler's memory events
(`measurement.compiled.compiled_peak`). Columns: the eager cost model's peak of the first
plan (solved at the budget; "-" where none fits it) and of the plan kept, the compiled peak
of the first plan (what planning against the eager prediction gave), the plan's reported
compiled peak, the peak measured again, whether that is within the budget and within 3% of
the reported one, how many plans were compiled and the solve's wall time. Peaks only, so a
loaded machine does not change them. ``--write`` replaces the ``compiled_budgets`` section of
``docs/benchmarks.md`` (or ``--section``'s).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import time
from pathlib import Path

import torch
import torch._dynamo as dynamo
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package
    sys.path.insert(0, str(ROOT))

# this script's folder is on sys.path
import _record
from peers import EXAMPLES, QUICK

import scheduler
from scheduler.budget import InfeasibleBudgetError
from scheduler.measurement.compiled import compiled_peak

#: the progress line `compiled_fit.fit_compiled` says for each plan it measures
TRY = re.compile(r"solved at (.+): compiled peak (.+) against")


def mib(b: int) -> str:
    return f"{b / 2**20:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", default="gpt,hf_gpt2,unet",
                        help=f"comma-separated, of {', '.join(EXAMPLES)}")
    parser.add_argument("--budgets", default="0.55,0.7,0.85",
                        help="fractions of the unscheduled predicted peak")
    parser.add_argument("--time-limit", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="tiny models (a smoke test)")
    parser.add_argument("--section", default="compiled_budgets",
                        help="the docs/benchmarks.md section --write replaces")
    _record.add_write_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    budgets = [float(b) for b in args.budgets.split(",")]
    table = Table(title="Plans solved for compiled execution (measure_compiled), their compiled "
                        "step measured again from a fresh compilation; peaks in MiB from the "
                        "profiler's memory events, 1 thread", title_justify="left")
    for col in ("example", "budget", "budget MiB", "eager plan: predicted", "eager plan: "
                "compiled", "kept: predicted", "kept: reported compiled", "measured again",
                "within budget", "again / reported", "plans compiled", "solve"):
        table.add_column(col, justify="left" if col == "example" else "right")
    for key in args.examples.split(","):
        label, module_name, kwargs = EXAMPLES[key]
        build = importlib.import_module(module_name).build
        for fraction in budgets:
            model, inputs = build(**(QUICK[key] if args.quick else kwargs))
            lines: list[str] = []
            t0 = time.perf_counter()
            try:
                plan = scheduler.solve(model, inputs, budget=fraction, execution="compiled",
                                       time_limit_s=args.time_limit, progress=lines.append)
            except InfeasibleBudgetError as e:
                tries = [m.groups() for m in map(TRY.match, lines) if m]
                table.add_row(label, f"{fraction:.0%}", mib(e.budget_bytes), "-",
                              tries[0][1] if tries else "-", "-", "-", "-",
                              "no plan" if tries else "infeasible", "-", str(len(tries)),
                              f"{time.perf_counter() - t0:.0f} s")
                Console(width=200).print(f"{label} {fraction:.0%}: {e}")
                continue
            solve_s = time.perf_counter() - t0
            tries = [m.groups() for m in map(TRY.match, lines) if m]
            dynamo.reset()
            with inductor_config.patch(force_disable_caches=True), \
                    functorch_config.patch(enable_autograd_cache=False):
                again = compiled_peak(torch.compile(plan.module), inputs)
            dynamo.reset()
            try:  # (the plan kept may be solved above a budget no eager prediction fits)
                first = mib(scheduler.solve_graph(
                    plan.graph, fraction, time_limit_s=args.time_limit,
                    execution="compiled").estimate.peak_bytes)
            except InfeasibleBudgetError:
                first = "-"
            reported = plan.compiled_peak_bytes
            assert reported is not None
            table.add_row(label, f"{fraction:.0%}", mib(plan.budget_bytes),
                          first, tries[0][1] if tries else "-",
                          mib(plan.estimate.peak_bytes), mib(reported), mib(again),
                          "yes" if again <= plan.budget_bytes else "NO",
                          f"{again / reported:.3f}", str(len(tries)), f"{solve_s:.0f} s")
            Console(width=200).print(f"{label} {fraction:.0%}: {'; '.join(lines[-len(tries):])}")
        Console(width=200).print(table)
        if args.write:  # (after each example: a long run that stops keeps what it measured)
            path = _record.record(args.section, _record.markdown_table(table),
                                  device="cpu", command=_record.command_line(__file__, argv))
            print(f"updated {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
