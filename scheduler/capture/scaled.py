"""``times="scaled"``: node times from a real profile at a smaller size, scaled to the full one.

`scaled_times` profiles the step for real (`record.record_traced`, the same measurement a
real profile makes) at ``small_inputs``, by default the inputs with their batch halved until
the fake-predicted unscheduled peak fits the device's free memory (`small_inputs`). Each node's
forward time and each backward step's time is then scaled by the ratio of its work at the full
size to its work at the small size (`scale_time`), the work being its ops' roofline seconds
(`rebuild.work_s`: FLOPs and bytes, ``torch.utils.flop_counter``'s formulas, counted by the
recorder at both sizes). Both graphs must have the same nodes and backward steps, matched by
name; where the small one differs (the model branches on the batch size, export specialised a
shape) `FakeProfileError` says so and points to ``times="isolated"``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..cost.simulate import simulate
from ..ir.graph import CostGraph
from ..ir.schedule import Schedule
from ..quantities import format_bytes
from .calls import call_inputs
from ..measurement.storage import free_bytes
from .fake import FakeProfileError, FakeStep, specs_as_meta
from .program import Program
from .rebuild import (
    check_runnable,
    contiguous_stride,
    kept,
    local_spec,
    materialize,
    work_s,
)
from .record import Rec, Recorder, TensorMeta, build_graph, record_traced
from .roofline import DeviceSpec
from .state import preserved_state
from .trace import trace
from .usercode import UserCodeWarning

__all__ = ["HEADROOM", "scale_time", "scaled_times", "small_inputs", "small_profile"]

#: fraction of the device's free memory the default small size leaves unused
HEADROOM = 0.1


def scale_time(t_small: float, ops_small: list[tuple[int, int, bool]],
               ops_big: list[tuple[int, int, bool]], spec: DeviceSpec) -> float:
    """A node's (or backward step's) time at the full size from its measured time at the small
    size: ``c + (t_small - c) * work_s(ops_big) / work_s(ops_small)``, where
    ``c = min(t_small, len(ops_small) * spec.per_op_s)`` is the part that does not grow with
    the size (launch and dispatch, Python), kept as it was. With no work at the small size
    the ratio is undefined: ``t_small`` plus the full size's work (``t_small`` when both are
    0)."""
    c = min(t_small, len(ops_small) * spec.per_op_s)
    w_small, w_big = work_s(spec, ops_small), work_s(spec, ops_big)
    if w_small > 0:
        return c + (t_small - c) * (w_big / w_small)
    return t_small + w_big


def scaled_times(prog: Program, model: nn.Module, rec: Rec, inputs: tuple[Any, ...],
                 fake: FakeStep, repeats: int, small: Sequence[Any] | None,
                 loss_fn: Callable[[Any], torch.Tensor] | None, say: Callable[[str], None]
                 ) -> tuple[dict[str, float], list[float], dict[str, float]]:
    """Node times at the size of ``rec`` from a real profile at a smaller size (the module
    docstring says how).

    Args:
        prog, rec: the traced step and its fake recording at the full size.
        inputs: the full-size inputs (positional; real, meta tensors).
        fake: the fake step (its device is where the small profile runs: the model's).
        repeats: timed steps of the small profile.
        small: inputs at the small size, in the structure the model takes (tensors, meta
            tensors or ``(shape, dtype)`` specs); None: `small_inputs`.
        loss_fn: the loss (default: the one the full-size step was traced with).
        say: progress messages.

    Returns:
        ``(fwd, bwd, sac)`` as `node_times.isolated_times`: forward seconds per node, seconds
        per entry of ``rec.steps``, extra forward seconds under a selective-checkpoint policy
        per node (per-op dispatch overhead: kept as measured, not scaled).

    Raises:
        FakeProfileError: the model is not on ``fake.device`` (the small profile runs where
            the model is), no smaller batch fits, or the small graph differs from the full
            one (naming the first difference).
    """
    g_small, rec_small, _ = small_profile(prog, model, rec, inputs, fake, repeats, small,
                                           loss_fn, say)
    spec = local_spec(fake.device)
    fwd = {n.name: scale_time(n.time_s, rec_small.fwd_ops.get(n.name, []),
                              rec.fwd_ops.get(n.name, []), spec) for n in g_small.nodes}
    bwd = [scale_time(s.time_s, rec_small.step_ops[i], rec.step_ops[i], spec)
           for i, s in enumerate(g_small.bwd_steps)]
    sac = {n.name: n.sac_s for n in g_small.nodes if n.sac_s is not None}
    return fwd, bwd, sac


def small_profile(prog: Program, model: nn.Module, rec: Rec, inputs: tuple[Any, ...],
                  fake: FakeStep, repeats: int, small: Sequence[Any] | None,
                  loss_fn: Callable[[Any], torch.Tensor] | None, say: Callable[[str], None]
                  ) -> tuple[CostGraph, Rec, tuple[Any, ...]]:
    """The real profile at the small size that `scaled_times` scales: ``(graph, rec,
    small_inputs)``, checked to have ``prog``'s nodes and backward steps (`scaled_times`
    says what it raises)."""
    device = fake.device
    check_runnable(device, "scaled")
    params = [*model.parameters(), *model.buffers()]
    elsewhere = next((p for p in params if p.device != device and not (
        p.device.type == device.type and device.index is None)), None)
    if elsewhere is not None:
        raise FakeProfileError(
            f"times='scaled' profiles the step for real where the model is, but a parameter "
            f"or buffer of it is on {elsewhere.device} and the plan is for {device}; use "
            f"times='isolated' (each node alone on {device}) or times='roofline'")
    loss_fn = loss_fn or prog.info.loss_fn
    with kept(model, device):
        if small is None:
            small = small_inputs(model, inputs, fake, loss_fn, say)
        else:
            small = _materialized(call_inputs(model, specs_as_meta(small)), device)
        say(f"profiling at the small size ({_shapes(small)}) for real")
        with warnings.catch_warnings():  # the full-size trace has warned already
            warnings.simplefilter("ignore", UserCodeWarning)
            gm = trace(model, small, loss_fn=loss_fn)
        g, rec_small = record_traced(gm, model, small, repeats=repeats, name="small",
                                     progress=say)
    _check_same(prog, rec, Program(gm), rec_small)
    return g, rec_small, small


def small_inputs(model: nn.Module, inputs: tuple[Any, ...], fake: FakeStep,
                 loss_fn: Callable[[Any], torch.Tensor], say: Callable[[str], None]
                 ) -> tuple[Any, ...]:
    """``inputs`` at a smaller batch: the leading dimension of the first tensor input is the
    batch, and every tensor input whose dimension 0 has that size is cut to ``b``, for ``b``
    halved from the full batch until the unscheduled peak predicted under fake tensors fits
    the device's free memory less `HEADROOM` (``b`` halved once when that is not known).
    Real tensors keep their first ``b`` rows (copied); meta tensors become real ones
    (`rebuild.materialize`). Other inputs stay as they are.

    Raises:
        FakeProfileError: no tensor input has a batch dimension of 2 or more, or not even a
            batch of 1 is predicted to fit.
    """
    leaves, spec = pytree.tree_flatten(tuple(inputs))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.dim() >= 1]
    full = tensors[0].shape[0] if tensors else 0
    if full < 2:
        raise FakeProfileError(
            f"times='scaled' shrinks the batch (the leading dimension of the tensor inputs), "
            f"but it is {full}: pass small_inputs=... at a size that runs, or use "
            f"times='isolated'")

    def cut(b: int) -> tuple[Any, ...]:
        return pytree.tree_unflatten(
            [torch.empty((b, *t.shape[1:]), dtype=t.dtype, device="meta")
             if _batched(t, full) else t for t in leaves], spec)

    free = free_bytes(fake.device)
    usable = None if free is None else int(free * (1 - HEADROOM))
    b = full // 2
    while True:
        predicted = _fake_peak(model, cut(b), fake, loss_fn)
        if usable is None or predicted <= usable:
            break
        if b == 1:
            raise FakeProfileError(
                f"times='scaled': even at batch 1 the step is predicted to need "
                f"{format_bytes(predicted)}, more than the {format_bytes(usable)} free on "
                f"{fake.device}; use times='isolated' (each node alone) or times='roofline'")
        b //= 2
    say(f"small size: batch {b} of {full} (predicted peak {format_bytes(predicted)})")
    small = [(t[:b].detach().clone().requires_grad_(t.requires_grad) if t.device.type != "meta"
              else torch.empty((b, *t.shape[1:]), dtype=t.dtype, device="meta"))
             if _batched(t, full) else t for t in leaves]
    return _materialized(pytree.tree_unflatten(small, spec), fake.device)


def _batched(t: Any, full: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == full


def _fake_peak(model: nn.Module, inputs: tuple[Any, ...], fake: FakeStep,
               loss_fn: Callable[[Any], torch.Tensor]) -> int:
    """The unscheduled step's peak bytes at ``inputs``, recorded under fake tensors."""
    finputs = fake.inputs(inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserCodeWarning)
        gm = trace(model, finputs, loss_fn=loss_fn, fake=fake)
    prog = Program(gm)
    with preserved_state(model), fake.active(model, gm):
        rec = Recorder(prog, model, finputs, device=fake.device).run()
    g = build_graph(prog, rec, {}, [], None, "small", finputs)
    return simulate(g, Schedule.none(g)).peak_bytes


def _materialized(inputs: Any, device: torch.device) -> Any:
    """``inputs`` with every meta tensor made a real one on ``device`` (`materialize`, from a
    local generator: zeros for integers, small random floats)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    return pytree.tree_map(
        lambda x: materialize(TensorMeta(tuple(x.shape), contiguous_stride(tuple(x.shape)),
                                         x.dtype, x.requires_grad), device, gen)
        if isinstance(x, torch.Tensor) and x.device.type == "meta" else x, inputs)


def _shapes(inputs: Any) -> str:
    return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                     for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor))


def _check_same(prog: Program, rec: Rec, small: Program, rec_small: Rec) -> None:
    """Raise `FakeProfileError` naming the first node or backward step where the graph at the
    small size differs from the full one."""
    way_out = ("the model's graph depends on the batch size, so its times cannot be scaled "
               "from a smaller one; use times='isolated' (each node alone at the full size), "
               "or pass small_inputs=... at a size with the same graph")
    for what, big, got in (("node", [n.name for n in prog.nodes], [n.name for n in small.nodes]),
                           ("backward step", [s["node"] for s in rec.steps],
                            [s["node"] for s in rec_small.steps])):
        for i, (a, b) in enumerate(zip(big, got)):
            if a != b:
                raise FakeProfileError(f"times='scaled': {what} {i} is {a!r} at the full size "
                                       f"but {b!r} at the small size; {way_out}")
        if len(big) != len(got):
            extra = (big if len(big) > len(got) else got)[min(len(big), len(got))]
            raise FakeProfileError(f"times='scaled': the full size has {len(big)} {what}s, the "
                                   f"small size {len(got)} (the first unmatched: {extra!r}); "
                                   f"{way_out}")
