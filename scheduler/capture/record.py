"""Recording one training step into a `CostGraph`.

One *recorded* step runs the traced graph node by node (`program.Program`) with

* a `StorageTracker` that sees every storage allocated and freed, attributed to the node
  running (forward) or to the node whose backward functions are running (backward, found with
  pre-hooks on the autograd nodes each forward node created);
* ``torch.autograd.graph.saved_tensors_hooks`` whose pack hook records which storage each node
  saves for backward, mapped back to the node that produced it (or a parameter/input);
* a `op_counter.OpCounter` that counts each op's FLOPs and bytes (for times without a real run).

Under autocast, the casts of parameters that autocast's cache holds through the step are
moved into the base (`autocast_cache`).

The same `Recorder` runs on real tensors and on fake ones (`fake.FakeStep`): the storages,
saved tensors and backward steps it records are the same. For a real profile
(`profile_traced`), ``repeats`` *timed* steps (after a warm-up) then give each node's forward
time and each backward step's time, as medians, and `measure` gives the unscheduled step's
peak and time; `checkpoint_costs` times what a checkpoint call and each tensor saved under it
cost on the device (once a process). The user's model is left as it was (buffers, gradients
and RNG state are restored).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..cost.rng import RNG_META
from ..ir.graph import BwdStep, CostGraph, Node, Saved, Storage, WrittenRead
from ..measurement.step import measure
from ..measurement.storage import StorageTracker
from .autocast_cache import (
    cache_meta,
    cast_source,
    clear_cached,
    mark_without_cached,
    saved_from_base,
    without_cached,
)
from .fake import rounded_bytes
from .fingerprint import shape_str, target_str
from .mutation import written_reads
from .op_counter import OpCounter
from .program import Program
from .randomness import may_draw_random, rng_state_bytes
from .roofline import DeviceSpec, local_spec, work_s
from .scratch import record_scratch
from .timing import GradFnIndex, checkpoint_costs, time_steps
from .state import preserved_state
from .trace import block_of, module_path

__all__ = ["Rec", "Recorder", "TensorMeta", "build_graph", "device_of", "profile_traced",
           "record_traced"]


def profile_traced(gm: fx.GraphModule, model: nn.Module, inputs: tuple[Any, ...], *,
                   repeats: int = 3, name: str = "model",
                   progress: Callable[[str], None] | None = None) -> CostGraph:
    """`profile` for a graph already traced with `trace` (so it is traced only once)."""
    return record_traced(gm, model, inputs, repeats=repeats, name=name, progress=progress)[0]


def record_traced(gm: fx.GraphModule, model: nn.Module, inputs: tuple[Any, ...], *,
                  repeats: int = 3, name: str = "model",
                  progress: Callable[[str], None] | None = None) -> tuple[CostGraph, Rec]:
    """`profile_traced`, also returning the `Rec` of the recorded step (its per-op counts,
    ``fwd_ops`` and ``step_ops``, are what `node_times.scaled_times` scales by)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    say = progress or (lambda _msg: None)
    prog = Program(gm)
    with preserved_state(model):
        say("recording memory and saved tensors")
        rec = Recorder(prog, model, inputs).run()
        say("measuring kernels' scratch")
        scratch = record_scratch(prog, model, inputs, rec, device_of(model, inputs))
        say(f"timing {repeats} steps")
        fwd_t, bwd_t, sac_t = time_steps(prog, model, inputs, repeats, rec.steps)
    say("measuring the unscheduled step")
    m = measure(model, inputs, loss_fn=prog.info.loss_fn, repeats=repeats)
    say("timing checkpoint calls")
    params = list(model.parameters())
    call_s, saved_s = checkpoint_costs(params[0].device if params else torch.device("cpu"))
    g = build_graph(prog, rec, fwd_t, bwd_t, m, name, inputs, sac_t)
    g.checkpoint_call_s, g.checkpoint_saved_s = call_s, saved_s
    g.meta["scratch"] = scratch
    return g, rec


@dataclass
class Rec:
    storages: dict[int, dict[str, Any]] = field(default_factory=dict)
    fwd_events: dict[str, list[tuple[str, int]]] = field(default_factory=lambda: defaultdict(list))
    views: dict[int, set[str]] = field(default_factory=lambda: defaultdict(set))
    saved: dict[str, dict[Any, Saved]] = field(default_factory=lambda: defaultdict(dict))
    # node -> how many of its forward events came before its last saved-tensor pack
    pack_mark: dict[str, int] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    grad_bytes_end: int = 0
    shapes: dict[str, str] = field(default_factory=dict)
    # node -> its output with every tensor leaf a `TensorMeta` (what `node_times` rebuilds)
    metas: dict[str, Any] = field(default_factory=dict)
    # (flops, bytes read and written, half precision) of each op of each node's forward and
    # of each backward step (`op_counter.OpCounter`)
    fwd_ops: dict[str, list[tuple[int, int, bool]]] = field(
        default_factory=lambda: defaultdict(list))
    step_ops: list[list[tuple[int, int, bool]]] = field(default_factory=list)
    param_bytes: int = 0
    buffer_bytes: int = 0
    input_bytes: int = 0
    peak_bytes: int = 0
    # storages autocast's cache held after the step (casts of parameters), and the parameter
    # each one is a cast of where it was found
    autocast_cached: set[int] = field(default_factory=set)
    cast_of: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TensorMeta:
    """What a recorded tensor was, without its data."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorMeta":
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad)


def _metas(value: Any) -> Any:
    # (a torch.Size stays one: pytree would make it a plain tuple)
    return pytree.tree_map(lambda x: TensorMeta.of(x) if isinstance(x, torch.Tensor) else x,
                           value, is_leaf=lambda x: isinstance(x, torch.Size))


class Recorder:
    """One instrumented step; fills a `Rec`. Runs the same on real and on fake tensors
    (`fake.FakeStep`); ``device`` is the device the storages' bytes are counted for."""

    def __init__(self, prog: Program, model: nn.Module, inputs: tuple[Any, ...],
                 device: torch.device | None = None):
        self.prog, self.model, self.inputs = prog, model, inputs
        self.rec = Rec()
        dev = device or device_of(model, inputs)
        self.size = lambda n: rounded_bytes(n, dev)
        self.tracker = StorageTracker(on_alloc=self._alloc, on_free=self._free, size=self.size)
        self.counter = OpCounter(self._count)
        self.phase = "f"
        self.cur: str | None = None
        self.key2sid: dict[int, int] = {}
        self.key2gid: dict[int, int] = {}
        self.gid_bytes: dict[int, int] = {}
        self.persistent: dict[int, str] = {}
        self.fns = GradFnIndex(self._enter_bwd)

    # -- tracker callbacks -----------------------------------------------------------------
    def _alloc(self, key: int, nbytes: int) -> None:
        if self.phase == "f":
            if self.cur is None:
                raise RuntimeError("storage allocated outside any node during profiling")
            sid = len(self.rec.storages)
            self.rec.storages[sid] = {"bytes": nbytes, "producer": self.cur,
                                      "output": False, "inner_free": False}
            self.rec.fwd_events[self.cur].append(("a", sid))
            self.key2sid[key] = sid
        else:
            gid = len(self.gid_bytes)
            self.gid_bytes[gid] = nbytes
            self.key2gid[key] = gid
            self.rec.steps[-1]["events"].append(("a", gid, nbytes))

    def _free(self, key: int, nbytes: int) -> None:
        sid = self.key2sid.pop(key, None)
        if sid is not None:
            st = self.rec.storages[sid]
            if self.phase == "f" and self.cur == st["producer"]:
                st["inner_free"] = True
                self.rec.fwd_events[self.cur].append(("f", sid))
            return
        gid = self.key2gid.pop(key, None)
        if gid is not None and self.rec.steps:
            self.rec.steps[-1]["events"].append(("f", gid, 0))

    def _enter_bwd(self, node: str) -> None:
        if self.rec.steps[-1]["node"] != node:
            self.rec.steps.append({"node": node, "events": []})
            self.rec.step_ops.append([])

    def _count(self, flops: int, nbytes: int, half: bool) -> None:
        if self.phase == "f":
            if self.cur is not None:
                self.rec.fwd_ops[self.cur].append((flops, nbytes, half))
        elif self.rec.step_ops:
            self.rec.step_ops[-1].append((flops, nbytes, half))

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.phase == "f" and self.cur is not None:
            # autograd packs an op's saved inputs before the op runs and its saved outputs
            # after: a replay that stops at this pack has run exactly the events before it
            self.rec.pack_mark[self.cur] = len(self.rec.fwd_events[self.cur])
            k = self.tracker.key(t)
            nbytes = self.size(t.untyped_storage().nbytes())
            if k in self.key2sid:
                sid = self.key2sid[k]
                s = Saved(self.rec.storages[sid]["producer"], sid, nbytes)
                self.rec.saved[self.cur][sid] = s
                source = cast_source(t, lambda v: self.persistent.get(self.tracker.key(v)))
                if source is not None:
                    self.rec.cast_of.setdefault(sid, source)
            else:
                src = self.persistent.get(k, "const")
                self.rec.saved[self.cur][src] = Saved(src, None, nbytes)
        return t

    # -- the step ------------------------------------------------------------------------
    def run(self) -> Rec:
        rec, tr = self.rec, self.tracker
        for p in self.model.parameters():
            p.grad = None
        for kind, named in (("param", self.model.named_parameters()),
                            ("buffer", self.model.named_buffers())):
            for n, t in named:
                if tr.register(t):
                    setattr(rec, f"{kind}_bytes", getattr(rec, f"{kind}_bytes")
                            + self.size(t.untyped_storage().nbytes()))
                self.persistent.setdefault(tr.key(t), f"{kind}:{n}")
        for i, t in enumerate(pytree.tree_leaves(self.inputs)):
            if isinstance(t, torch.Tensor):
                if tr.register(t):
                    rec.input_bytes += self.size(t.untyped_storage().nbytes())
                self.persistent.setdefault(tr.key(t), f"input:{i}")
        for t in self.prog.attrs.values():  # constants lifted by export
            if isinstance(t, torch.Tensor):
                tr.register(t)
        # (casts cached before the step would be made before it and never seen: the step
        # makes its own, in the node that first uses each parameter)
        torch.clear_autocast_cache()
        with tr, self.counter, torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            loss = self.prog.run(self.inputs, around=self._around)[1]
            self.cur = None
            self.phase = "b"
            rec.steps.append({"node": "", "events": []})
            rec.step_ops.append([])
            loss.backward()
            del loss
        rec.grad_bytes_end = sum(self.gid_bytes[g] for g in self.key2gid.values())
        # the step is over: storages that die later (gradients reset by `preserved_state`)
        # are not part of it, except those that die as autocast's cache is cleared: the
        # forward's storages (``key2sid``: those still alive) that only the cache held
        rec.autocast_cached = clear_cached(tr, self.key2sid)
        rec.peak_bytes = tr.peak_bytes
        self.fns.clear()
        return rec

    def _around(self, i: int, node: fx.Node, thunk: Callable[[], Any]) -> Any:
        self.cur = node.name
        out = thunk()
        leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        for t in leaves:
            sid = self.key2sid.get(self.tracker.key(t))
            if sid is None:
                continue
            if self.rec.storages[sid]["producer"] == node.name:
                self.rec.storages[sid]["output"] = True
            else:
                self.rec.views[sid].add(node.name)
        self.rec.shapes[node.name] = shape_str(out)
        self.rec.metas[node.name] = _metas(out)
        self.fns.claim(node.name, leaves)
        self.cur = None
        return out


def build_graph(prog: Program, rec: Rec, fwd_t: dict[str, float], bwd_t: list[float],
           m: Any | None, name: str, inputs: tuple[Any, ...],
           sac_t: dict[str, float] | None = None) -> CostGraph:
    info = prog.info
    order = [n.name for n in prog.nodes]
    last_node = order[-1]

    def last_user(value: str) -> str | None:
        p = prog.last_read.get(value)
        if p is None:
            return None
        return last_node if p >= len(order) else order[p]

    def where(n: str) -> int:
        return prog.pos[prog.by_name[n]]

    cached = rec.autocast_cached
    storages = {}
    for sid, s in rec.storages.items():
        if sid in cached:
            continue
        readers = [s["producer"]] + sorted(rec.views[sid], key=where)
        last = s["producer"]
        if s["output"]:
            for r in readers:
                u = last_user(r)
                if u is not None and where(u) > where(last):
                    last = u
        savers = tuple(sorted((n for n, d in rec.saved.items() if sid in d), key=where))
        views = tuple(readers[1:]) if s["output"] else ()
        storages[sid] = Storage(sid, s["bytes"], s["producer"], s["output"], s["inner_free"],
                                last, savers, views)
    # Node-by-node timing adds Python overhead per node and may run at a busier moment than
    # the whole-step measurement; scale forward and backward times so that they add up to
    # the measured unscheduled step, keeping their proportions (what the solvers compare).
    # (A fake profile has no measured step: its times are used as they are, and their sum is
    # the step's predicted time.)
    total = sum(fwd_t.values()) + sum(bwd_t)
    scale = m.step_s / total if m is not None and total > 0 and m.step_s > 0 else 1.0
    fwd_t = {k: v * scale for k, v in fwd_t.items()}
    bwd_t = [v * scale for v in bwd_t]
    sac_t = {k: v * scale for k, v in (sac_t or {}).items()}
    # backward time per node: sum of its steps
    bwd_by_node: dict[str, float] = defaultdict(float)
    for step, t in zip(rec.steps, bwd_t):
        bwd_by_node[step["node"]] += t
    compute = set(order)
    device = device_of(None, inputs)
    spec = local_spec(device)  # (weighs each node's ops for flop_share)
    fwd_events = {k: without_cached(v, cached) for k, v in rec.fwd_events.items()}
    nodes = []
    for n in prog.nodes:
        path = module_path(n)
        out_bytes = sum(rec.storages[e[1]]["bytes"] for e in rec.fwd_events.get(n.name, [])
                        if e[0] == "a" and rec.storages[e[1]]["output"])
        mark = mark_without_cached(rec.fwd_events.get(n.name, []), rec.pack_mark.get(n.name),
                                   cached)
        nodes.append(Node(
            name=n.name, op=n.op, target=target_str(n),
            inputs=tuple(dict.fromkeys(a.name for a in n.all_input_nodes if a.name in compute)),
            module_path=path, block=block_of(path), is_loss=n.name in info.loss_nodes,
            time_s=fwd_t.get(n.name, 0.0), bwd_time_s=bwd_by_node.get(n.name, 0.0),
            out_bytes=out_bytes,
            saved=saved_from_base(rec.saved.get(n.name, {}).values(), cached, rec.cast_of),
            shape=rec.shapes.get(n.name, ""), pack_mark=mark,
            sac_s=sac_t.get(n.name), flop_share=flop_share(spec, rec.fwd_ops.get(n.name, ())),
        ))
    bwd_t = list(bwd_t) + [0.0] * (len(rec.steps) - len(bwd_t))
    steps = [BwdStep(s["node"], t, tuple(s["events"])) for s, t in zip(rec.steps, bwd_t)]
    cast_bytes, cast_meta = cache_meta(rec.storages, cached)
    return CostGraph(
        name=name, nodes=nodes, storages=storages, fwd_events=fwd_events,
        bwd_steps=steps, param_bytes=rec.param_bytes, buffer_bytes=rec.buffer_bytes + cast_bytes,
        input_bytes=rec.input_bytes, grad_bytes=rec.grad_bytes_end,
        measured_peak_bytes=m.peak_bytes if m is not None else 0,
        measured_step_s=m.step_s if m is not None else sum(fwd_t.values()) + sum(bwd_t),
        written_reads=tuple(WrittenRead(*w) for w in written_reads(prog.gm, prog.nodes)),
        meta={"tracer": info.tracer, "torch": torch.__version__,
              "device": m.device if m is not None else "",
              "inputs": shape_str(inputs), "recorded_peak_bytes": rec.peak_bytes,
              "fallback_reason": info.fallback_reason,
              # what a checkpoint's RNG stash costs, and where it is needed
              RNG_META: {"state_bytes": rng_state_bytes(device),
                         "nodes": [n.name for n in prog.nodes if may_draw_random(n, prog.gm)]},
              # the step holds the loss until backward ends
              "loss_node": prog.loss_leaf.name if isinstance(prog.loss_leaf, fx.Node) else "",
              # (device type, dtype) of the autocast it was recorded under, then ["cache",
              # "off"] where its cache was off (`calls.autocast_state`)
              **({"autocast": [[d, str(t).removeprefix("torch.")] for d, t in info.autocast]}
                 if info.autocast else {}),
              **cast_meta},
    )


def flop_share(spec: DeviceSpec, ops: Any) -> float:
    """The share of ``ops``' roofline time on ``spec`` (`op_counter.OpCounter` rows: flops, bytes,
    half) in the ops that have FLOPs (matmuls, convolutions, attention); 0 for no work."""
    total = work_s(spec, list(ops))
    if total <= 0:
        return 0.0
    return min(1.0, work_s(spec, [op for op in ops if op[0] > 0]) / total)


def device_of(model: nn.Module | None, inputs: tuple[Any, ...]) -> torch.device:
    """The device of the model's first parameter, else of the first tensor among the inputs
    (``model`` None: the inputs only), else the CPU."""
    params = model.parameters() if model is not None else ()
    for t in (*params, *pytree.tree_leaves(inputs)):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")
