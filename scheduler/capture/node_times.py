"""Node times for a fake profile without running the whole step at its size.

A fake profile (`profile.profile_step`, ``mode="fake"``) records memory under fake tensors;
its node times come from one of:

* `isolated_times` (``times="isolated"``): each node of the graph run ALONE, for real, at the
  recorded size on the device planned for. A node's inputs are rebuilt from the shapes,
  strides and dtypes the fake step recorded for the nodes it reads (`record.TensorMeta`;
  `rebuild.materialize`: small random floats, integer and bool zeros); placeholders are the
  user's inputs and ``get_attr`` values the model's parameters and buffers (`Program.attrs`),
  rebuilt where they are meta or fake tensors and copied where they are on another device
  (`rebuild.on_device`; a ``call_module`` node whose module's state is elsewhere runs through
  ``torch.func.functional_call``). An input the node writes in place
  (`mutation.mutated_inputs`) is cloned before each run. Everything is freed after the node, so
  that only one node's inputs, outputs and gradients are alive at a time. Per node: the
  forward (median of ``repeats`` runs after a warm-up, the device synchronised around each
  timer), the forward under a selective-checkpoint policy's forward context
  (`timing.time_sac_forward` does the same for the whole step; the extra over the plain
  forward, clamped at 0), and the backward: ``torch.autograd.grad`` of its differentiable
  outputs with respect to its differentiable inputs and parameters, with random output
  gradients (``autograd.grad`` returns the gradients and never accumulates them into any
  ``.grad``), less the cost of the call itself (`grad_call_s`). A node's backward time is
  split over its recorded backward steps by their work (`split_backward`).
* `scaled.scaled_times` (``times="scaled"``, re-exported here): a real profile at a smaller
  batch, scaled by each node's work.

Random values come from a local ``torch.Generator``, and the model's state (buffers, ``.grad``,
the CPU and CUDA RNG states a dropout node draws from) is restored afterwards: profiling leaves
the user's process as it was.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.func import functional_call
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from ..measurement.storage import sync_device
from .fake import FakeProfileError, FakeStep
from .mutation import mutated_inputs
from .program import Program
from .rebuild import (
    check_runnable,
    contiguous_stride,
    kept,
    local_spec,
    materialize,
    on_device,
)
from .record import Rec, TensorMeta
from .roofline import DeviceSpec, roofline_s
from .scaled import scaled_times

__all__ = ["grad_call_s", "isolated_times", "scaled_times", "split_backward"]


def isolated_times(prog: Program, model: nn.Module, rec: Rec, inputs: tuple[Any, ...],
                   fake: FakeStep, repeats: int
                   ) -> tuple[dict[str, float], list[float], dict[str, float]]:
    """Each node of ``prog`` run alone at its recorded size on ``fake.device`` (the module
    docstring says how).

    Returns:
        ``(fwd, bwd, sac)``: the median forward seconds of each node; seconds per entry of
        ``rec.steps`` (each node's backward split over its recorded steps, `split_backward`;
        the seed step 0); each node's extra forward seconds under a selective-checkpoint
        policy (clamped at 0).

    Raises:
        FakeProfileError: the device cannot run here, or a node fails to run alone (naming the
            node and its op, with the way out: ``times="roofline"`` or ``mode="real"``).
    """
    device = fake.device
    check_runnable(device, "isolated")
    env0 = prog.inputs_env(inputs)
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    fwd: dict[str, float] = {}
    bwd_node: dict[str, float] = {}
    sac: dict[str, float] = {}
    with kept(model, device), torch.enable_grad():
        for node in prog.nodes:
            try:
                f, b, s = _time_node(prog, node, rec, env0, device, gen, repeats)
            except Exception as e:  # re-raised naming the node
                first = (str(e).strip().splitlines() or [""])[0][:300]
                raise FakeProfileError(
                    f"times='isolated' could not run node {node.name!r} ({node.op} "
                    f"{_target(node)}) alone at its recorded size on {device}: "
                    f"{type(e).__name__}: {first}; use times='roofline' (no run) or "
                    f"mode='real' (the whole step, on inputs that fit)") from e
            fwd[node.name], bwd_node[node.name], sac[node.name] = f, b, s
    return fwd, split_backward(rec, bwd_node, local_spec(device)), sac


#: `grad_call_s` per (device, torch threads), measured once a process
_GRAD_CALL: dict[tuple[str, int], float] = {}


def grad_call_s(device: torch.device) -> float:
    """What one ``torch.autograd.grad`` call costs on ``device`` beyond the backward functions
    it runs (setting up the graph task; about 15 us on a CPU): the median time of a call that
    runs none (the gradient of a tensor with respect to itself). Each node's backward is one
    such call where the whole step's is a single one, so it is taken off each node's time.
    Measured once a process for each device and number of torch threads."""
    key = (str(device), torch.get_num_threads())
    if key not in _GRAD_CALL:
        x = torch.zeros(4, device=device, requires_grad=True)
        g = torch.zeros(4, device=device)
        samples = []
        for _ in range(101):
            sync_device(device)
            t0 = time.perf_counter()
            torch.autograd.grad([x], [x], [g])
            sync_device(device)
            samples.append(time.perf_counter() - t0)
        _GRAD_CALL[key] = statistics.median(samples[1:])
    return _GRAD_CALL[key]


def split_backward(rec: Rec, bwd_node: dict[str, float], spec: DeviceSpec) -> list[float]:
    """Seconds per entry of ``rec.steps``: each node's backward seconds ``bwd_node[name]``
    shared among the recorded steps of that node in proportion to their roofline seconds on
    ``spec`` (``rec.step_ops``; equally when all are 0). The seed step (node "") gets 0."""
    by_node: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(rec.steps):
        if s["node"]:
            by_node[s["node"]].append(i)
    out = [0.0] * len(rec.steps)
    for name, idx in by_node.items():
        total = bwd_node.get(name, 0.0)
        w = [roofline_s(spec, rec.step_ops[i]) if i < len(rec.step_ops) else 0.0 for i in idx]
        ws = sum(w)
        for i, wi in zip(idx, w):
            out[i] = total * (wi / ws if ws > 0 else 1.0 / len(idx))
    return out


def _target(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", None) or str(t)


def _input_value(a: fx.Node, rec: Rec, env0: dict[str, Any], device: torch.device,
                 gen: torch.Generator) -> Any:
    """What node input ``a`` holds, for real on ``device``: a placeholder's or attribute's
    own value (`on_device`), or a compute node's recorded output rebuilt (`materialize`)."""
    if a.op in ("placeholder", "get_attr"):
        value = env0[a.name]
        return on_device(value, device, gen) if isinstance(value, torch.Tensor) else value
    return pytree.tree_map(lambda x: materialize(x, device, gen) if isinstance(x, TensorMeta)
                           else x, rec.metas[a.name],
                           is_leaf=lambda x: isinstance(x, torch.Size))


def _caller(prog: Program, node: fx.Node, device: torch.device, gen: torch.Generator
            ) -> tuple[Callable[[dict[str, Any]], Any], list[torch.Tensor]]:
    """``(run, params)``: ``run(env)`` evaluates ``node`` against ``env`` as `Program` does;
    ``params`` are the tensors requiring grad that a ``call_module`` node reads from its
    module (its parameters). A module whose parameters or buffers are not real tensors on
    ``device`` runs through ``torch.func.functional_call`` with copies there."""
    if node.op != "call_module":
        return (lambda env: prog.run_node(node, env)), []
    sub = prog.gm.get_submodule(node.target)
    state = dict(sub.named_parameters())
    state.update(sub.named_buffers())
    moved = {k: on_device(t, device, gen) for k, t in state.items()}
    params = [t for t in moved.values() if t.requires_grad]
    if all(moved[k] is state[k] for k in state):
        return (lambda env: prog.run_node(node, env)), params

    def run(env: dict[str, Any]) -> Any:
        args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: env[a.name])
        return functional_call(sub, moved, tuple(args), dict(kwargs))

    return run, params


def _clone(value: Any) -> Any:
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, value)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _time_node(prog: Program, node: fx.Node, rec: Rec, env0: dict[str, Any],
               device: torch.device, gen: torch.Generator, repeats: int
               ) -> tuple[float, float, float]:
    """(forward, backward, selective-checkpoint extra) median seconds of ``node`` alone."""
    values = {a.name: _input_value(a, rec, env0, device, gen) for a in node.all_input_nodes}
    run, params = _caller(prog, node, device, gen)
    written = {a.name for a in mutated_inputs(node)}
    wrt = list({id(t): t for t in [*(t for t in pytree.tree_leaves(values)
                                      if isinstance(t, torch.Tensor) and t.requires_grad),
                                    *params]}.values())

    def fresh() -> dict[str, Any]:
        # an input the node writes in place is cloned before each run (outside the timers);
        # gradients still flow to the rebuilt leaf through the clone
        return {k: _clone(v) if k in written else v for k, v in values.items()}

    def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
        sync_device(device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync_device(device)
        return out, time.perf_counter() - t0

    f_s: list[float] = []
    b_s: list[float] = []
    s_s: list[float] = []
    for r in range(repeats + 1):  # the first run warms up
        env = fresh()
        out, tf = timed(run, env)
        outs = [t for t in pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.requires_grad]
        tb = 0.0
        outs_seen = bool(outs and wrt)
        if outs_seen:
            grads = [materialize(TensorMeta(tuple(t.shape), contiguous_stride(tuple(t.shape)),
                                            t.dtype, False), device, gen) for t in outs]
            got, tb = timed(torch.autograd.grad, outs, wrt, grads, allow_unused=True)
            del grads, got
        del out, outs, env
        if r:
            f_s.append(tf)
            b_s.append(tb)
    for r in range(repeats + 1):
        env = fresh()
        fwd_ctx, _ = create_selective_checkpoint_contexts(_policy)
        with fwd_ctx:
            out, ts = timed(run, env)
        del out, env
        if r:
            s_s.append(ts)
    f = statistics.median(f_s)
    b = max(0.0, statistics.median(b_s) - grad_call_s(device)) if outs_seen else 0.0
    return f, b, max(0.0, statistics.median(s_s) - f)

