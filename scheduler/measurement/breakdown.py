"""What a real training step's peak is made of: parameters, gradients, optimizer state,
activations and the rest (`measure_training_step`), for `workflows.advise`."""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..capture.calls import call_inputs
from ..capture.state import preserved_state
from ..capture.trace import default_loss_recipe
from .storage import StorageTracker, sync_device

__all__ = ["OPTIMIZERS", "PARTS", "StepBreakdown", "get_optimizer", "measure_training_step"]


def _sgd_momentum(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


#: Optimizers `measure_training_step` can run by name: ``name -> (params -> Optimizer)``.
#: Hyper-parameters do not change memory, so library defaults (and a small learning rate) do.
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
    "sgd_momentum": _sgd_momentum,
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-3),
}


def get_optimizer(name: str) -> Callable[[Any], torch.optim.Optimizer]:
    """The optimizer constructor called ``name`` in `OPTIMIZERS`.

    Raises:
        ValueError: an unknown name; the message lists the valid ones.
    """
    if isinstance(name, str) and name.lower() in OPTIMIZERS:
        return OPTIMIZERS[name.lower()]
    raise ValueError(f"unknown optimizer {name!r}; valid optimizers: {', '.join(OPTIMIZERS)} "
                     "(or pass optimizer_state_bytes=... with the state's size)")


#: Categories of `StepBreakdown`, in the order they are reported.
PARTS = ("parameters", "gradients", "optimizer_state", "activations", "other")


@dataclass(frozen=True)
class StepBreakdown:
    """Where the peak of one steady-state training step goes (see `measure_training_step`).

    The parts are the bytes alive at the moment of the peak and add up to ``peak_bytes``:
    ``parameters`` (the model's parameters), ``gradients`` (parameters' ``.grad``),
    ``optimizer_state`` (e.g. AdamW's two moments and step counters), ``activations``
    (tensors autograd saved for backward and still alive) and ``other`` (inputs, buffers, op
    temporaries, outputs not saved, the loss, optimizer-step temporaries).
    """

    peak_bytes: int
    parts: dict[str, int]  # PARTS -> bytes at the peak
    phase: str  # where the peak falls: "forward", "backward" or "optimizer step"
    forward_backward_peak_bytes: int  # the peak over forward and backward (state included)
    optimizer_step_peak_bytes: int  # the peak during optimizer.step(); 0 when not run
    step_s: float  # median forward + backward time
    optimizer_step_s: float  # median optimizer.step() time; 0.0 when not run
    optimizer: str  # the optimizer's name, or "given" for state given in bytes
    device: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Attribution:
    """A `StorageTracker`'s allocations with serial numbers and an event log, so that the live
    bytes of each category at the peak can be recovered once every storage's role is known."""

    def __init__(self) -> None:
        self.serial_of: dict[int, int] = {}  # live storage key -> serial
        self.bytes: list[int] = []  # serial -> bytes
        self.events: list[int] = []  # +serial+1 allocated, -(serial+1) freed
        self.saved: set[int] = set()
        self.tracker = StorageTracker(on_alloc=self._alloc, on_free=self._free)

    def _alloc(self, key: int, nbytes: int) -> None:
        self.serial_of[key] = len(self.bytes)
        self.bytes.append(nbytes)
        self.events.append(len(self.bytes))

    def _free(self, key: int, nbytes: int) -> None:
        serial = self.serial_of.pop(key, None)
        if serial is not None:
            self.events.append(-(serial + 1))

    def serial(self, t: torch.Tensor) -> int | None:
        return self.serial_of.get(self.tracker.key(t))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        s = self.serial(t)
        if s is not None:
            self.saved.add(s)
        return t

    def at_peak(self, category: dict[int, str]) -> tuple[int, dict[str, int], int]:
        """(index of the first peak event, bytes per category alive then, live total)."""
        live: dict[str, int] = defaultdict(int)
        total = best = 0
        best_at, best_live = -1, {}
        for i, e in enumerate(self.events):
            s = abs(e) - 1
            b = self.bytes[s] if e > 0 else -self.bytes[s]
            live[category.get(s, "other")] += b
            total += b
            if total > best:
                best, best_at, best_live = total, i, dict(live)
        return best_at, best_live, best


def measure_training_step(
        model: nn.Module, example_inputs: Sequence[Any], *,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        optimizer: str | Callable[[Any], torch.optim.Optimizer] = "adamw",
        optimizer_state_bytes: int | None = None, repeats: int = 3) -> StepBreakdown:
    """Measure the peak of a real, steady-state training step and what it is made of.

    A step is ``zero_grad(set_to_none=True)``, forward, loss, backward, ``optimizer.step()``.
    The optimizer creates its state during its first step, so from the second step on the
    state is alive through forward and backward: the second step is the one measured (on
    every device by live-storage tracking, as on CPU in `measure`; allocator caching and
    fragmentation are not included). Timed steps follow.

    The model is not modified: the steps run on a ``copy.deepcopy`` of it (so one more copy of
    the parameters is alive meanwhile), with the RNG state restored afterwards.

    Args:
        model: the model.
        example_inputs: positional inputs.
        loss_fn: ``loss_fn(output) -> scalar``; default `trace.default_loss_recipe`.
        optimizer: a name in `OPTIMIZERS` or a callable ``params -> torch.optim.Optimizer``.
        optimizer_state_bytes: the optimizer state's size, given instead of running one: the
            step then has no ``optimizer.step()``, and the state is counted as alive
            throughout forward and backward.
        repeats: timed steps after the measured one (medians are reported).

    Returns:
        A `StepBreakdown` whose parts add up to its peak.

    Raises:
        ValueError: an unknown optimizer name, negative state bytes or ``repeats < 1``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if optimizer_state_bytes is not None:
        if isinstance(optimizer_state_bytes, bool) or int(optimizer_state_bytes) < 0:
            raise ValueError(f"optimizer_state_bytes must be a number of bytes >= 0, got "
                             f"{optimizer_state_bytes!r}")
        make_opt, opt_name = None, "given"
    elif callable(optimizer):
        make_opt, opt_name = optimizer, getattr(optimizer, "__name__", "custom")
    else:
        make_opt, opt_name = get_optimizer(optimizer), str(optimizer).lower()
    inputs = call_inputs(model, example_inputs)
    with preserved_state(model):
        m = copy.deepcopy(model)
    params = list(m.parameters())
    opt = make_opt(params) if make_opt is not None else None
    device = params[0].device if params else torch.device("cpu")
    att = _Attribution()
    marks: dict[str, int] = {}

    def step(tracked: bool) -> tuple[float, float]:
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        hooks = (torch.autograd.graph.saved_tensors_hooks(att.pack, lambda t: t) if tracked
                 else contextlib.nullcontext())
        with hooks:
            out = m(*inputs)
            loss = (loss_fn or default_loss_recipe(out))(out)
            del out
            marks.setdefault("backward", len(att.events))
            loss.backward()
            del loss
        sync_device(device)
        t1 = time.perf_counter()
        marks.setdefault("optimizer step", len(att.events))
        if opt is not None:
            opt.step()
        sync_device(device)
        return t1 - t0, time.perf_counter() - t1

    with preserved_state(model):
        if opt is not None:
            step(False)  # creates the optimizer state
        tr = att.tracker
        category: dict[int, str] = {}
        base = {"parameters": 0, "optimizer_state": 0, "other": 0}
        for kind, ts in (("parameters", params),
                         ("optimizer_state", _state_of(opt)),
                         ("other", [*m.buffers(), *(t for t in pytree.tree_leaves(inputs)
                                                    if isinstance(t, torch.Tensor))])):
            for t in ts:
                if tr.register(t):
                    base[kind] += t.untyped_storage().nbytes()
        if optimizer_state_bytes is not None:
            base["optimizer_state"] += int(optimizer_state_bytes)
        marks.clear()
        with tr:
            step(True)
            for p in params:
                s = None if p.grad is None else att.serial(p.grad)
                if s is not None:
                    category[s] = "gradients"
        for s in att.saved:
            category.setdefault(s, "activations")
        at, live, top = att.at_peak(category)
        fb_peak = _prefix_peak(att, marks["optimizer step"])
        times = [step(False) for _ in range(repeats)]
    base_total = sum(base.values())
    parts = {k: base.get(k, 0) + live.get(k, 0) for k in PARTS}
    phase = ("optimizer step" if at >= marks["optimizer step"] else
             "backward" if at >= marks["backward"] else "forward")
    return StepBreakdown(
        peak_bytes=base_total + top, parts=parts, phase=phase,
        forward_backward_peak_bytes=base_total + fb_peak,
        optimizer_step_peak_bytes=(base_total + _suffix_peak(att, marks["optimizer step"])
                                   if opt is not None else 0),
        step_s=statistics.median(t for t, _ in times),
        optimizer_step_s=statistics.median(t for _, t in times) if opt is not None else 0.0,
        optimizer=opt_name, device=str(device))


def _state_of(opt: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if opt is None:
        return []
    return [v for st in opt.state.values() for v in pytree.tree_leaves(st)
            if isinstance(v, torch.Tensor)]


def _prefix_peak(att: _Attribution, stop: int) -> int:
    """The most bytes alive (over the tracker's base) among the first ``stop`` events."""
    total = best = 0
    for e in att.events[:stop]:
        total += att.bytes[abs(e) - 1] * (1 if e > 0 else -1)
        best = max(best, total)
    return best


def _suffix_peak(att: _Attribution, start: int) -> int:
    """The most bytes alive (over the tracker's base) from event ``start`` on."""
    total = sum(att.bytes[abs(e) - 1] * (1 if e > 0 else -1) for e in att.events[:start])
    best = total
    for e in att.events[start:]:
        total += att.bytes[abs(e) - 1] * (1 if e > 0 else -1)
        best = max(best, total)
    return best
