"""Why ``torch.compile`` at an ``activation_memory_budget`` below 1 beats our compiled plans.

    python benchmarks/partitioner.py --write                     # GPT, GPT 8 x 256, U-Net
    python benchmarks/partitioner.py --examples gpt --rounds 11  # one model

In the race (`benchmarks/peers.py`), compile 0.6 ran faster than compile 1.0 and than our
module compiled without checkpointing, and our compiled plans lost to it by 2.7-4.1% at its
peak. This script compiles, on one torch thread, an example's training step (the GPT
example, a larger GPT, the U-Net):

* ``compile 1.0``: inductor at the default budget (AOTAutograd's min-cut partitioner with its
  recompute bans: random ops, ops far from backward, long fusible chains, ...);
* ``compile 0.8``, ``compile 0.6``: at 0.8 and 0.6; 0.6 on these models takes the
  partitioner's "more aggressive" min-cut branch (`choose_saved_values_set` returns it
  before any knapsack);
* ``compile 1.0 aggressive``: at 1.0 with ``aggressive_recomputation`` on (those bans
  lifted, the not-in-allowlist one too);
* ``save FLOP outputs``: every block under ``torch.utils.checkpoint`` with a selective policy
  that saves the outputs of the partitioner's compute-intensive ops (matmuls, attention;
  torchtitan's list, `_peers_variants.titan_save_ops`) and recomputes every other op, at 1.0;
* ``ours none``: our planned module with nothing checkpointed (a plan at a budget above the
  unscheduled peak), at 1.0: the base our compiled plans start from;
* ``ours form``: the compiled form (`cost.compiled_form`) of that plan, which replays no FLOP
  op: the plan ``solve(..., execution="compiled")`` tries first, and the one it keeps at
  ``compile 0.8``'s peak on the GPT and U-Net examples;
* ``ours form, FLOP inputs saved``: that form, saving as well every node without FLOPs that a
  node with FLOPs reads (`flop_inputs_saved`): compiled, replaying such a node writes its
  output out for the library kernel of its reader's backward, so its replay does not fuse
  away as the form's time model assumes.

For each: the peak of one compiled step (`measurement.compiled.compiled_peak`), the tensors
the partitioner saved for the first graph's backward (count and MiB, read by wrapping
``torch._functorch.partitioners.choose_saved_values_set``, a private function: a benchmark
may lean on it, the library does not), and the step over ``compile 0.6``'s, as the median of
interleaved rounds and the lowest and highest per-round ratio. Two last lines name the op
kinds compile 1.0 saves and compile 0.6 does not, and the other way round, and the same for
our form and compile 0.8.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
import torch._functorch.partitioners as partitioners
from rich.console import Console
from rich.table import Table
from torch.utils.checkpoint import CheckpointPolicy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers_variants import (Variant, block_paths, compiled, fresh_compiles,  # noqa: E402
                             time_rounds, titan_save_ops, wrap_blocks)
from _record import add_write_option, command_line, markdown_table, record  # noqa: E402

import scheduler  # noqa: E402
from examples import gpt, unet  # noqa: E402
from scheduler.cost.compiled_form import fused  # noqa: E402
from scheduler.measurement.compiled import compiled_peak  # noqa: E402

#: key -> (label, example module, build keywords)
EXAMPLES = {"gpt": ("GPT (default)", gpt, {}),
            "gpt_large": ("GPT (8 layers, 256 wide, batch 8 x 256)", gpt,
                          dict(n_layer=8, n_embd=256, batch=8, block_size=256)),
            "unet": ("U-Net (default)", unet, {})}
#: the variant every step is given over
BASE = "compile 0.6"


def save_flop_outputs() -> Callable[..., CheckpointPolicy]:
    """A selective-checkpoint policy: save the compute-intensive ops' outputs, recompute the
    rest."""
    save = titan_save_ops()

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class Saved:
    """Records what the partitioner saves for each compiled variant (by name)."""

    def __init__(self) -> None:
        self.current = ""
        self.sets: dict[str, list[list[Any]]] = {}
        self._orig = partitioners.choose_saved_values_set

    def __enter__(self) -> Saved:
        def spy(joint_graph: Any, node_info: Any, memory_budget: float = 1) -> Any:
            out = self._orig(joint_graph, node_info, memory_budget)
            self.sets.setdefault(self.current, []).append(
                [(str(n.target), partitioners._size_of(n)) for n in out])
            return out

        partitioners.choose_saved_values_set = spy
        return self

    def __exit__(self, *exc: Any) -> None:
        partitioners.choose_saved_values_set = self._orig


def flop_inputs_saved(graph: Any, schedule: Any) -> Any:
    """``schedule`` with every node without FLOPs (`cost.compiled_form.fused`) that a node with
    FLOPs reads added to its recompute region's save set (where it allocates)."""
    read = {p for n in graph.nodes if not fused(graph, n.name) for p in n.inputs
            if fused(graph, p) and graph.allocates(p)}
    return dataclasses.replace(schedule, regions=[
        dataclasses.replace(r, save=r.save | (read & set(r.nodes))) if r.recompute else r
        for r in schedule.regions])


def run(key: str, rounds: int, say: Callable[[str], None]) -> tuple[Table, str]:
    """The table of one example, and the line of op kinds saved by one budget only."""
    label, example, kw = EXAMPLES[key]
    torch.manual_seed(0)
    model, inputs = example.build(**kw)
    ours = scheduler.solve(model, inputs, budget=1 << 50, time_limit_s=10)
    form = scheduler.solve_graph(ours.graph, 1 << 50, time_limit_s=10, execution="compiled",
                                 measured=True)

    def variant(name: str, module: torch.nn.Module, budget: float, **config: Any) -> Variant:
        return Variant(name, "", compiled(copy.deepcopy(module), budget, [0], **config),
                       inputs, compiled=True)

    variants = [
        variant("compile 1.0", model, 1.0),
        variant("compile 0.8", model, 0.8),
        variant(BASE, model, 0.6),
        variant("compile 1.0 aggressive", model, 1.0, aggressive_recomputation=True),
        variant("save FLOP outputs",
                wrap_blocks(model, block_paths(ours.graph), save_flop_outputs), 1.0),
        variant("ours none", ours.module, 1.0),
        variant("ours form", scheduler.apply(model, form.schedule, inputs), 1.0),
        variant("ours form, FLOP inputs saved", scheduler.apply(
            model, flop_inputs_saved(ours.graph, form.schedule), inputs), 1.0),
    ]
    with Saved() as saved:
        for v in variants:  # (the first step compiles: the partitioner runs then)
            saved.current = v.name
            t0 = time.perf_counter()
            v.step()
            say(f"{key}: {v.name} compiled in {time.perf_counter() - t0:.0f} s")
    peaks = {v.name: compiled_peak(v.module, inputs) for v in variants}
    times = dict(zip((v.name for v in variants),
                     time_rounds(variants, rounds, lambda m: say(f"{key}: {m}"))))
    table = Table(title=f"{label}: {rounds} interleaved rounds, 1 thread; step over {BASE}'s")
    for col in ("variant", "peak MiB", "saved (graph 0)", "step", "per round"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    base = times[BASE]
    for v in variants:
        first = saved.sets[v.name][0]
        ratios = [a / b for a, b in zip(times[v.name], base)]
        table.add_row(v.name, f"{peaks[v.name] / 2**20:.2f}",
                      f"{len(first)}, {sum(b for _, b in first) / 2**20:.2f} MiB",
                      f"{statistics.median(times[v.name]) / statistics.median(base):.3f}",
                      f"{min(ratios):.3f}-{max(ratios):.3f}")
    def kinds(name: str) -> Counter[str]:
        return Counter("a parameter" if t.startswith("primals_") else t
                       for t, _ in saved.sets[name][0])

    diff = "\n\n".join(
        f"{label}: saved by {a} only: {dict(kinds(a) - kinds(b))}; by {b} only: "
        f"{dict(kinds(b) - kinds(a))}"
        for a, b in (("compile 1.0", BASE), ("ours form", "compile 0.8")))
    return table, diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default=",".join(EXAMPLES),
                        help=f"comma-separated, of {', '.join(EXAMPLES)}")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (default 9)")
    add_write_option(parser)
    parser.add_argument("--section", default="partitioner",
                        help="with --write, the section of docs/benchmarks.md to replace "
                             "(default: partitioner)")
    args = parser.parse_args(argv)
    keys = [k for k in args.examples.split(",") if k]
    unknown = [k for k in keys if k not in EXAMPLES]
    if unknown or not keys:
        parser.error(f"--examples: {unknown or keys!r} not among {', '.join(EXAMPLES)}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    torch.set_num_threads(1)
    fresh_compiles()
    console = Console()
    parts = []
    for key in keys:
        table, diff = run(key, args.rounds, lambda m: console.print(f"[dim]{m}[/dim]"))
        console.print(table)
        console.print(diff)
        parts.append(f"{markdown_table(table)}\n\n{diff}")
    if args.write:
        record(args.section, "\n\n".join(parts), device="cpu",
               command=command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
