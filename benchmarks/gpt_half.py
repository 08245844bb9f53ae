"""Issue 4's "Real" check: GPT solved at 50% of its unconstrained peak, measured.

    python benchmarks/gpt_half.py                  # examples/gpt.py at its default size
    python benchmarks/gpt_half.py --runs 3 --threads 1 --repeats 7
    python benchmarks/gpt_half.py --threads 1 --write

Each run profiles the example afresh, solves it at the budget with ``auto``, and measures
(`scheduler.compare`, one step of each schedule per round, in turns, median kept) the solved
module beside ``every_block`` (a recompute region per block, the usual hand-written
schedule; measured whether or not it fits the budget) and the unscheduled step. The table
shows, per run, the solved peak against the budget and both measured overheads; the last
column is the solved overhead over every_block's (``<= 1`` is the target). Nothing is
asserted: timings on a shared machine are noisy, so run it on an idle one and read all runs.
With ``--write`` the table also replaces the ``gpt_half`` section of ``docs/benchmarks.md``
(`_record.record`: with the date, the machine and this command line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package
    sys.path.insert(0, str(ROOT))

# this script's folder is on sys.path: the shared writer of docs/benchmarks.md
import _record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", default="50%", help="the budget (default 50%%)")
    ap.add_argument("--runs", type=int, default=3, help="profile + solve + measure runs")
    ap.add_argument("--repeats", type=int, default=5, help="rounds of measurement per run")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--time-limit", type=float, default=30.0)
    _record.add_write_option(ap)
    args = ap.parse_args(argv)
    for name, v in (("--runs", args.runs), ("--repeats", args.repeats)):
        if v < 1:
            ap.error(f"{name} must be at least 1, got {v}")

    import torch
    from rich.table import Table

    import scheduler
    from examples.gpt import build
    from scheduler.report import console as make_console
    from scheduler.quantities import format_bytes, format_seconds

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    table = Table(title=f"GPT (examples/gpt.py) at {args.budget}, {torch.get_num_threads()} "
                        "torch thread(s); overheads measured over the unscheduled step",
                  title_justify="left")
    for col in ("run", "solver", "status", "budget", "peak predicted", "peak measured",
                "fits", "step none", "solved overhead (pred / meas)",
                "every_block overhead (pred / meas)", "solved / every_block"):
        table.add_column(col, justify="left" if col in ("solver", "status") else "right")
    device = "cpu"
    for run in range(1, args.runs + 1):
        model, inputs = build()
        cmp = scheduler.compare(model, inputs, budgets=[args.budget],
                                strategies=["auto", "every_block"], repeats=args.repeats,
                                time_limit_s=args.time_limit, progress=False)
        solved, every = cmp.row("auto", args.budget), cmp.row("every_block", args.budget)
        device = cmp.device
        ratio = (1 + solved.measured_overhead) / (1 + every.measured_overhead)
        table.add_row(
            str(run), solved.solver, solved.status, format_bytes(solved.budget_bytes),
            format_bytes(solved.predicted_peak_bytes), format_bytes(solved.measured_peak_bytes),
            "yes" if solved.fits_measured else "NO",
            format_seconds(cmp.reference.step_s),
            f"{solved.predicted_overhead:+.1%} / {solved.measured_overhead:+.1%}",
            f"{every.predicted_overhead:+.1%} / {every.measured_overhead:+.1%}",
            f"{ratio:.3f}")
    make_console().print(table)
    if args.write:
        path = _record.record("gpt_half", _record.markdown_table(table), device=device,
                              command=_record.command_line(__file__, argv))
        print(f"updated {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
