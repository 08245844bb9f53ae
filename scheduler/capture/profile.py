"""Profiling: run one traced training step under trackers and record a `CostGraph`.

One *recorded* step runs the traced graph node by node (`program.Program`) with

* a `StorageTracker` that sees every storage allocated and freed, attributed to the node
  running (forward) or to the node whose backward functions are running (backward, found with
  pre-hooks on the autograd nodes each forward node created);
* ``torch.autograd.graph.saved_tensors_hooks`` whose pack hook records which storage each node
  saves for backward, mapped back to the node that produced it (or a parameter/input).

Then ``repeats`` *timed* steps (after a warm-up) give each node's forward time and each
backward step's time, as medians, and `measure` gives the unscheduled step's peak and time;
`checkpoint_costs` times what a checkpoint call and each tensor saved under it cost on the
device (once a process).
The user's model is left as it was (buffers, gradients and RNG state are restored).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..ir.graph import BwdStep, CostGraph, Node, Saved, Storage, structure_fingerprint
from ..measurement.step import measure
from ..measurement.storage import StorageTracker
from .program import Program
from .timing import GradFnIndex, checkpoint_costs, time_steps
from ..cost.simulate import simulate
from ..ir.schedule import Schedule
from ..units import format_bytes
from .calls import call_inputs
from .fake import (
    FakeStep,
    OpCounter,
    fake_failure,
    free_bytes,
    is_spec,
    needs_fake,
    rounded_bytes,
    spec_of,
)
from .roofline import device_spec as device_spec_of
from .roofline import roofline_s
from .trace import TraceError, block_of, module_path, preserved_state, trace

__all__ = ["MODES", "TIMES", "TensorMeta", "check_profile_options", "profile", "profile_step",
           "profile_traced", "traced_fingerprint"]


#: how a profile's memory is recorded (`profile`'s ``mode``)
MODES = ("auto", "real", "fake")
#: where a profile's node times come from (`profile`'s ``times``)
TIMES = ("measured", "isolated", "scaled", "roofline")


def profile(model: nn.Module, example_inputs: Sequence[Any], *,
            loss_fn: Callable[[Any], torch.Tensor] | None = None, repeats: int = 3,
            name: str | None = None,
            progress: Callable[[str], None] | None = None, mode: str = "auto",
            times: str | None = None, device: str | torch.device | None = None,
            device_spec: Any = None, small_inputs: Sequence[Any] | None = None,
            headroom: float = 0.1) -> CostGraph:
    """Trace ``model`` and profile one forward + backward step into a `CostGraph`.

    Args:
        model: the model (not modified).
        example_inputs: positional inputs with the shapes to plan for, or a mapping of
            keyword inputs (`calls.call_inputs`). Under ``mode="fake"`` an input may also be
            a tensor on the ``meta`` device or a ``(shape, dtype)`` spec.
        loss_fn: ``loss_fn(output) -> scalar``; default: `trace.default_loss_recipe`.
        repeats: timed steps per measurement (medians are kept), after one warm-up.
        name: the graph's name (default: the model's class name).
        progress: called with a short message as each phase starts.
        mode: how memory is recorded. ``"real"`` runs the step (it must fit the device);
            ``"fake"`` runs it under fake tensors (`capture.fake`), allocating nothing of
            activation size; ``"auto"`` (default) records it fake first, then for real only
            if its predicted peak fits the device's free memory less ``headroom``. The graph's
            ``meta["profile"]`` says which ran and why.
        times: where node times come from: ``"measured"`` (the real step, timed; the only
            choice for ``mode="real"``), ``"isolated"`` (default for a fake profile: each node
            run alone at full size, `node_times.isolated_times`), ``"scaled"`` (a real
            profile at ``small_inputs``, scaled by each node's FLOPs and bytes) or
            ``"roofline"`` (no run: ``device_spec``'s peak rates). Recorded in
            ``meta["times"]``.
        device: the device planned for (default: the model's); under ``mode="fake"`` it may
            be one the model is not on (``"cuda"`` for a model on the CPU).
        device_spec: for ``times="roofline"``: a `roofline.DeviceSpec` or a name in
            `roofline.DEVICE_SPECS` (``"h100"``).
        small_inputs: for ``times="scaled"``: inputs of the same structure at a size that
            runs (default: the batch dimension shrunk until the step fits).
        headroom: ``mode="auto"``: fraction of free memory held back.

    Returns:
        The `CostGraph`: nodes in execution order with bytes, saved tensors and times.

    Raises:
        TraceError: the model cannot be traced (see `trace`).
        FakeProfileError: ``mode="fake"`` on a step fake tensors cannot run (an op with
            data-dependent output shapes), or for a device this build cannot fake.
        ValueError: a bad ``mode``, ``times``, ``device_spec`` or ``headroom``.
    """
    return profile_step(model, example_inputs, loss_fn=loss_fn, repeats=repeats, name=name,
                        progress=progress, mode=mode, times=times, device=device,
                        device_spec=device_spec, small_inputs=small_inputs,
                        headroom=headroom)[1]


def check_profile_options(mode: str, times: str | None, device_spec: Any = None,
                          headroom: float = 0.1) -> str | None:
    """Validate `profile`'s options before anything runs; returns ``times`` resolved for a
    fake profile (None for a real one)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if times is not None and times not in TIMES:
        raise ValueError(f"times must be one of {', '.join(map(repr, TIMES))}, got {times!r}")
    if mode == "real" and times not in (None, "measured"):
        raise ValueError(f"times={times!r} is for a fake profile (mode='fake' or 'auto'); a "
                         f"real profile measures its times (times='measured')")
    if mode == "fake" and times == "measured":
        raise ValueError("times='measured' needs the real step (mode='real'); a fake profile "
                         "takes times='isolated', 'scaled' or 'roofline'")
    if not (isinstance(headroom, (int, float)) and 0 <= headroom < 1):
        raise ValueError(f"headroom must be a fraction in [0, 1), got {headroom!r}")
    fake_times = times if times not in (None, "measured") else "isolated"
    if fake_times == "roofline":
        device_spec_of(device_spec)
    return fake_times


def profile_step(model: nn.Module, example_inputs: Any, *,
                 loss_fn: Callable[[Any], torch.Tensor] | None = None, repeats: int = 3,
                 name: str | None = None, progress: Callable[[str], None] | None = None,
                 mode: str = "auto", times: str | None = None,
                 device: str | torch.device | None = None, device_spec: Any = None,
                 small_inputs: Sequence[Any] | None = None, headroom: float = 0.1
                 ) -> tuple[fx.GraphModule, CostGraph, tuple[Any, ...]]:
    """`profile`, returning the traced graph, the `CostGraph` and the positional inputs
    (what `solve` rewrites with)."""
    fake_times = check_profile_options(mode, times, device_spec, headroom)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    inputs = call_inputs(model, _specs_as_meta(example_inputs))
    say = progress or (lambda _msg: None)
    name = name or type(model).__name__
    why_fake = needs_fake(inputs)
    if mode == "real" and why_fake:
        raise ValueError(f"mode='real' runs the step, but {why_fake}; give real tensors, or "
                         f"profile with mode='fake'")
    if mode == "real" or (mode == "auto" and times == "measured"):
        say("tracing")
        gm = trace(model, inputs, loss_fn=loss_fn)
        g = profile_traced(gm, model, inputs, repeats=repeats, name=name, progress=say)
        g.meta["profile"] = {"mode": "real", "why": f"mode={mode!r}"}
        return gm, g, inputs
    fake = FakeStep(model, device)
    say("tracing (fake tensors)")
    finputs = fake.inputs(inputs)
    try:
        gm = trace(model, finputs, loss_fn=loss_fn, fake=fake)
        say("recording memory and saved tensors (fake tensors)")
        prog = Program(gm)
        with preserved_state(model), fake.active(model, gm):
            rec = _Recorder(prog, model, finputs, device=fake.device).run()
    except Exception as e:  # noqa: BLE001 - auto falls back to the real step
        failure = fake_failure(e)
        if mode == "fake" or why_fake:
            if failure is not None and failure is not e:
                raise failure from e
            raise
        if failure is None and isinstance(e, TraceError):
            raise
        say("fake tensors cannot run this step: profiling it for real")
        gm = trace(model, inputs, loss_fn=loss_fn)
        g = profile_traced(gm, model, inputs, repeats=repeats, name=name, progress=say)
        g.meta["profile"] = {"mode": "real", "why": f"fake tensors failed: "
                             f"{(failure or e).args[0] if (failure or e).args else e!r}"[:300]}
        return gm, g, inputs
    own_device = _device_of(model, inputs)
    if mode == "auto" and not why_fake and fake.device == own_device:
        memory = _build(prog, rec, {}, [], None, name, finputs)
        predicted = simulate(memory, Schedule.none(memory)).peak_bytes
        free = free_bytes(fake.device)
        usable = None if free is None else int(free * (1 - headroom))
        if usable is not None and predicted <= usable:
            g = profile_traced(gm, model, inputs, repeats=repeats, name=name, progress=say)
            g.meta["profile"] = {
                "mode": "real", "why": f"the predicted unscheduled peak "
                f"{format_bytes(predicted)} fits {format_bytes(usable)} free on {fake.device} "
                f"(less {headroom:.0%} headroom)"}
            return gm, g, inputs
        why = (f"the predicted unscheduled peak {format_bytes(predicted)} does not fit "
               f"{format_bytes(usable)} free on {fake.device} (less {headroom:.0%} headroom)"
               if usable is not None else f"the free memory of {fake.device} is not known")
    elif mode == "auto":
        why = why_fake or f"planning for {fake.device}, not the model's {own_device}"
    else:
        why = "mode='fake'"
    say(f"node times ({fake_times})")
    fwd_t, bwd_t, sac_t = _fake_times(fake_times, prog, model, rec, inputs, fake, repeats,
                                       device_spec, small_inputs, loss_fn, say)
    g = _build(prog, rec, fwd_t, bwd_t, None, name, finputs, sac_t)
    g.meta["device"] = str(fake.device)
    g.meta["profile"] = {"mode": "fake", "why": why}
    g.meta["times"] = fake_times
    if fake.device.type == own_device.type and fake.device.type != "meta":
        g.checkpoint_call_s, g.checkpoint_saved_s = checkpoint_costs(fake.device)
    return gm, g, inputs


def _specs_as_meta(example_inputs: Any) -> Any:
    """``(shape, dtype)`` specs among the top-level inputs (or a mapping's values) as meta
    tensors."""
    if isinstance(example_inputs, Mapping):
        return {k: spec_of(v) for k, v in example_inputs.items()}
    if is_spec(example_inputs):
        return (spec_of(example_inputs),)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(spec_of(x) for x in example_inputs)
    return example_inputs


def _fake_times(kind: str, prog: Program, model: nn.Module, rec: "_Rec",
                inputs: tuple[Any, ...], fake: FakeStep, repeats: int, device_spec: Any,
                small_inputs: Sequence[Any] | None, loss_fn: Any, say: Callable[[str], None]
                ) -> tuple[dict[str, float], list[float], dict[str, float]]:
    if kind == "roofline":
        spec = device_spec_of(device_spec)
        fwd = {n: roofline_s(spec, ops) for n, ops in rec.fwd_ops.items()}
        return fwd, [roofline_s(spec, ops) for ops in rec.step_ops], {}
    from . import node_times
    if kind == "isolated":
        return node_times.isolated_times(prog, model, rec, inputs, fake, repeats)
    return node_times.scaled_times(prog, model, rec, inputs, fake, repeats, small_inputs,
                                   loss_fn, say)


def profile_traced(gm: fx.GraphModule, model: nn.Module, inputs: tuple[Any, ...], *,
                   repeats: int = 3, name: str = "model",
                   progress: Callable[[str], None] | None = None) -> CostGraph:
    """`profile` for a graph already traced with `trace` (so it is traced only once)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    say = progress or (lambda _msg: None)
    prog = Program(gm)
    with preserved_state(model):
        say("recording memory and saved tensors")
        rec = _Recorder(prog, model, inputs).run()
        say(f"timing {repeats} steps")
        fwd_t, bwd_t, sac_t = time_steps(prog, model, inputs, repeats, rec.steps)
    say("measuring the unscheduled step")
    m = measure(model, inputs, loss_fn=prog.info.loss_fn, repeats=repeats)
    say("timing checkpoint calls")
    params = list(model.parameters())
    call_s, saved_s = checkpoint_costs(params[0].device if params else torch.device("cpu"))
    g = _build(prog, rec, fwd_t, bwd_t, m, name, inputs, sac_t)
    g.checkpoint_call_s, g.checkpoint_saved_s = call_s, saved_s
    return g


@dataclass
class _Rec:
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
    # of each backward step (`fake.OpCounter`)
    fwd_ops: dict[str, list[tuple[int, int, bool]]] = field(
        default_factory=lambda: defaultdict(list))
    step_ops: list[list[tuple[int, int, bool]]] = field(default_factory=list)
    param_bytes: int = 0
    buffer_bytes: int = 0
    input_bytes: int = 0
    peak_bytes: int = 0


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
    return pytree.tree_map(lambda x: TensorMeta.of(x) if isinstance(x, torch.Tensor) else x,
                           value)


class _Recorder:
    """One instrumented step; fills a `_Rec`. Runs the same on real and on fake tensors
    (`fake.FakeStep`); ``device`` is the device the storages' bytes are counted for."""

    def __init__(self, prog: Program, model: nn.Module, inputs: tuple[Any, ...],
                 device: torch.device | None = None):
        self.prog, self.model, self.inputs = prog, model, inputs
        self.rec = _Rec()
        dev = device or _device_of(model, inputs)
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
            else:
                src = self.persistent.get(k, "const")
                self.rec.saved[self.cur][src] = Saved(src, None, nbytes)
        return t

    # -- the step ------------------------------------------------------------------------
    def run(self) -> _Rec:
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
        # are not part of it
        tr.on_alloc = tr.on_free = None
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
        self.rec.shapes[node.name] = _shape_str(out)
        self.rec.metas[node.name] = _metas(out)
        self.fns.claim(node.name, leaves)
        self.cur = None
        return out


def _build(prog: Program, rec: _Rec, fwd_t: dict[str, float], bwd_t: list[float],
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

    storages = {}
    for sid, s in rec.storages.items():
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
    nodes = []
    for n in prog.nodes:
        path = module_path(n)
        out_bytes = sum(rec.storages[e[1]]["bytes"] for e in rec.fwd_events.get(n.name, [])
                        if e[0] == "a" and rec.storages[e[1]]["output"])
        nodes.append(Node(
            name=n.name, op=n.op, target=_target_str(n),
            inputs=tuple(dict.fromkeys(a.name for a in n.all_input_nodes if a.name in compute)),
            module_path=path, block=block_of(path), is_loss=n.name in info.loss_nodes,
            time_s=fwd_t.get(n.name, 0.0), bwd_time_s=bwd_by_node.get(n.name, 0.0),
            out_bytes=out_bytes, saved=tuple(rec.saved.get(n.name, {}).values()),
            shape=rec.shapes.get(n.name, ""), pack_mark=rec.pack_mark.get(n.name),
            sac_s=sac_t.get(n.name),
        ))
    bwd_t = list(bwd_t) + [0.0] * (len(rec.steps) - len(bwd_t))
    steps = [BwdStep(s["node"], t, tuple(s["events"])) for s, t in zip(rec.steps, bwd_t)]
    return CostGraph(
        name=name, nodes=nodes, storages=storages,
        fwd_events={k: list(v) for k, v in rec.fwd_events.items()},
        bwd_steps=steps, param_bytes=rec.param_bytes, buffer_bytes=rec.buffer_bytes,
        input_bytes=rec.input_bytes, grad_bytes=rec.grad_bytes_end,
        measured_peak_bytes=m.peak_bytes if m is not None else 0,
        measured_step_s=m.step_s if m is not None else sum(fwd_t.values()) + sum(bwd_t),
        meta={"tracer": info.tracer, "torch": torch.__version__,
              "device": m.device if m is not None else "",
              "inputs": _shape_str(inputs), "recorded_peak_bytes": rec.peak_bytes,
              "fallback_reason": info.fallback_reason,
              # the step holds the loss until backward ends
              "loss_node": prog.loss_leaf.name if isinstance(prog.loss_leaf, fx.Node) else ""},
    )


def _device_of(model: nn.Module, inputs: tuple[Any, ...]) -> torch.device:
    for t in (*model.parameters(), *pytree.tree_leaves(inputs)):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def _target_str(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, str):
        return t
    if isinstance(t, torch._ops.OpOverload):
        return str(t)
    return getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or str(t)


def _shape_str(value: Any) -> str:
    parts = []
    for t in pytree.tree_leaves(value):
        if isinstance(t, torch.Tensor):
            dt = str(t.dtype).removeprefix("torch.")
            parts.append(f"{dt}[{','.join(str(d) for d in t.shape)}]")
        else:
            parts.append(type(t).__name__)
    return " ".join(parts)


def traced_fingerprint(gm: fx.GraphModule, model: nn.Module, inputs: tuple[Any, ...]) -> str:
    """The `CostGraph.fingerprint` that profiling ``gm`` would give, from one no-grad forward
    (no profiling): used to check that a saved schedule fits a model."""
    prog = Program(gm)
    shapes: dict[str, str] = {}

    def around(i: int, node: fx.Node, thunk: Callable[[], Any]) -> Any:
        out = thunk()
        shapes[node.name] = _shape_str(out)
        return out

    with preserved_state(model), torch.no_grad():
        prog.run(inputs, around=around)
    compute = {n.name for n in prog.nodes}
    return structure_fingerprint(
        (n.name, n.op, _target_str(n),
         tuple(dict.fromkeys(a.name for a in n.all_input_nodes if a.name in compute)),
         shapes[n.name], n.name in prog.info.loss_nodes)
        for n in prog.nodes)
