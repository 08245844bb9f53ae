"""How far this machine's speed drifts between a profile and a measured step.

    python benchmarks/profile_drift.py                    # the GPT example, 4 rounds
    python benchmarks/profile_drift.py --examples gpt,unet --rounds 6 --write

A plan's predicted step is its profile's unscheduled step plus its recompute, so a profile
taken while the machine runs slower or faster than when the plan is timed misses by that
drift, whatever the time model. Each round here profiles the example for real
(``mode="real"``) and under fake tensors with ``times="isolated"``, then measures the
unscheduled step (`scheduler.measure`, 5 repeats), back to back, on one torch thread: the
ratios to the step measured just after show each profile's own error, the spread of the
measured steps over the rounds the machine's drift. ``--write`` replaces the
``profile_drift`` section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package
    sys.path.insert(0, str(ROOT))

# this script's folder is on sys.path
import _record
from peers import EXAMPLES, QUICK

import scheduler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", default="gpt",
                        help=f"comma-separated, of {', '.join(EXAMPLES)}")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 rounds")
    _record.add_write_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rounds = 2 if args.quick else args.rounds
    table = Table(title="Profiles and the unscheduled step measured just after them, in rounds "
                        "(1 thread)", title_justify="left")
    for col in ("example", "round", "real profile step", "isolated profile step",
                "measured step", "real / measured", "isolated / measured"):
        table.add_column(col, justify="left" if col == "example" else "right")
    for key in args.examples.split(","):
        label, module_name, kwargs = EXAMPLES[key]
        model, inputs = importlib.import_module(module_name).build(
            **(QUICK[key] if args.quick else kwargs))
        for r in range(rounds):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the fake profile's notes on what it cannot see)
                real = scheduler.profile(model, inputs, repeats=3).measured_step_s
                iso = scheduler.profile(model, inputs, repeats=3, mode="fake",
                                        times="isolated").measured_step_s
            step = scheduler.measure(model, inputs, repeats=5).step_s
            table.add_row(label, str(r + 1), f"{real * 1e3:.1f} ms", f"{iso * 1e3:.1f} ms",
                          f"{step * 1e3:.1f} ms", f"{real / step:.3f}", f"{iso / step:.3f}")
    Console(width=160).print(table)
    if args.write:
        path = _record.record("profile_drift", _record.markdown_table(table), device="cpu",
                              command=_record.command_line(__file__, argv))
        print(f"updated {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
