"""Where a plan's peak goes under torch.compile: AOTAutograd's graph against inductor's code.

    python benchmarks/compiled_peaks.py                       # the GPT example, budgets 11.78 and 10.02 MiB
    python benchmarks/compiled_peaks.py --budget 0.6 --budget 0.5 --write

For the GPT example (default size) and each budget, our plan's training-step peak measured by
the profiler's memory events (`measurement.compiled.compiled_peak`) run four ways: eagerly;
under ``torch.compile`` with ``aot_eager_default_partitioner`` (AOTAutograd's functionalised
graph, partitioned by saving what backward needs, no code generation); with ``aot_eager``
(the same graph, the min-cut partitioner that inductor uses); with inductor. The unscheduled
model runs the same ways (inductor left out: it is the slow one). Comparing the columns
separates what the partitioner decides from what inductor's generated code allocates.
Caches are off and dynamo is reset before every compilation. ``--write`` replaces the
``compiled_peaks`` section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import sys
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
from examples.gpt import build

import scheduler
from scheduler.budget import parse_budget
from scheduler.cost.simulate import simulate
from scheduler.ir.schedule import Schedule
from scheduler.measurement.compiled import compiled_peak

BACKENDS = ("aot_eager_default_partitioner", "aot_eager", "inductor")


def peaks_of(module: torch.nn.Module, inputs: tuple, backends: tuple[str, ...]) -> list[int]:
    """Eager, then one compiled peak per backend (dynamo reset before each)."""
    out = [compiled_peak(module, inputs)]
    for backend in backends:
        dynamo.reset()
        out.append(compiled_peak(torch.compile(module, backend=backend), inputs))
    dynamo.reset()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", action="append", default=None,
                        help="budgets (bytes, '10MiB', or fractions of the unscheduled "
                             "predicted peak; default 11.78 and 10.02 MiB)")
    _record.add_write_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    inductor_config.force_disable_caches = True
    functorch_config.enable_autograd_cache = False
    model, inputs = build()
    graph = scheduler.profile(model, inputs, repeats=1)
    unscheduled = simulate(graph, Schedule.none(graph), timeline=False).peak_bytes
    table = Table(title="GPT example (default size), peaks in MiB from the profiler's memory "
                        "events; 1 thread", title_justify="left")
    for col in ("plan", "predicted", "eager", *BACKENDS):
        table.add_column(col, justify="left" if col == "plan" else "right")
    rows = [("none", unscheduled, peaks_of(model, inputs, BACKENDS[:2]) + [None])]
    for b in args.budget or ["11.78MiB", "10.02MiB"]:
        budget = parse_budget(b, unscheduled)
        result = scheduler.solve_graph(graph, budget, time_limit_s=20)
        plan = scheduler.apply(model, result.schedule, inputs)
        rows.append((f"ours at {budget / 2**20:.2f} MiB", result.estimate.peak_bytes,
                     peaks_of(plan, inputs, BACKENDS)))
    for name, predicted, ps in rows:
        table.add_row(name, f"{predicted / 2**20:.2f}",
                      *("-" if p is None else f"{p / 2**20:.2f}" for p in ps))
    Console(width=132).print(table)
    if args.write:
        path = _record.record("compiled_peaks", _record.markdown_table(table), device="cpu",
                              command=_record.command_line(__file__, argv))
        print(f"updated {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
