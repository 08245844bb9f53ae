"""Deep models: the block DP (``blocks``) on GPT- and Llama-style stacks of 12-96 layers.

Each model is built from a config at small widths and profiled under fake tensors with
roofline times for the CPU (``mode="fake", times="roofline", device_spec="cpu"``: no step
runs, so 96 layers profile in about a minute). Per depth and budget (70/50/30% of the
unscheduled peak and the block DP's floor) it prints: compute nodes, the solve time (the
first budget of a depth includes the block table), status (``OPTIMAL*``: proven optimal over
the block space, not certified against the full space), the space, the predicted recompute
time of ``blocks``, ``every_block`` and ``sqrt`` (``-`` where it does not fit), and the floor
as a fraction of the unscheduled peak.

The Llama-style model is written here in plain PyTorch (RMSNorm, SwiGLU, no rotary), so that
96 layers profile quickly; Hugging Face's Llama, which passes the attention mask and rotary
tables to every layer, is solved on a pinned copy (`solvers.pinning`; tests/solvers/
test_blocks_hf.py).

``--quick`` runs 12 and 24 layers only. ``--floors`` prints instead, for the GPT example at
8 layers (width 256, batch 8, sequence 256) and a ViT-like model, the least peak over the
one-level and the nested block space against ``every_block``'s peak. ``--write`` replaces this script's section of
docs/benchmarks.md (`_record.record`: with the date, the machine and this command line).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package
    sys.path.insert(0, str(ROOT))

# this script's folder is on sys.path: the shared writer of docs/benchmarks.md
import _record
import torch
import torch.nn.functional as F
from torch import nn


class _RMSNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _LlamaLayer(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = _RMSNorm(width), _RMSNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)
        self.gate = nn.Linear(width, 2 * width, bias=False)
        self.up = nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).flatten(2))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """A Llama-style decoder: embedding, ``layers.i``, a final norm, a head and the loss."""

    def __init__(self, layers: int, width: int = 32, heads: int = 2, vocab: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(_LlamaLayer(width, heads) for _ in range(layers))
        self.norm = _RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _ViTLayer(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.out(a.transpose(1, 2).flatten(2))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A ViT-like encoder: patch embedding, ``layers.i``, a norm, a class head and the loss."""

    def __init__(self, layers: int, width: int = 64, heads: int = 4, patch: int = 4,
                 classes: int = 10):
        super().__init__()
        self.patch = nn.Conv2d(3, width, patch, stride=patch)
        self.layers = nn.ModuleList(_ViTLayer(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(self.norm(x).mean(1)), labels)


def _floor_models():
    """The models of ``--floors``: where nesting should lower the floor (activations well
    above the parameters)."""
    from examples.gpt import build
    torch.manual_seed(0)
    yield "gpt example, 8 layers, width 256, batch 8, seq 256", build(
        n_layer=8, batch=8, block_size=256, n_embd=256, n_head=4)
    yield "ViT-like, 8 layers, width 64, 64x64 images, batch 16", (
        ViT(8).train(), (torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))))


def _models(depth: int):
    from examples.gpt import build
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))
    yield "gpt", build(batch=2, block_size=32, n_layer=depth, n_head=2, n_embd=32,
                       vocab_size=64)
    yield "llama", (Llama(depth).train(), ids)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="12 and 24 layers only")
    ap.add_argument("--depths", default="12,24,48,96", help="layer counts (default %(default)s)")
    ap.add_argument("--floors", action="store_true",
                    help="instead: the one-level and nested floors against every_block")
    _record.add_write_option(ap)
    args = ap.parse_args(argv)
    from rich.table import Table

    import scheduler
    from scheduler.cost.simulate import simulate
    from scheduler.ir.schedule import Schedule
    from scheduler.report import console as make_console
    from scheduler.solvers import INFEASIBLE, get_solver
    from scheduler.solvers.blockdp import FINE_NODES, floor_bytes, table_of

    if args.floors:
        table = Table(title="Floors (fake profile): least peak over each space, of the "
                            "unscheduled peak", title_justify="left")
        for col in ("model", "nodes", "one-level floor", "nested floor", "every_block",
                    "nested plan: peak, depth"):
            table.add_column(col, justify="left" if col == "model" else "right")
        for name, (model, inputs) in _floor_models():
            g = scheduler.profile(model, inputs, mode="fake", times="roofline",
                                  device_spec="cpu", units=None)
            peak = simulate(g, Schedule.none(g), timeline=False).peak_bytes
            fine = len(g.compute_nodes) <= FINE_NODES
            one = floor_bytes(table_of(g, fine=fine))
            nested = floor_bytes(table_of(g, fine=fine, nested=True))
            every = get_solver("every_block")(g, peak).estimate.peak_bytes
            r = get_solver("blocks_nested")(g, nested)
            table.add_row(name, str(len(g.compute_nodes)), f"{one / peak:.3f}",
                          f"{nested / peak:.3f}", f"{every / peak:.3f}",
                          f"{r.estimate.peak_bytes / peak:.3f}, {r.schedule.depth}")
        make_console().print(table)
        if args.write:
            _record.record("deep_floors", _record.markdown_table(table), device="cpu (fake)",
                           command=_record.command_line(__file__, argv))
        return 0
    depths = [12, 24] if args.quick else [int(d) for d in args.depths.split(",")]
    table = Table(title="Deep models (fake profile, roofline CPU times): the block DP",
                  title_justify="left")
    for col in ("model", "layers", "nodes", "budget", "solve s", "status", "space",
                "recompute blocks", "every_block", "sqrt", "floor / peak"):
        table.add_column(col, justify="left" if col in ("model", "status", "space")
                         else "right")

    def ms(r) -> str:
        return "-" if r.status == INFEASIBLE else f"{r.estimate.recompute_s * 1e3:.2f} ms"

    for depth in depths:
        for name, (model, inputs) in _models(depth):
            g = scheduler.profile(model, inputs, mode="fake", times="roofline",
                                  device_spec="cpu", units=None)
            peak = simulate(g, Schedule.none(g), timeline=False).peak_bytes
            t0 = time.perf_counter()
            floor = floor_bytes(table_of(g, fine=len(g.compute_nodes) <= FINE_NODES))
            first = time.perf_counter() - t0
            for label, budget in (("70%", int(0.7 * peak)), ("50%", int(0.5 * peak)),
                                  ("30%", int(0.3 * peak)), ("floor", floor)):
                t0 = time.perf_counter()
                r = get_solver("blocks")(g, budget)
                solve_s = time.perf_counter() - t0 + first
                first = 0.0
                status = "OPTIMAL*" if r.space_optimal else r.status
                space = "blocks" if r.schedule is None else \
                    r.schedule.meta["space"].split(" (")[0]
                table.add_row(name, str(depth), str(len(g.compute_nodes)), label,
                              f"{solve_s:.2f}", status, space, ms(r),
                              ms(get_solver("every_block")(g, budget)),
                              ms(get_solver("sqrt")(g, budget)), f"{floor / peak:.3f}")
    make_console().print(table)
    if args.write:
        path = _record.record("deep", _record.markdown_table(table), device="cpu (fake)",
                              command=_record.command_line(__file__, argv))
        print(f"updated {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
