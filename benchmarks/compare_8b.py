"""Every strategy ranked by prediction for a model that does not fit: a Llama-3-8B-shaped
model (32 layers, sequence 4096, bf16) built on the meta device, `scheduler.compare` with
``measure=False`` from one fake profile with roofline times on an H100's specification.

    python benchmarks/compare_8b.py                  # 40 GiB, the default strategies
    python benchmarks/compare_8b.py --write          # and record the table

Each row: the strategy, its status at the budget, predicted peak and overhead, and the
seconds its solver ran (the profile is taken once, before them)."""

from __future__ import annotations

import argparse
import resource
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import scheduler  # noqa: E402
from _record import publish  # noqa: E402
from scheduler.quantities import format_bytes, format_seconds  # noqa: E402
from units_8b import build  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--budget", default="40GiB")
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ids = torch.empty((1, args.seq), dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = scheduler.compare(build(args.layers), {"input_ids": ids, "labels": ids},
                              budgets=[args.budget], measure=False, mode="fake",
                              times="roofline", device_spec="h100",
                              time_limit_s=args.time_limit, progress=False)
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    lines = [f"Llama-3-8B shapes, {args.layers} layers, sequence {args.seq}, bf16, meta "
             f"device, fake profile, units {len(c.graph.units)} layers, roofline h100 times; "
             f"budget {args.budget}, time limit {args.time_limit} s; whole run "
             f"{format_seconds(wall)}, process peak RSS {format_bytes(rss)}", "",
             "| strategy | status | predicted peak | predicted overhead | solve |",
             "|---|---|---|---|---|"]
    for r in c.rows:
        lines.append(f"| {r.strategy} | {r.status} | {format_bytes(r.predicted_peak_bytes)} "
                     f"| +{r.predicted_overhead:.1%} | {format_seconds(r.solve_s)} |")
    publish("compare_8b", lines, write=args.write,
            device="cpu (planned for h100 from fake tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
