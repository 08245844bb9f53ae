"""Solve once, save the schedule, and re-apply it later to a fresh model without solving.

    python examples/reapply.py                        # the MLP example, budget 60%
    python examples/reapply.py --small --out /tmp/mlp.schedule.json

``plan.save(path)`` writes the schedule with a fingerprint of the traced graph;
``scheduler.apply(model, path, inputs)`` checks it against the model (a different structure
or input shape is an error that says so) and returns the checkpointed module, which computes
the same loss as the plan's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package
    sys.path.insert(0, str(ROOT))

import scheduler  # noqa: E402
from examples.mlp import build  # noqa: E402
from scheduler.quantities import format_bytes, format_seconds  # noqa: E402

#: ``--small``: an MLP that profiles in seconds
SMALL = dict(batch=256, dim=32, depth=3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="60%", help="memory budget (default: 60%%)")
    parser.add_argument("--small", action="store_true", help="a small MLP (seconds)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to save the schedule (default: a temporary file)")
    args = parser.parse_args(argv)
    size = SMALL if args.small else {}

    with tempfile.TemporaryDirectory() as tmp:
        path = args.out or Path(tmp) / "mlp.schedule.json"
        model, inputs = build(**size)
        plan = scheduler.solve(model, inputs, budget=args.budget, repeats=1)
        plan.save(path)
        print(plan.summary())
        print(f"saved {path}")

        # later, another process: the same architecture and input shapes, no solving
        fresh, fresh_inputs = build(**size)
        module = scheduler.apply(fresh, path, fresh_inputs)
        m = scheduler.measure(module, fresh_inputs, repeats=1)
        same = scheduler.measure(plan.module, inputs, repeats=1).loss == m.loss
    print(f"re-applied: {len(scheduler.planned(module).schedule.recompute_regions)} recompute regions; measured "
          f"peak {format_bytes(m.peak_bytes)} (predicted "
          f"{format_bytes(plan.estimate.peak_bytes)}), step {format_seconds(m.step_s)}; "
          f"same loss as the plan's module: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
