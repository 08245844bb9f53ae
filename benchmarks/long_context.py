"""Issue 35's long context: a small Hugging Face Llama (8 layers, width 64, sdpa) at sequence
2048, planned with units (the plan runs inside the model's own forward) and as one traced
graph, beside the user's own eager model.

    python benchmarks/long_context.py            # sequence 2048, budgets 90/70/50%
    python benchmarks/long_context.py --write    # and record the table

For each way of planning it reports the predicted unscheduled peak against the eager model's
measured peak (the whole-graph trace builds the causal mask that eager SDPA skips), and for
each budget (a fraction of the plan's unscheduled prediction) the plan's predicted and
measured peak (`scheduler.measure`: live storages, parameters and inputs included). One torch
thread. With ``--write`` the table replaces the ``long_context`` section of
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import scheduler  # noqa: E402
from _record import publish  # noqa: E402
from scheduler.quantities import format_bytes  # noqa: E402


def build(layers: int) -> torch.nn.Module:
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).train()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--budgets", default="0.9,0.7,0.5")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = build(args.layers)
    x = torch.randint(0, 256, (1, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": x, "labels": x}
    own = scheduler.measure(model, batch, repeats=1, allocator=False).peak_bytes
    lines = [f"HF Llama, {args.layers} layers, width 64, sdpa, sequence {args.seq}, batch 1; "
             f"the eager model's measured peak {format_bytes(own)}",
             "", "| plan | budget | unscheduled predicted / eager measured | predicted | "
             "measured | measured / budget |", "|---|---|---|---|---|---|"]
    for units in ("auto", None):
        for frac in map(float, args.budgets.split(",")):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    # (the whole-graph plan cannot trace the stock config's cache)
                    given = batch if units else {**batch, "use_cache": False}
                    plan = scheduler.solve(model, given, budget=frac, units=units,
                                           time_limit_s=args.time_limit, repeats=1)
                except scheduler.InfeasibleBudgetError as e:
                    lines.append(f"| {units or 'whole graph'} | {frac:.0%} | | infeasible: "
                                 f"{str(e)[:60]}... | | |")
                    continue
                got = scheduler.measure(plan.module, given, repeats=1,
                                        allocator=False).peak_bytes
            lines.append(
                f"| {'units' if units else 'whole graph'} | {frac:.0%} "
                f"({format_bytes(plan.budget_bytes)}) | "
                f"{plan.unconstrained_peak_bytes / own:.3f} | "
                f"{format_bytes(plan.estimate.peak_bytes)} | {format_bytes(got)} | "
                f"{got / plan.budget_bytes:.3f} |")
            print(lines[-1], flush=True)
    publish("long_context", lines, write=args.write, device="cpu, 1 thread")
    return 0


if __name__ == "__main__":
    sys.exit(main())
