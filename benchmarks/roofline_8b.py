"""What the roofline prices on a Llama-3-8B-shaped step, by op kind, beside PyTorch's own
roofline (``torch.distributed._tools.runtime_estimator.RuntimeEstimator``'s
``operator-level-cost-model``), and how the plan at a budget treats attention.

    python benchmarks/roofline_8b.py                 # 32 layers, sequence 4096
    python benchmarks/roofline_8b.py --write         # and record the tables

The step (forward, loss, backward) runs under fake tensors. Each op is priced twice on an
H100's specification (`DEVICE_SPECS["h100"]`): by `scheduler.capture.op_counter.OpCounter` and
`roofline.roofline_s` (what ``times="roofline"`` profiles use), and by RuntimeEstimator's
``_roofline_estimate`` arithmetic (`torch.utils._runtime_estimation`: ``get_compute_time``,
``get_transfer_time``, its list of ignored ops) with the same peak rates, evaluated here
because RuntimeEstimator itself asks for a CUDA device. Then each attention node of the
profiled graph beside its causal matmul FLOPs at the bf16 peak, and which attention outputs
the plan at ``--budget`` keeps (kept, or in a region's save set) or replays.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import scheduler  # noqa: E402
from _record import publish  # noqa: E402
from scheduler.capture.op_counter import OpCounter, moves_no_data  # noqa: E402
from scheduler.capture.roofline import DEVICE_SPECS, roofline_s  # noqa: E402
from scheduler.quantities import format_bytes, format_seconds  # noqa: E402
from units_8b import build  # noqa: E402

SPEC = DEVICE_SPECS["h100"]
KINDS = ("views and metadata", "matmuls", "attention", "other")


def kind(func: Any, out: Any) -> str:
    name = func._schema.name.split("::")[-1]
    if "scaled_dot_product" in name:
        return "attention"
    if name in ("mm", "addmm", "bmm", "baddbmm"):
        return "matmuls"
    if moves_no_data(func, out):
        return "views and metadata"
    return "other"


class Ours(OpCounter):
    """`OpCounter`, each op's roofline seconds added to its kind."""

    def __init__(self) -> None:
        super().__init__(self._on)
        self.s: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)
        self.last = 0.0

    def _on(self, flops: int, nbytes: int, half: bool) -> None:
        self.last = roofline_s(SPEC, [(flops, nbytes, half)])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.last = 0.0  # (an op that moves no data is not passed on)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        k = kind(func, out)
        self.s[k] += self.last
        self.n[k] += 1
        return out


class Theirs(TorchDispatchMode):
    """RuntimeEstimator's roofline arithmetic per op (`_roofline_estimate`), at `SPEC`'s
    rates, without its check for a CUDA device."""

    def __init__(self) -> None:
        super().__init__()
        import torch.utils._runtime_estimation as rt
        rt.get_device_tflops = lambda dtype: (SPEC.flops if dtype in (
            torch.bfloat16, torch.float16) else SPEC.flops_fp32) / 1e12
        rt.get_gpu_dram_gbps = lambda: SPEC.bandwidth / 1e9
        self.rt = rt
        self.s: dict[str, float] = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rt = self.rt
        if func._overloadpacket not in rt._IGNORE_OPS:
            flat_in, flat_out = pytree.tree_leaves((args, kwargs)), pytree.tree_leaves(out)
            dtypes = {t.dtype for t in flat_out
                      if isinstance(t, torch.Tensor) and t.dtype in rt._FLOAT_TYPES}
            try:
                compute = rt.get_compute_time(func._overloadpacket, args, kwargs, out, dtypes)
            except AssertionError:  # more than one output dtype: as RuntimeEstimator, no time
                compute = 0.0
            ns = max(rt.get_transfer_time(flat_in, flat_out), compute)
            self.s[kind(func, out)] += ns / 1e9
        return out


def step(mode: TorchDispatchMode, layers: int, seq: int) -> None:
    """One training step of the model built on the meta device, its parameters fake CPU
    tensors (as a fake profile runs it: the CPU attention kernel)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    model = build(layers)
    with FakeTensorMode():
        state = {k: torch.empty(t.shape, dtype=t.dtype).requires_grad_(t.requires_grad)
                 for k, t in {**dict(model.named_parameters()),
                              **dict(model.named_buffers())}.items()}
        ids = torch.zeros((1, seq), dtype=torch.long)
        with mode:
            torch.func.functional_call(model, state, (), {"input_ids": ids, "labels": ids}
                                       ).loss.backward()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--budget", default="40GiB")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ours, theirs = Ours(), Theirs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(ours, args.layers, args.seq)
        step(theirs, args.layers, args.seq)
    total_o, total_t = sum(ours.s.values()), sum(theirs.s.values())
    lines = [f"Llama-3-8B shapes, {args.layers} layers, sequence {args.seq}, bf16, one "
             "training step under fake tensors, H100 rates (989 TFLOP/s bf16, 3.35 TB/s, "
             f"{SPEC.per_op_s * 1e6:.0f} us per op in ours)", "",
             "| op kind | ops | ours | RuntimeEstimator's roofline |", "|---|---|---|---|"]
    for k in KINDS:
        lines.append(f"| {k} | {ours.n[k]} | {format_seconds(ours.s[k])} | "
                     f"{format_seconds(theirs.s[k])} |")
    lines.append(f"| step | {sum(ours.n.values())} | {format_seconds(total_o)} | "
                 f"{format_seconds(total_t)} |")
    # the profiled graph's attention nodes, and the plan at the budget
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = scheduler.solve(build(args.layers), {"input_ids": torch.empty(
            (1, args.seq), dtype=torch.long, device="meta")} | {"labels": torch.empty(
                (1, args.seq), dtype=torch.long, device="meta")}, budget=args.budget,
            mode="fake", times="roofline", device_spec="h100", time_limit_s=10)
    g = plan.graph
    heads, dim = 32, 128
    pairs = args.seq * (args.seq + 1) // 2
    fwd = 2 * heads * pairs * 2 * dim / SPEC.flops + SPEC.per_op_s
    bwd = 2 * heads * pairs * 5 * dim / SPEC.flops + SPEC.per_op_s
    sdpa = [n for n in g.nodes if "scaled_dot_product" in n.target]
    ratio_f = [n.time_s / fwd for n in sdpa]
    ratio_b = [n.bwd_time_s / bwd for n in sdpa]
    where: dict[str, str] = {}
    for r in plan.schedule.regions:
        for name in r.nodes:
            where[name] = "kept" if not r.recompute or name in r.save else "replayed"
    counts = defaultdict(int)
    for n in sdpa:
        counts[where.get(n.name, "kept")] += 1
    lines += ["", f"{len(sdpa)} attention nodes in the profiled graph: predicted forward "
              f"{min(ratio_f):.3f}-{max(ratio_f):.3f}x and backward {min(ratio_b):.3f}-"
              f"{max(ratio_b):.3f}x their causal matmul FLOPs at the bf16 peak plus one launch "
              f"({format_seconds(fwd)} and {format_seconds(bwd)}). The plan at {args.budget} "
              f"({plan.status}, predicted peak {format_bytes(plan.estimate.peak_bytes)}, "
              f"+{plan.estimate.overhead:.1%}): attention outputs kept in "
              f"{counts['kept']} layers, replayed in {counts['replayed']}."]
    q = [n for n in g.nodes if n.module_path.endswith("self_attn.q_proj")]
    mm = 2 * args.seq * 4096 * 4096 / SPEC.flops + SPEC.per_op_s
    lines.append(f"Each q_proj Linear node: predicted forward {q[0].time_s / mm:.3f}x its "
                 f"matmul FLOPs at the bf16 peak plus one launch ({format_seconds(mm)}).")
    publish("roofline_8b", lines, write=args.write,
            device="cpu (fake tensors, priced for h100)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
