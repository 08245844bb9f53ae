"""Measured peak memory and step time of one training step.

On CPU, PyTorch keeps no allocator statistics, so `StorageTracker` counts live tensor
storages itself: a ``TorchDispatchMode`` sees every op's outputs (forward, backward and
recompute), registers each new storage once with a weak reference, and subtracts it when the
storage dies. Views and in-place results share their base's storage and count once. Memory an op
allocates and frees inside its own kernel is invisible to it (CUDA measurement sees it).
On CUDA, `measure` uses ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import weakref
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Measurement", "OPTIMIZERS", "PARTS", "StepBreakdown", "StorageTracker", "get_optimizer",
           "measure", "measure_training_step"]


class StorageTracker(TorchDispatchMode):
    """Counts the bytes of live tensor storages while active (CPU peak-memory measurement).

    ``current_bytes``/``peak_bytes`` include the storages passed to `register` beforehand
    (parameters, inputs). ``on_alloc(storage_key, nbytes)`` and ``on_free(storage_key, nbytes)``
    callbacks, when given, see every new storage and every death, in order; the key is stable
    for the storage's lifetime.
    """

    def __init__(self, *, on_alloc: Callable[[int, int], None] | None = None,
                 on_free: Callable[[int, int], None] | None = None):
        super().__init__()
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self.on_alloc = on_alloc
        self.on_free = on_free

    def key(self, t: torch.Tensor) -> int:
        return id(t.untyped_storage())

    def register(self, t: torch.Tensor, *, notify: bool = False) -> bool:
        """Count ``t``'s storage if it is not counted yet; returns whether it was new."""
        st = t.untyped_storage()
        k = id(st)
        if k in self._live:
            return False
        n = st.nbytes()

        def _dead(_ref: weakref.ref, k: int = k, n: int = n) -> None:
            if self._live.pop(k, None) is not None:
                self.current_bytes -= n
                if self.on_free is not None:
                    self.on_free(k, n)

        self._live[k] = (weakref.ref(st, _dead), n)
        self.current_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        if notify and self.on_alloc is not None:
            self.on_alloc(k, n)
        return True

    def is_live(self, t: torch.Tensor) -> bool:
        return id(t.untyped_storage()) in self._live

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.register(t, notify=True)
        return out


@dataclass(frozen=True)
class Measurement:
    """One measured training step (forward, loss, backward)."""

    peak_bytes: int  # peak of live tensor memory over the step, base included
    base_bytes: int  # alive before the step: parameters, buffers, inputs
    step_s: float  # median wall time of a step
    step_s_all: tuple[float, ...]  # every timed step
    loss: float
    device: str
    # with ``measure(..., timeline=True)`` on CPU: live bytes after every allocation and free
    # of the tracked step, base included (empty otherwise)
    timeline: tuple[int, ...] = field(default=(), repr=False, compare=False)
    timeline_backward_at: int = field(default=0, repr=False, compare=False)  # its first index
    # in backward

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("timeline")
        d.pop("timeline_backward_at")
        return d


def measure(module: nn.Module, example_inputs: Sequence[Any], *,
            loss_fn: Callable[[Any], torch.Tensor] | None = None, repeats: int = 5,
            warmup: int = 1, timeline: bool = False) -> Measurement:
    """Run real training steps of ``module`` and measure peak memory and step time.

    One step is ``loss_fn(module(*inputs)).backward()`` with gradients starting at ``None``.
    The module's state (buffers, ``.grad``, RNG) is restored afterwards.

    Args:
        module: any module, e.g. a checkpointed one from `scheduler.apply`; its default
            ``loss_fn`` is the one it was traced with, else `trace.default_loss_recipe`.
        example_inputs: positional inputs.
        loss_fn: ``loss_fn(output) -> scalar``.
        repeats: timed steps (the median is reported).
        warmup: untimed steps first.
        timeline: on CPU, also record the live bytes after every allocation and free of the
            tracked step (`Measurement.timeline`, for `report.plot_timeline`).

    Returns:
        `Measurement`. On CPU the peak comes from `StorageTracker` (a separate, untimed step);
        on CUDA from ``torch.cuda.max_memory_allocated``.
    """
    from .trace import _as_tuple, default_loss_recipe, preserved_state

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    inputs = _as_tuple(example_inputs)
    loss_fn = loss_fn or getattr(module, "loss_fn", None)
    params = list(module.parameters())
    device = params[0].device if params else torch.device("cpu")

    trace: list[int] = []
    backward_at = [0]

    def step() -> torch.Tensor:
        for p in params:
            p.grad = None
        out = module(*inputs)
        fn = loss_fn or default_loss_recipe(out)
        loss = fn(out)
        del out
        backward_at[0] = len(trace)
        loss.backward()
        return loss.detach()

    with preserved_state(module):
        for _ in range(warmup):
            step()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        for p in params:
            p.grad = None
        base = _base_bytes(module, inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device)
            loss = step()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - start + base
        else:
            trace.clear()
            active = [timeline]

            def record(_key: int, _nbytes: int) -> None:
                if active[0]:  # frees after the step (weak references) are not part of it
                    trace.append(tracker.current_bytes)

            tracker = StorageTracker(on_alloc=record, on_free=record)
            for t in _state_tensors(module, inputs):
                tracker.register(t)
            with tracker:
                loss = step()
            active[0] = False
            peak = tracker.peak_bytes
        for p in params:
            p.grad = None
    return Measurement(peak_bytes=int(peak), base_bytes=base,
                       step_s=statistics.median(times), step_s_all=tuple(times),
                       loss=float(loss), device=str(device),
                       timeline=tuple(trace) if device.type != "cuda" else (),
                       timeline_backward_at=backward_at[0] if device.type != "cuda" else 0)


def _state_tensors(module: nn.Module, inputs: Sequence[Any]) -> list[torch.Tensor]:
    ts = [*module.parameters(), *module.buffers()]
    ts += [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    return ts


def _base_bytes(module: nn.Module, inputs: Sequence[Any]) -> int:
    """Bytes of the unique storages of parameters, buffers and tensor inputs."""
    seen: dict[int, int] = {}
    for t in _state_tensors(module, inputs):
        st = t.untyped_storage()
        seen[st.data_ptr() or id(st)] = st.nbytes()
    return sum(seen.values())


# ------------------------------------------------------------------ a real step with an optimizer

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
    import copy

    from .trace import _as_tuple, default_loss_recipe, preserved_state

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
    inputs = _as_tuple(example_inputs)
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
        _sync(device)
        t1 = time.perf_counter()
        marks.setdefault("optimizer step", len(att.events))
        if opt is not None:
            opt.step()
        _sync(device)
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_in_turns(cases: dict[Any, tuple[nn.Module, Sequence[Any]]], *, repeats: int,
                     loss_fn: Callable[[Any], torch.Tensor] | None = None,
                     step: Callable[..., None] | None = None) -> dict[Any, Measurement]:
    """Measure each ``(module, inputs)`` case in ``repeats`` rounds of one timed step each, so
    that a burst of load from elsewhere on the machine slows all of them alike rather than one:
    each case's step time is the median over its rounds, its peak the largest (on CPU every
    round's peak is the same). ``step(description)`` and ``step(advance=1)`` report progress."""
    runs: dict[Any, list[Measurement]] = {key: [] for key in cases}
    for i in range(repeats):
        for j, (key, (module, inputs)) in enumerate(cases.items()):
            if step is not None:
                step(f"measuring: round {i + 1}/{repeats}, case {j + 1}/{len(cases)}")
            runs[key].append(measure(module, inputs, loss_fn=loss_fn, repeats=1,
                                     warmup=int(i == 0)))
            if step is not None:
                step(advance=1)
    out = {}
    for key, ms in runs.items():
        times = tuple(t for m in ms for t in m.step_s_all)
        out[key] = replace(ms[0], peak_bytes=max(m.peak_bytes for m in ms),
                           step_s=statistics.median(times), step_s_all=times)
    return out
