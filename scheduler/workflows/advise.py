"""Advice before remedy: where one training step's memory goes, and what makes it fit.

`advise` measures a real, steady-state training step with its optimizer
(`measure.measure_training_step`), splits the peak into parameters, gradients, optimizer
state, saved activations and the rest, and compares it with a device's memory less headroom.
When the step does not fit, it prices every remedy this package can predict, for the same
logical batch: checkpointing alone (the optimal plan), and gradient accumulation over 2, 4, ...
micro-batches with and without checkpointing; the fastest option that fits is the
recommendation. When none fits, the advice says how far off the best one is and names the
remedies that target what dominates (sharding, lower-precision optimizer state, a smaller
model) instead of checkpointing.

How a step's peak is counted: the optimizer creates its state in its first step, so from the
second step on the state is alive through forward and backward, and the peak of a step is
``max(forward/backward peak + state, optimizer-step peak)``. With gradient accumulation every
micro-batch after the first starts with all gradients alive, and backward adds each new
gradient into the old one (both alive for a moment).
"""

from __future__ import annotations

import numbers
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from ..budget import InfeasibleBudgetError
from ..capture.profile import profile_traced
from ..capture.calls import call_inputs
from ..capture.trace import trace
from ..cost.simulate import simulate
from ..ir.graph import CostGraph, with_step_time
from ..ir.schedule import Schedule
from ..measurement.breakdown import (
    StepBreakdown,
    get_optimizer,
    measure_training_step,
)
from ..measurement.step import measure, measure_in_turns
from ..plan import solve_graph
from ..rewrite import rewrite
from ..quantities import check_time_limit, format_bytes, format_seconds, parse_bytes
from .advise_rank import advise_per_rank, least_peak_result, rank_engine
from .advice import (
    CHECKPOINT,
    FITS,
    Advice,
    Option,
    beyond_summary,
    recommend,
    remedies,
    shares,
)

__all__ = ["accumulation_graph", "advise", "check_headroom", "parse_memory", "slice_inputs"]

def parse_memory(value: int | str, what: str = "device_memory") -> int:
    """Bytes from an int or a string such as ``"24GiB"``; ``what`` names it in errors.

    Raises:
        ValueError: zero, negative, non-integral, bools or garbage, naming the value and the
            accepted forms.
    """
    forms = "a positive number of bytes: an int such as 25769803776 or a string like '24GiB'"
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
        raise ValueError(f"bad {what} {value!r}: expected {forms}")
    if isinstance(value, numbers.Integral):
        if value < 1:
            raise ValueError(f"bad {what} {value!r}: it must be positive; expected {forms}")
        return int(value)
    try:
        return parse_bytes(value)
    except ValueError:
        raise ValueError(f"bad {what} {value!r}: expected {forms}") from None


def check_headroom(headroom: Any) -> float:
    """``headroom`` as a float in [0, 1), or a ValueError that says so."""
    if (isinstance(headroom, bool) or not isinstance(headroom, numbers.Real)
            or not 0 <= headroom < 1):
        raise ValueError(f"headroom must be a fraction in [0, 1) of the memory held back "
                         f"(e.g. 0.1 for 10%), got {headroom!r}")
    return float(headroom)


def accumulation_graph(graph: CostGraph) -> CostGraph:
    """The graph of a gradient-accumulation micro-step after the first: every gradient the
    step leaves behind is alive from the start (counted with the base bytes), and where
    backward produces one, it is added into the old one and freed (both alive for a moment),
    as ``AccumulateGrad`` does. Simulating or solving it predicts accumulation's peak."""
    final: dict[int, int] = {}  # gradient id -> bytes, for those alive after backward
    for step in graph.bwd_steps:
        for kind, gid, b in step.events:
            if kind == "a":
                final[gid] = b
            else:
                final.pop(gid, None)
    steps = [replace(step, events=step.events + tuple(
        ("f", gid, 0) for kind, gid, _ in step.events if kind == "a" and gid in final))
        for step in graph.bwd_steps]
    return replace(graph, bwd_steps=steps, buffer_bytes=graph.buffer_bytes + sum(final.values()),
                   meta={**graph.meta, "accumulation": True})


def advise(model: nn.Module, example_inputs: Sequence[Any], *, device_memory: int | str,
           optimizer: str | Callable[[Any], torch.optim.Optimizer] = "adamw",
           optimizer_state_bytes: int | str | None = None,
           loss_fn: Callable[[Any], torch.Tensor] | None = None, headroom: float = 0.1,
           micro_batches: Sequence[int] | None = None, solver: str = "auto",
           time_limit_s: float | None = 30.0, repeats: int = 3,
           progress: Callable[[str], None] | None = None, parallel: Any = None) -> Advice:
    """Measure where one training step's memory goes and recommend what makes it fit.

    Args:
        model: the model (not modified: the optimizer runs on a copy).
        example_inputs: positional inputs of one logical batch; tensors whose first
            dimension is the batch size are sliced into micro-batches.
        device_memory: the device's memory in bytes (``"24GiB"`` or an int).
        optimizer: a name (``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd_momentum"``,
            ``"rmsprop"``, ``"adagrad"``) or ``params -> torch.optim.Optimizer``; one real step
            of it measures its state and its step's temporaries.
        optimizer_state_bytes: the optimizer state's size instead (then no optimizer runs).
        loss_fn: ``loss_fn(output) -> scalar``; default `trace.default_loss_recipe`.
        headroom: fraction of ``device_memory`` held back (allocator fragmentation, shapes that
            vary, cost-model error); default 0.1. In [0, 1).
        micro_batches: micro-batch counts to price for gradient accumulation; default 2, 4, 8
            (those that divide the batch).
        solver, time_limit_s: passed to `solve_graph` for the checkpointing plans.
        repeats: timed steps per measurement and profile.
        progress: called with a short message as each phase starts.
        parallel: advise one rank of data-parallel training (``"ddp"``, ``"fsdp2:8"``,
            `parallel.DDP`, `parallel.FSDP2`, as in `solve`): ``device_memory`` is then a
            rank's device, the optimizer (named) has its state counted per rank, and
            everything is predicted from one rank's profile, not measured
            (`workflows.advise_rank`).

    Returns:
        An `Advice`: ``print(advice)`` for the report, ``advice.to_json()`` for the data.

    Raises:
        ValueError: a bad ``device_memory``, ``headroom``, ``micro_batches`` or optimizer
            name (the message lists the valid ones).
        TraceError: the model cannot be traced (only when the step does not fit as it is).

    Example:
        >>> advice = scheduler.advise(model, (x,), device_memory="24GiB")  # doctest: +SKIP
        >>> print(advice); advice.recommendation  # doctest: +SKIP
    """
    device_bytes = parse_memory(device_memory)
    headroom = check_headroom(headroom)
    check_time_limit(time_limit_s)
    state_bytes = None
    if optimizer_state_bytes is not None:  # 0 is a valid size (plain SGD keeps no state)
        state_bytes = (0 if optimizer_state_bytes == 0 and not isinstance(
            optimizer_state_bytes, bool) else parse_memory(optimizer_state_bytes,
                                                           "optimizer_state_bytes"))
    if state_bytes is None and not callable(optimizer):
        get_optimizer(optimizer)
    engine = (rank_engine(parallel, optimizer, optimizer_state_bytes)
              if parallel is not None else None)
    inputs = call_inputs(model, example_inputs)
    batch = _batch_size(inputs)
    ks = _micro_batch_counts(micro_batches, batch)
    say = progress or (lambda _msg: None)
    usable = int(device_bytes * (1 - headroom))
    if engine is not None:
        return advise_per_rank(
            model, inputs, engine, device_bytes=device_bytes, headroom=headroom,
            usable=usable, batch=batch, ks=ks, loss_fn=loss_fn, solver=solver,
            time_limit_s=time_limit_s, repeats=repeats, slicer=slice_inputs,
            accumulation=accumulation_graph, say=say)

    say("measuring a training step with its optimizer")
    bd = measure_training_step(model, inputs, loss_fn=loss_fn, optimizer=optimizer,
                               optimizer_state_bytes=state_bytes, repeats=repeats)
    advice = Advice(device_memory_bytes=device_bytes, headroom=headroom, usable_bytes=usable,
                    breakdown=bd, fits=bd.peak_bytes <= usable, recommendation=FITS,
                    summary="")
    share = shares(bd)
    if advice.fits:
        advice.summary = (
            f"the step fits: it peaks at {format_bytes(bd.peak_bytes)}, "
            f"{bd.peak_bytes / usable:.0%} of the usable {format_bytes(usable)}. No "
            f"checkpointing needed: it would only add recompute time.")
        return advice

    pricer = _Pricer(model, inputs, loss_fn, bd, usable, solver, time_limit_s, repeats, say)
    options = pricer.options(batch, ks)
    kind, chosen = recommend(options)
    advice.options, advice.recommendation, advice.chosen = options, kind, chosen
    advice.schedules = dict(pricer.schedules)
    over = bd.peak_bytes - usable
    if chosen is None:
        best = min(options, key=lambda o: o.predicted_peak_bytes)
        advice.shortfall_bytes = best.predicted_peak_bytes - usable
        advice.summary = beyond_summary(bd, share, best, usable)
        advice.remedies = remedies(bd)
        return advice
    say(f"measuring the plan of {chosen.name!r}")
    advice.plan_module, advice.measured = pricer.measure(chosen)
    acts = f"saved activations are {share['activations']:.0%} of the peak"
    alts = ", ".join(f"{o.name} {format_seconds(o.predicted_time_s)}"
                     for o in options[1:] if o.fits and o is not chosen)
    alts = f" (other options that fit: {alts})" if alts else ""
    head = f"the step needs {format_bytes(over)} more than the usable {format_bytes(usable)}"
    if kind == CHECKPOINT:
        m = advice.measured or {}
        advice.summary = (
            f"{head}; {acts}, and the optimal checkpointing plan fits (predicted peak "
            f"{format_bytes(chosen.predicted_peak_bytes)}). Checkpoint: predicted overhead "
            f"+{chosen.overhead:.1%}, measured +{m.get('measured_overhead', float('nan')):.1%} "
            f"of the step, {format_seconds(chosen.predicted_time_s)} per batch, the fastest "
            f"option that fits{alts}.")
    else:
        how = " with checkpointing" if chosen.checkpoint else ""
        advice.summary = (
            f"{head}; {acts}. Accumulate gradients over {chosen.micro_batches} micro-batches "
            f"of {chosen.micro_batch_size}{how}: predicted peak "
            f"{format_bytes(chosen.predicted_peak_bytes)}, "
            f"{format_seconds(chosen.predicted_time_s)} per batch, the fastest option that "
            f"fits{alts}.")
    return advice


# ------------------------------------------------------------------ pricing the options


class _Pricer:
    """Profiles the batch and its micro-batches once each and prices every option."""

    def __init__(self, model: nn.Module, inputs: tuple[Any, ...], loss_fn: Any,
                 bd: StepBreakdown, usable: int, solver: str, time_limit_s: float | None,
                 repeats: int, say: Callable[[str], None]):
        self.model, self.inputs, self.loss_fn = model, inputs, loss_fn
        self.bd, self.usable, self.solver, self.time_limit_s = bd, usable, solver, time_limit_s
        self.repeats, self.say = repeats, say
        self.state = bd.parts["optimizer_state"]
        self.cache: dict[int, tuple[Any, CostGraph, tuple[Any, ...]]] = {}
        self.schedules: dict[str, Schedule] = {}

    def _graph(self, k: int) -> tuple[Any, CostGraph, tuple[Any, ...]]:
        if k not in self.cache:
            inputs = self.inputs if k == 1 else slice_inputs(self.inputs, k)
            self.say(f"profiling {'the batch' if k == 1 else f'a micro-batch of 1/{k}'}")
            gm = trace(self.model, inputs, loss_fn=self.loss_fn)
            graph = profile_traced(gm, self.model, inputs, repeats=self.repeats,
                                   name=type(self.model).__name__)
            self.cache[k] = (gm, graph, inputs)
        return self.cache[k]

    def _time_in_turns(self, ks: list[int]) -> None:
        """Re-time the unscheduled step of the batch and of every micro-batch size in turns
        (one step of each per round) and rescale each graph's times to it: profiles taken
        one after another see different load, which would skew the comparison of options."""
        sizes = [1, *ks]
        cases = {k: (self.model, self._graph(k)[2]) for k in sizes}
        self.say("timing the batch and its micro-batches in turns")
        timed = measure_in_turns(cases, repeats=max(3, self.repeats), loss_fn=self.loss_fn)
        for k in sizes:
            gm, graph, inputs = self.cache[k]
            self.cache[k] = (gm, with_step_time(graph, timed[k].step_s), inputs)

    def options(self, batch: int | None, ks: list[int]) -> list[Option]:
        self._time_in_turns(ks)
        _, g1, _ = self._graph(1)
        opt_s, opt_peak = self.bd.optimizer_step_s, self.bd.optimizer_step_peak_bytes
        as_is = Option("as is", 1, batch, False, self.bd.peak_bytes,
                       g1.measured_step_s + opt_s, False)
        out = [as_is, self._checkpointed(1, batch, g1, opt_s, opt_peak)]
        for k in ks:
            g = accumulation_graph(self._graph(k)[1])
            size = batch // k if batch else None
            est = simulate(g, Schedule.none(g))
            peak = max(est.peak_bytes + self.state, opt_peak)
            out.append(Option(f"accumulate {k}", k, size, False, peak,
                              k * g.measured_step_s + opt_s, peak <= self.usable))
            if not out[-1].fits:  # where it fits, checkpointing could only add time
                out.append(self._checkpointed(k, size, g, opt_s, opt_peak))
        return out

    def _checkpointed(self, k: int, size: int | None, g: CostGraph, opt_s: float,
                      opt_peak: int) -> Option:
        """The optimal plan for micro-batch count ``k`` (``g`` is its accumulation graph for
        k > 1) whose peak with the optimizer state fits; else the smallest peak reachable."""
        name = "checkpoint" if k == 1 else f"accumulate {k} + checkpoint"
        target = self.usable - self.state
        try:
            if target < 1:
                raise InfeasibleBudgetError("", budget_bytes=target, min_feasible_bytes=0)
            result = solve_graph(g, target, solver=self.solver, time_limit_s=self.time_limit_s)
        except InfeasibleBudgetError:  # nothing fits: report the least peak a schedule reaches
            floor = least_peak_result(g, self.solver, self.time_limit_s).estimate
            return Option(name, k, size, True, max(floor.peak_bytes + self.state, opt_peak),
                          k * floor.step_s + opt_s, False, floor.overhead, "no schedule fits")
        est = result.estimate
        self.schedules[name] = result.schedule
        peak = max(est.peak_bytes + self.state, opt_peak)
        return Option(name, k, size, True, peak, k * est.step_s + opt_s,
                      peak <= self.usable, est.overhead)

    def measure(self, chosen: Option) -> tuple[nn.Module | None, dict[str, Any] | None]:
        """The chosen option's checkpointed module, measured (None where not checkpointed)."""
        if not chosen.checkpoint:
            return None, None
        gm, g, inputs = self._graph(chosen.micro_batches)
        module = rewrite(gm, self.schedules[chosen.name], self.model)
        # both measured now, one after the other: timings are only comparable within a run
        repeats = max(3, self.repeats)
        plain = measure(self.model, inputs, loss_fn=self.loss_fn, repeats=repeats)
        m = measure(module, inputs, repeats=repeats)
        # a micro-step after the first also holds the gradients accumulated so far
        held = g.grad_bytes if chosen.micro_batches > 1 else 0
        return module, {
            "predicted_overhead": chosen.overhead,
            "measured_overhead": m.step_s / plain.step_s - 1,
            "predicted_peak_bytes": chosen.predicted_peak_bytes,
            "measured_peak_bytes": m.peak_bytes + self.state + held,
        }


# ------------------------------------------------------------------ inputs and micro-batches


def _batch_size(inputs: tuple[Any, ...]) -> int | None:
    """The common first dimension of the tensor inputs, or None when they have none."""
    sizes = {t.shape[0] for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else None


def _micro_batch_counts(micro_batches: Sequence[int] | None, batch: int | None) -> list[int]:
    if micro_batches is None:
        return [k for k in (2, 4, 8) if batch and batch % k == 0]
    ks = list(micro_batches)
    bad = [k for k in ks if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 2]
    if bad:
        raise ValueError(f"micro_batches must be counts >= 2 (the batch is split into that "
                         f"many micro-batches), got {bad[0]!r}")
    if ks and batch is None:
        raise ValueError("micro_batches needs tensor inputs that share a first (batch) "
                         "dimension to slice; pass micro_batches=() to skip accumulation")
    undivided = [k for k in ks if batch % k]  # type: ignore[operator]
    if undivided:
        raise ValueError(f"micro_batches={undivided[0]} does not divide the batch size "
                         f"{batch}; use a divisor of {batch}")
    return ks


def slice_inputs(inputs: tuple[Any, ...], k: int) -> tuple[Any, ...]:
    """The first of ``k`` equal micro-batches (copied, so it owns only its own bytes)."""
    return tuple(t[: t.shape[0] // k].clone()
                 if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in inputs)


# ------------------------------------------------------------------ words
