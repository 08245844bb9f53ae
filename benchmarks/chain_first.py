"""`auto` on a small unit graph three ways: as it is (chain's table as rich as
`SolverConfig.chain_work` affords, its schedule one candidate, `relax` first), as it was
before 2026-12-07 (chain's table without tracked anchors), and answering with chain's
proven schedule at once (``chain_first=True``).

    python benchmarks/chain_first.py              # tiny Qwen3, 4 layers, 90..40%
    python benchmarks/chain_first.py --write      # and record the table

The model is `solve_time.build`'s tiny Qwen3 (width 64, batch 2 x 128, fp32), profiled once
in units on this CPU (one torch thread); each budget is solved by both configurations in
turn (interleaved, each on its own copy of the graph), each result certified as
`solve_graph` certifies it (the full-space bound with what the time limit leaves; no RNG
stash held back, unlike `solve_graph`). Budgets are fractions of the unscheduled peak.
With ``--write`` the table replaces the ``chain_first`` section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import scheduler  # noqa: E402
from _record import add_write_option, publish  # noqa: E402
from scheduler.cost.simulate import simulate  # noqa: E402
from scheduler.ir.graph import CostGraph  # noqa: E402
from scheduler.ir.schedule import Schedule  # noqa: E402
from scheduler.solvers import SolverConfig, get_solver  # noqa: E402
from scheduler.solvers.certify import certify  # noqa: E402
from solve_time import build  # noqa: E402

#: the configurations compared: the defaults; chain's table without tracked anchors (the
#: default before 2026-12-07); chain's proven schedule the answer at once
CONFIGS = {"default": SolverConfig(), "tracked 0": SolverConfig(chain_tracked=0),
           "chain_first": SolverConfig(chain_first=True)}


def run(graph, budget: int, config: SolverConfig | None, limit: float) -> tuple:
    t0 = time.perf_counter()
    r = get_solver("auto")(graph, budget, time_limit_s=limit, config=config)
    r = certify(graph, r, time_limit_s=max(0.0, limit - (time.perf_counter() - t0)))
    return r, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--budgets", default="90,70,60,50,40")
    ap.add_argument("--time-limit", type=float, default=30.0)
    add_write_option(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, batch = build(args.layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = scheduler.profile(model, batch)
    keep = simulate(graph, Schedule.none(graph), timeline=False).peak_bytes
    # (one graph object each: what a solve caches beside its graph, tables and the bound's
    # model, is then the configuration's own, as in a process that runs only it)
    graphs = {name: CostGraph.from_dict(graph.to_dict()) for name in CONFIGS}
    lines = [f"Qwen3 (tiny: width 64, batch 2 x 128, fp32), {args.layers} layers, units, "
             f"profiled on this CPU ({len(graph.compute_nodes)} compute nodes); `auto` with a "
             f"{args.time_limit:g} s limit, certified; budgets are fractions of the "
             f"unscheduled peak ({keep:,} B). The first solve of each builds chain's table: "
             "later budgets reuse it.", "",
             "| budget | auto | answered by | status | gap | recompute | solve |",
             "|---|---|---|---|---|---|---|"]
    for pct in (int(x) for x in args.budgets.split(",")):
        budget = keep * pct // 100
        for name, config in CONFIGS.items():
            r, took = run(graphs[name], budget, config, args.time_limit)
            rec = "-" if r.estimate is None else f"{r.estimate.recompute_s * 1e3:.4f} ms"
            gap = "" if r.gap is None else f"{r.gap:.1%}"
            lines.append(f"| {pct}% | {name} | {r.solver} | {r.status} | {gap} | {rec} | "
                         f"{took:.1f} s |")
            print(lines[-1], flush=True)
    publish("chain_first", lines, write=args.write, device="cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
