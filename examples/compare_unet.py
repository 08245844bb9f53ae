"""Compare the solved schedule with every baseline on the U-Net example, predicted and
measured, in one run.

    python examples/compare_unet.py                                  # 70% and 50% budgets
    python examples/compare_unet.py --small --no-measure             # seconds
    python examples/compare_unet.py --plot unet.png --json unet.json

The same as ``scheduler compare examples/unet.py:build --budget 70% --budget 50%``, from
Python: ``scheduler.compare`` returns a `Comparison` whose table, JSON, CSV and plot hold the
same numbers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package
    sys.path.insert(0, str(ROOT))

import scheduler  # noqa: E402
from examples.unet import build  # noqa: E402
from scheduler.report import console  # noqa: E402

#: ``--small``: a U-Net that profiles in seconds
SMALL = dict(batch=4, channels=3, size=32, base=4, classes=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", action="append", default=None,
                        help="a budget, repeatable (default: 70%% and 50%%)")
    parser.add_argument("--small", action="store_true", help="a tiny U-Net (seconds)")
    parser.add_argument("--no-measure", action="store_true", help="predictions only")
    parser.add_argument("--time-limit", type=float, default=30.0, help="per solver, seconds")
    parser.add_argument("--plot", type=Path, default=None, help="write the plot as a PNG")
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON")
    args = parser.parse_args(argv)

    model, inputs = build(**(SMALL if args.small else {}))
    comparison = scheduler.compare(model, inputs, budgets=args.budget or ["70%", "50%"],
                                   measure=not args.no_measure, time_limit_s=args.time_limit,
                                   repeats=1 if args.small else 3)
    console().print(comparison.table())
    if args.plot is not None:
        comparison.plot(args.plot)
        print(f"wrote {args.plot}")
    if args.json is not None:
        comparison.to_json(args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
