"""Issue 35's deep models: a Llama-3-8B-shaped model (32 layers; ``--layers 80`` for 70B's depth)
built on the meta device, bf16, planned from a fake profile with units (its decoder layers),
at several budgets and the floor.

    python benchmarks/units_8b.py                      # 32 layers, sequence 4096, 60/40/30 GiB
    python benchmarks/units_8b.py --layers 80 --write  # 140/100/75 GiB, and record the table

For each budget it reports the solver's status, its time, the proven gap, the predicted peak
and recompute overhead; the profile's time once; and the process's peak RSS over the whole
run (planning never allocates activation-sized memory: fake tensors). Times are
``times="roofline"`` on an H100's specification. With ``--write`` the table replaces the
``units_8b`` section of ``docs/benchmarks.md`` (``units_8b_80l`` for 80 layers;
`_record.record`).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import scheduler  # noqa: E402
from _record import publish  # noqa: E402
from scheduler.quantities import format_bytes, format_seconds  # noqa: E402


def build(layers: int) -> torch.nn.Module:
    import transformers
    cfg = transformers.LlamaConfig(  # Llama-3-8B's shapes
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, attn_implementation="sdpa", torch_dtype=torch.bfloat16)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model.train()


def _answered(result: Any) -> str:
    """Which solver's schedule it is, and whether it is proven optimal over that solver's own
    space (`SolveResult.space_optimal`)."""
    return f"{result.solver}{' (optimal over its space)' if result.space_optimal else ''}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--budgets", default=None,
                    help="comma-separated (default: 60/40/30 GiB; 140/100/75 GiB from 64 "
                         "layers on, where parameters and gradients alone take 69 GiB)")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--parallel", default=None,
                    help="plan one rank: ddp or fsdp2:N (default budgets then 20/15/12 GiB)")
    ap.add_argument("--chain", action="store_true",
                    help="also solve each budget's graph with the chain DP alone (solvers/chain)")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    if args.budgets is None:
        args.budgets = ("20GiB,15GiB,12GiB" if args.parallel else
                        "60GiB,40GiB,30GiB" if args.layers < 64 else "140GiB,100GiB,75GiB")
    torch.set_num_threads(1)
    model = build(args.layers)
    ids = torch.empty((1, args.seq), dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "labels": ids}
    rows = []
    graph = None
    for budget in args.budgets.split(",") + ["floor"]:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if budget == "floor":
                assert graph is not None
                fl = scheduler.floor(graph, time_limit_s=args.time_limit)
                rows.append(("floor", "auto", "", fl.status, "", format_bytes(fl.bytes),
                             format_seconds(time.perf_counter() - t0), ""))
                break
            plan = scheduler.solve(model, batch, budget=budget, mode="fake", units="auto",
                                   times="roofline", device_spec="h100",
                                   time_limit_s=args.time_limit, parallel=args.parallel)
        graph = plan.graph
        gap = "n/a" if plan.gap is None else f"{plan.gap:.1%}"
        rows.append((budget, "auto", _answered(plan.result), plan.status, gap,
                     format_bytes(plan.estimate.peak_bytes), format_seconds(plan.solve_s),
                     f"+{plan.estimate.overhead:.1%}"))
        print(rows[-1], flush=True)
        if args.chain:  # the chain DP alone, on the same graph and budget
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = scheduler.solve_graph(graph, plan.budget_bytes, solver="chain",
                                            time_limit_s=args.time_limit)
            took = format_seconds(time.perf_counter() - t0)
            est = res.estimate
            rows.append((budget, "chain", _answered(res), res.status,
                         "n/a" if res.gap is None else f"{res.gap:.1%}",
                         format_bytes(est.peak_bytes) if est else "-", took,
                         f"+{est.overhead:.1%}" if est else "-"))
            print(rows[-1], flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rank = f"one rank of {graph.meta['parallel']}, " if args.parallel else ""
    lines = [f"Llama-3-8B shapes, {args.layers} layers, sequence {args.seq}, bf16, meta device, "
             f"{rank}fake profile, units='auto', roofline h100 times; time limit "
             f"{args.time_limit} s; process peak RSS {format_bytes(rss)}",
             "", "| budget | solver | answered by | status | gap | predicted peak | solve | "
             "overhead |", "|---|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    section = "units_8b" if args.layers == 32 else f"units_8b_{args.layers}l"
    if args.parallel:
        section += "_" + args.parallel.replace(":", "_")
    publish(section, lines,
            write=args.write, device="cpu (planned for h100 from fake tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
