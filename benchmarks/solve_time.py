"""Time to a plan, end to end, on tiny Hugging Face models in units: ``scheduler.solve(model,
batch, budget=...)`` from the model to the planned module, by phase, with identical units
sharing one trace (`scheduler.units.share`) and without (every unit exporting its own), in
interleaved rounds.

    python benchmarks/solve_time.py                    # Qwen3, 4 and 16 layers, 3 rounds
    python benchmarks/solve_time.py --write            # and record the table

The solver is ``chain`` (no clock: the same schedule every round, so that the rounds differ
only in time). One torch thread. Reports the median over rounds of the whole call and of
its phases (`Plan.phases_s`), and the unit traces exported in the apply phase's warm-up.
With ``--write`` the table replaces the ``solve_time`` section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import scheduler  # noqa: E402
from _record import add_write_option, publish  # noqa: E402
from scheduler.units import share, units_plan  # noqa: E402


def build(layers: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import transformers
    cfg = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        use_cache=False)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).train()
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def once(layers: int, shared: bool, budget: str) -> dict[str, float]:
    model, batch = build(layers)
    share.ENABLED = shared
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            plan = scheduler.solve(model, batch, budget=budget, solver="chain")
            total = time.perf_counter() - t0
    finally:
        share.ENABLED = True
    forwards = list(units_plan(plan.module).forwards.values())
    traces = sum(f.traces for f in forwards)
    reused = forwards[0]._shared.shared if forwards else 0
    return {"total": total, **plan.phases_s, "exported": traces - reused,
            "traces": traces}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="4,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", default="70%")
    add_write_option(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    depths = [int(x) for x in args.layers.split(",")]
    got: dict[tuple[int, bool], list[dict[str, float]]] = {}
    for r in range(args.rounds):
        for layers in depths:
            for shared in ((True, False) if r % 2 == 0 else (False, True)):
                got.setdefault((layers, shared), []).append(once(layers, shared, args.budget))
                print(layers, shared, {k: round(v, 2) for k, v in got[layers, shared][-1].items()},
                      flush=True)
    lines = [f"Qwen3 (tiny: width 64, batch 2 x 128), units, `solve(..., budget="
             f"{args.budget!r}, solver='chain')`, CPU, one torch thread; median of "
             f"{args.rounds} interleaved rounds",
             "", "| layers | shared traces | total | profile | solve | variants | apply | "
             "unit traces exported / held |", "|---|---|---|---|---|---|---|---|"]
    for layers in depths:
        for shared in (False, True):
            runs = got[layers, shared]
            med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
            lines.append(f"| {layers} | {'yes' if shared else 'no'} | {med['total']:.1f} s | "
                         f"{med.get('profile', 0):.1f} s | {med.get('solve', 0):.1f} s | "
                         f"{med.get('variants', 0):.1f} s | {med.get('apply', 0):.1f} s | "
                         f"{int(med['exported'])} / {int(med['traces'])} |")
    lines += ["", "Read: sharing removes the apply phase's exports but one per call signature "
              "(eager and compiled mask choices, with and without Trainer's loss keywords); "
              "what is left grows with depth in the profile (the whole step traced and "
              "profiled) and the variants (the step profiled again at each call variant), "
              "where identical units are not yet profiled once."]
    publish("solve_time", lines, write=args.write, device="cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
