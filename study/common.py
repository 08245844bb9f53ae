"""Shared helpers for the torch.compile study: a tiny GPT, plans, gradients and peak memory."""
from __future__ import annotations

import copy

import torch

import scheduler
from examples.gpt import build

torch.set_num_threads(1)

SIZES = dict(batch=4, block_size=64, n_layer=4, n_head=2, n_embd=64, vocab_size=128)


def tiny_gpt(dropout: float = 0.0, **kw):
    return build(**{**SIZES, **kw, "dropout": dropout})


def plan_for(model, inputs, budget="60%", solver="greedy"):
    return scheduler.solve(model, inputs, budget=budget, solver=solver)


def grads(module, inputs, params):
    for p in params:
        p.grad = None
    loss = module(*inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params]


def peak_profiler(fn) -> int:
    """Peak of the running total of CPU memory events seen by the profiler (bytes above the
    level at the start). Sees every allocation through c10's CPU allocator (eager and inductor
    kernels' empty_strided alike)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    evs = [e for e in prof.profiler.kineto_results.events() if e.device_type().name == "CPU"
           and e.name() == "[memory]"]
    evs.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in evs:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


SAVED: list[list[tuple[str, str, int, object]]] = []  # per compiled graph: saved values


def record_saved_tensors() -> None:
    """Wrap inductor's partitioner so each compiled graph's saved-for-backward values are
    recorded in `SAVED` as ``(name, shape, bytes, recompute tag of the forward node)``."""
    import torch._functorch.config as fconfig
    import torch._inductor.compile_fx as cfx
    import torch._inductor.config as iconfig
    iconfig.fx_graph_cache = False  # a cached graph skips the partitioner
    fconfig.enable_autograd_cache = False
    orig = cfx.min_cut_rematerialization_partition
    if getattr(orig, "_study", False):
        return

    def wrapped(joint, joint_inputs, *, num_fwd_outputs, **kw):
        fw, bw = orig(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)
        out = next(n for n in fw.graph.nodes if n.op == "output")
        saved = []
        by_name = {n.name: n for n in joint.graph.nodes}
        for n in out.args[0][num_fwd_outputs:]:
            v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
            if isinstance(v, torch.Tensor) and n.op != "placeholder":  # primals: the params
                j = by_name.get(n.name)
                tag = j.meta.get("recompute") if j is not None else None
                saved.append((n.name, tuple(v.shape), _hint(v.numel()) * v.element_size(), tag))
        SAVED.append(saved)
        return fw, bw

    wrapped._study = True
    cfx.min_cut_rematerialization_partition = wrapped


def _hint(x) -> int:
    if isinstance(x, int):
        return x
    return int(x.node.hint) if getattr(x.node, "hint", None) is not None else int(x.node.expr)


def saved_summary(saved) -> str:
    tot = sum(b for _, _, b, _ in saved)
    tagged = [s for s in saved if s[3] is not None]
    return (f"{len(saved)} saved values, {tot/2**20:.3f} MiB; {len(tagged)} from inside "
            f"checkpoint regions ({sum(s[2] for s in tagged)/2**20:.3f} MiB: "
            f"{sorted({str(s[3]).split('.')[-1] for s in tagged})})")
