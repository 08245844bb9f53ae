"""Kernels' own scratch memory, measured in a real profile and recorded as storages.

The recording's `StorageTracker` sees every storage an op returns and every temporary its
decomposition allocates through the dispatcher. It does not see memory a kernel allocates and
frees inside itself: oneDNN's convolution scratch on CPU, cuDNN's workspaces on CUDA. The
allocator does. `record_scratch` runs one more step of the traced program under the profiler,
with memory events, a range around each forward node and a mark where each recorded backward
step begins (found by the same pre-hooks as the recording's steps). For each node and step it
compares how far the allocator rose above where the node or step began with how far the
recorded events rose; the difference, where positive, is that node's or step's scratch. A
kernel's scratch depends on its op and shapes, so nodes of one kind (the same op on the same
shapes) all get the largest measured among them: repeated blocks stay identical.

The scratch enters the recording as one storage (forward) or one gradient event pair
(backward), allocated and freed at the recorded events' high point within the node or step.
Every solver and the simulator then count it without knowing of it, in the unscheduled step
and in every replay that runs the node, and the simulated high point inside the node is the
allocator's. What was added is listed in ``CostGraph.meta["scratch"]``; `without_scratch`
takes it out again (the tensors alone, what the storage tracker measures).

A fake profile runs no kernel and so has no scratch (``meta["scratch"]`` is absent).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.profiler import record_function
from torch.utils import _pytree as pytree

from ..ir.graph import CostGraph
from ..measurement.compiled import memory_timeline
from .program import Program
from .timing import GradFnIndex
from .usercode import user_stacklevel

__all__ = ["ScratchWarning", "convolution_nodes", "kernel_rises", "record_scratch",
           "warn_fake_scratch", "without_scratch"]

_MARK = "scheduler.scratch."


class ScratchWarning(UserWarning):
    """Kernels' scratch is not in a profile: a real one could not measure it
    (`record_scratch`), or a fake one of a model with convolutions cannot see it
    (`warn_fake_scratch`)."""


#: the modules whose kernels allocate scratch inside themselves (oneDNN, cuDNN)
CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                nn.ConvTranspose3d)
#: a functional or ATen convolution among a graph's call targets
_CONV_TARGET = re.compile(r"conv(olution|_transpose[123]d|[123]d)\b")


def kernel_rises(prog: Program, model: nn.Module, inputs: tuple[Any, ...],
                 device: torch.device) -> tuple[dict[str, int], list[int], list[str]]:
    """One step of ``prog`` under the profiler: how far the allocator rose inside each forward
    node, and inside each backward step (a contiguous run of one node's backward functions,
    in the order they ran, named by their node; ``""`` before the first), above where it
    began. Gradients start at None and are left at None; the caller restores RNG and
    buffers."""
    steps: list[str] = []

    def enter(name: str) -> None:
        if steps[-1] != name:
            steps.append(name)
            with record_function(_MARK + "b"):
                pass

    index = GradFnIndex(enter)

    def around(i: int, node: fx.Node, thunk: Callable[[], Any]) -> Any:
        with record_function(_MARK + "f." + node.name):
            out = thunk()
        index.claim(node.name, [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out

    params = list(model.parameters())

    def step() -> None:
        loss = prog.run(inputs, around=around)[1]
        steps.append("")
        with record_function(_MARK + "b"):
            pass
        loss.backward()
        with record_function(_MARK + "end"):
            pass

    for p in params:  # (the recording's gradients, freed inside the step, were allocated
        p.grad = None  # before the profiler started: it warns of each such free)
    try:
        memory, marks = memory_timeline(step, device, ranges=_MARK)
    finally:
        index.clear()
        for p in params:
            p.grad = None
    # segments in time order: a forward node's range, or a backward step from its mark to the
    # next; they do not overlap, so one sweep assigns each memory event to its segment
    segments: list[tuple[int, int, str]] = []
    backward = [m for m in marks if not m[0].startswith(_MARK + "f.")]
    for name, start, end in marks:
        if name.startswith(_MARK + "f."):
            segments.append((start, end, name[len(_MARK) + 2:]))
    for (_, start, _), (_, nxt, _) in zip(backward, backward[1:]):
        segments.append((start, nxt - 1, ""))
    segments.sort()
    fwd: dict[str, int] = {}
    bwd: list[int] = []
    j = 0
    for start, end, name in segments:
        while j < len(memory) and memory[j][0] < start:
            j += 1
        cur = high = 0
        while j < len(memory) and memory[j][0] <= end:
            cur += memory[j][1]
            high = max(high, cur)
            j += 1
        if name:
            fwd[name] = high
        else:
            bwd.append(high)
    return fwd, bwd, steps


def _high_point(sizes: list[int]) -> tuple[int, int]:
    """(after how many events the running total of ``sizes`` is first at its highest, that
    total), starting from 0 before any."""
    at = cur = high = 0
    for i, b in enumerate(sizes):
        cur += b
        if cur > high:
            at, high = i + 1, cur
    return at, high


def record_scratch(prog: Program, model: nn.Module, inputs: tuple[Any, ...], rec: Any,
                   device: torch.device) -> dict[str, Any]:
    """Measure each node's and step's scratch (`kernel_rises`) and add it to ``rec`` (a
    `record.Rec` of the same step), keeping every recorded event's order and each node's
    replay mark. Nodes running the same op on the same shapes get the same scratch, the
    largest measured among them (and so do their steps with the same gradient events).
    Returns what was added, for ``CostGraph.meta["scratch"]``: bytes per node
    and per step, the storage and gradient ids it took, the nodes whose event lists it
    created; or, where the profiled step's backward did not run the recorded steps (so that
    its memory cannot be attributed), ``{"error": why}`` and nothing added."""
    try:
        fwd, bwd, names = kernel_rises(prog, model, inputs, device)
    except Exception as e:  # noqa: BLE001 - the profile stands without it, and says so
        return _unmeasured(f"the profiled step failed: {type(e).__name__}: {e}"[:300])
    recorded = [s["node"] for s in rec.steps]
    if names != recorded:
        return _unmeasured(f"the profiled step ran {len(names)} backward steps, the recording "
                           f"{len(recorded)}")
    # what each node's and step's kernels allocated beyond its recorded events, the same for
    # every node (step) of one kind: the largest over the nodes running the same op on the
    # same shapes (the steps of such nodes with the same gradient events). A kernel's scratch
    # is a function of its op and shapes; a node of one block and its twin in the next must
    # not differ by a few bytes of noise, or the blocks stop repeating for the block solvers
    def kind_of(name: str) -> tuple:
        if not name:
            return ("",)
        node = prog.by_name[name]
        return (node.op, str(node.target), rec.shapes.get(name, ""),
                tuple(rec.shapes.get(a.name, "") for a in node.all_input_nodes))

    gid_bytes = {g: b for s in rec.steps for k, g, b in s["events"] if k == "a"}
    fwd_at: dict[str, tuple[int, tuple]] = {}  # node -> (where its scratch goes, its kind)
    fwd_kind: dict[tuple, int] = {}
    for name, rise in fwd.items():
        events = rec.fwd_events.get(name, [])
        at, high = _high_point([rec.storages[s]["bytes"] * (1 if k == "a" else -1)
                                for k, s in events])
        key = kind_of(name)
        fwd_at[name] = (at, key)
        fwd_kind[key] = max(fwd_kind.get(key, 0), rise - high)
    bwd_at: list[tuple[int, tuple]] = []
    bwd_kind: dict[tuple, int] = {}
    for step, rise in zip(rec.steps, bwd):
        events = step["events"]
        sizes = [b if k == "a" else -gid_bytes[g] for k, g, b in events]
        at, high = _high_point(sizes)
        key = (kind_of(step["node"]), tuple(sizes))
        bwd_at.append((at, key))
        bwd_kind[key] = max(bwd_kind.get(key, 0), rise - high)
    out: dict[str, Any] = {"nodes": {}, "steps": {}, "storages": [], "grads": [],
                           "created": []}
    sid = max(rec.storages, default=-1) + 1
    for name, (at, key) in fwd_at.items():
        extra = fwd_kind[key]
        if extra <= 0:
            continue
        events = rec.fwd_events.get(name, [])
        if name not in rec.fwd_events:
            out["created"].append(name)
        rec.storages[sid] = {"bytes": extra, "producer": name, "output": False,
                             "inner_free": True}
        rec.fwd_events[name] = events[:at] + [("a", sid), ("f", sid)] + events[at:]
        mark = rec.pack_mark.get(name)
        if mark is not None and at <= mark:  # (at the mark: counted in a replay that stops)
            rec.pack_mark[name] = mark + 2
        out["nodes"][name] = extra
        out["storages"].append(sid)
        sid += 1
    gid = max(gid_bytes, default=-1) + 1
    for i, (step, (at, key)) in enumerate(zip(rec.steps, bwd_at)):
        events = step["events"]
        extra = bwd_kind[key]
        if extra <= 0:
            continue
        step["events"] = events[:at] + [("a", gid, extra), ("f", gid, 0)] + events[at:]
        out["steps"][str(i)] = extra
        out["grads"].append(gid)
        gid += 1
    out["bytes"] = max([*out["nodes"].values(), *out["steps"].values(), 0])
    return out


def _unmeasured(why: str) -> dict[str, Any]:
    warnings.warn(f"kernels' scratch was not measured ({why}): predicted peaks count the "
                  "tensors only, and a plan may measure over its budget by the allocator's "
                  "count; solve with headroom (e.g. headroom=0.1) for convolutional models",
                  ScratchWarning, stacklevel=user_stacklevel())
    return {"error": f"not measured: {why}"}


def convolution_nodes(model: nn.Module, g: CostGraph) -> list[str]:
    """The nodes of ``g`` that run a convolution: a convolution module of ``model`` (fx), or a
    functional or ATen one (export)."""
    convs = {path for path, m in model.named_modules() if isinstance(m, CONVOLUTIONS)}
    return [n.name for n in g.nodes
            if (n.op == "call_module" and n.module_path in convs)
            or (n.op != "call_module" and _CONV_TARGET.search(n.target))]


def warn_fake_scratch(model: nn.Module, g: CostGraph, device: torch.device) -> None:
    """Warn when a fake profile ``g`` of ``model`` has convolutions: their kernels' scratch
    (cuDNN's workspaces on CUDA, oneDNN's on CPU) is memory no fake tensor allocates, so
    its predicted peaks, and a plan's, are too low."""
    convs = convolution_nodes(model, g)
    if not convs:
        return
    kernels = "cuDNN's workspaces" if device.type == "cuda" else "oneDNN's scratch"
    first = g.node(convs[0])
    warnings.warn(
        f"{g.name} has {len(convs)} convolution(s) (first {first.module_path or first.name!r}),"
        " and a fake profile "
        f"cannot see the memory their kernels allocate inside themselves ({kernels} on "
        f"{device}): its predicted peaks count the tensors only, and a plan from it may "
        "exceed its budget (on an H200, a small U-Net's plans from a fake profile measured "
        "41-58% over their predicted peaks). Profile on the device you train on with "
        "mode='real' (it measures the scratch), or solve with headroom and check the plan "
        "with scheduler.measure", ScratchWarning, stacklevel=user_stacklevel())


def without_scratch(g: CostGraph) -> CostGraph:
    """``g`` without the scratch `record_scratch` added (its tensors alone: what
    `StorageTracker` measures, and what a fake profile records); ``g`` itself when it has
    none."""
    info = g.meta.get("scratch") or {}
    sids, gids = set(info.get("storages", ())), set(info.get("grads", ()))
    if not sids and not gids:
        return g
    created = set(info.get("created", ()))
    nodes = []
    for n in g.nodes:
        if n.pack_mark is not None:
            early = sum(1 for _, s in g.fwd_events.get(n.name, ())[:n.pack_mark] if s in sids)
            n = replace(n, pack_mark=n.pack_mark - early)
        nodes.append(n)
    fwd = {k: [e for e in v if e[1] not in sids] for k, v in g.fwd_events.items()
           if k not in created}
    steps = [replace(s, events=tuple(e for e in s.events if e[1] not in gids))
             for s in g.bwd_steps]
    return replace(g, nodes=nodes, fwd_events=fwd, bwd_steps=steps,
                   storages={k: v for k, v in g.storages.items() if k not in sids},
                   meta={k: v for k, v in g.meta.items() if k != "scratch"})
