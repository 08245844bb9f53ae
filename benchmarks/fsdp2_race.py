"""Issue 36's race: one training step under FSDP2 per unit (``fully_shard`` on each decoder
layer, then the root) on gloo ranks (CPU, 1 thread each), our per-rank plan beside what users
run instead:

* ``full AC``: ``checkpoint`` on every unit (as ``every_block``, torchtitan's ``full``);
* ``selective AC``: torchtitan's selective AC (save matmul and attention outputs, every second
  matmul recomputed: `_peers_variants.titan_policy`);
* ``ours @ <peer>``: ``scheduler.solve(..., parallel="fsdp2", budget=<the peer's measured
  per-rank peak>)``, wrapped the same way;
* ``no AC``: FSDP2 alone, for reference.

Each rank measures each variant's peak (`tests/_ranks.wrapped_step`: every storage, FSDP2's
resized ones, from the step's start) and times one step of every variant per round, in
interleaved rounds (a barrier before each step); the table is rank 0's, medians.

    python benchmarks/fsdp2_race.py [--rounds 5] [--seq 256] [--write]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import scheduler  # noqa: E402
from _peers_variants import titan_policy, wrap_blocks  # noqa: E402
from _ranks import spawn, wrapped_step  # noqa: E402
from _record import publish  # noqa: E402
from scheduler.quantities import format_bytes  # noqa: E402

WORLD = 2


def build(seq: int, rank: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        attn_implementation="sdpa", use_cache=False)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(10 + rank))
    return model, {"input_ids": ids, "labels": ids}


def worker(rank: int, world: int, seq: int, rounds: int) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    model, batch = build(seq, rank)
    units = scheduler.units.find_units(model, "auto").paths

    def call(m: torch.nn.Module) -> torch.Tensor:
        return m(**batch).loss

    variants: dict[str, torch.nn.Module] = {}
    peaks: dict[str, int] = {}
    predicted: dict[str, int] = {}
    for name, policy in (("no AC", None), ("full AC", False), ("selective AC", titan_policy)):
        fresh, _ = build(seq, rank)
        module = fresh if policy is None else wrap_blocks(
            fresh, list(units), None if policy is False else policy)
        variants[name], peaks[name] = wrapped_step(module, "fsdp2", units, call, batch)
    for peer in ("full AC", "selective AC"):
        fresh, _ = build(seq, rank)
        plan = scheduler.solve(fresh, batch, budget=peaks[peer], parallel="fsdp2",
                               time_limit_s=20, repeats=3)
        name = f"ours @ {peer}"
        predicted[name] = plan.estimate.peak_bytes
        module, paths = plan.module, plan.units.paths
        del fresh, plan
        gc.collect()  # (the model's own parameters: freed once fully_shard replaces them)
        variants[name], peaks[name] = wrapped_step(module, "fsdp2", paths, call, batch)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for m in variants.values():  # (one untimed step each)
        call(m).backward()
    for _ in range(rounds):
        for name, m in variants.items():
            for p in m.parameters():
                p.grad = None
            dist.barrier()
            t0 = time.perf_counter()
            call(m).backward()
            times[name].append(time.perf_counter() - t0)
    return {"peaks": peaks, "predicted": predicted,
            "step": {k: statistics.median(v) for k, v in times.items()},
            "spread": {k: (max(v) - min(v)) / statistics.median(v) for k, v in times.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        recs = spawn(worker, WORLD, Path(tmp), args.seq, args.rounds)
    rec = recs[0]
    base = rec["step"]["no AC"]
    lines = [f"HF Llama (8 layers, hidden 128, sequence {args.seq}, batch 2 per rank), FSDP2 "
             f"per decoder layer on {WORLD} gloo ranks (CPU, 1 thread each); rank 0's "
             f"measured per-rank peak and median step over {args.rounds} interleaved rounds",
             "", "| variant | measured peak | predicted peak | step | vs no AC | spread |",
             "|---|---|---|---|---|---|"]
    for name, step in rec["step"].items():
        pred = rec["predicted"].get(name)
        lines.append(f"| {name} | {format_bytes(rec['peaks'][name])} | "
                     f"{format_bytes(pred) if pred else ''} | {step * 1e3:.1f} ms | "
                     f"{step / base:.3f}x | {rec['spread'][name]:.1%} |")
    for peer in ("full AC", "selective AC"):
        ours = rec["step"][f"ours @ {peer}"]
        lines.append("")
        lines.append(f"ours @ {peer}: {ours / rec['step'][peer]:.3f}x its step, at "
                     f"{rec['peaks'][f'ours @ {peer}'] / rec['peaks'][peer]:.3f}x its peak")
    publish("fsdp2_race", lines, write=args.write, device="cpu (2 gloo ranks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
