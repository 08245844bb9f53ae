"""The planned module: the user's model with a schedule applied, as a drop-in.

`rewrite` returns a *copy of the user's model object*: the same class (so its methods and
attributes, a Hugging Face model's ``.config``, ``.generate`` and ``save_pretrained``, are all
there), sharing its submodules, parameter and buffer objects (so ``state_dict`` keys are the
same and an optimizer built on the original's parameters trains it), with its own hook and
attribute dictionaries (a hook registered on the copy is not registered on the original). Only
its ``forward`` differs: an instance attribute, a `PlanForward`, which runs the scheduled
traced step (`regions.CheckpointedStep`) for a training call and the model's own ``forward``
otherwise. The model's own ``__call__`` is kept, so hooks on the root module fire as usual.

When the plan runs, and when the model's own forward runs instead:

* **Training calls** (gradients on, the mode it was traced in) with the positional inputs it
  was traced with, or keywords that fill them in order, run the plan.
* **Other shapes, other non-tensor arguments, another autocast state**: the step is traced
  again for that call (once per distinct call signature, up to `MAX_TRACES`) and runs the
  same schedule, when the model traces to the same nodes there; a warning says once that the
  plan's memory was predicted for the shapes it was solved at, not these.
* Everything else runs the model's own ``forward``, computing exactly what the model
  computes: gradients off (``torch.no_grad``, ``inference_mode``: nothing would be saved),
  another mode than the one traced (``.eval()`` after a training-mode trace), keyword
  arguments that leave a traced input out or fill them out of order, inputs of other kinds, a
  graph that differs at the new signature. A training step that falls back warns, since its
  memory is not what the plan predicted: at its 1st, 10th, 100th, ... fallback step and at
  each new cause, with the counts, so that a job that trains unplanned for good cannot go
  unnoticed. The planned module counts both (`PlanForward.planned_steps`,
  `PlanForward.fallback_steps`), and ``on_fallback="raise"`` (`rewrite`, `solve`, `apply`)
  makes such a step a `PlanFallbackError` instead.

Under ``torch.compile(plan.module)`` the same dispatch runs, as plain Python that dynamo
traces and guards on (grad mode, training flag, the inputs' kinds, shapes and dtypes, the
traced steps held): a training call with the planned inputs (positional, or keywords that bind
to them) captures the whole checkpointed step, hooks on the root and the wrapping check
included, in one graph (``fullgraph=True`` holds); the generated step's eager-only
bookkeeping is skipped there (`executor`). A call the plan runs in no traced step yet is
traced eagerly (``torch.compiler.disable``: a graph break, once per new signature), and a
fallback compiles the model's own forward. The predicted peak and the budget hold for the
eager plan: compiled, inductor allocates buffers of its own (fused kernels, its partition of
what forward keeps), and the peak can exceed the budget by a few percent; measure it with
`measurement.compiled.compiled_peak` and leave that headroom.

Copies (``copy.deepcopy``) and pickles (``torch.save(plan.module)``) keep the schedule and
drop the traced graphs; the first training call traces again.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from .capture.calls import autocast_state, bind_call, input_constants, input_specs, module_copy
from .capture.trace import trace
from .distributed import check_wrapping, hook_ids
from .ir.schedule import Schedule, ScheduleError
from .regions import CheckpointedStep

__all__ = ["FALLBACK_ACTIONS", "MAX_TRACES", "PlanFallbackError", "PlanForward", "first_line",
           "planned", "report_fallback", "rewrite"]

#: Distinct call signatures (shapes, non-tensor arguments, autocast state) a planned module
#: traces for; calls beyond them run the model's own forward, with a warning.
MAX_TRACES = 8

#: What a training call that cannot run the plan does (`PlanForward.on_fallback`).
FALLBACK_ACTIONS = ("warn", "raise")


class PlanFallbackError(RuntimeError):
    """A training call could not run the plan and ``on_fallback="raise"`` was asked for."""


def check_on_fallback(on_fallback: str) -> str:
    """``on_fallback`` if it is one of `FALLBACK_ACTIONS`, else a ValueError naming them."""
    if on_fallback not in FALLBACK_ACTIONS:
        raise ValueError(f"on_fallback must be one of {', '.join(map(repr, FALLBACK_ACTIONS))}, "
                         f"got {on_fallback!r}")
    return on_fallback


def rewrite(gm: fx.GraphModule, schedule: Schedule, model: nn.Module, *,
            on_fallback: str = "warn") -> nn.Module:
    """The planned copy of ``model`` that runs ``schedule`` over the graph ``gm`` traced from it.

    The schedule's regions must name exactly the graph's model nodes in order (validate it
    against the profiled `CostGraph` first for a fingerprint check). ``on_fallback``: what a
    training call that cannot run the plan does, ``"warn"`` (run the model's own forward,
    warning at its 1st, 10th, 100th, ... such step and at each new cause) or ``"raise"``
    (`PlanFallbackError`).

    Raises:
        ScheduleError: the schedule does not match the graph, or a recompute region would
            replay a value written in place after it (the message names the op).
    """
    check_on_fallback(on_fallback)
    module = module_copy(model)
    step = CheckpointedStep(gm, schedule, root=module)
    base = model.__dict__.get("forward")
    if isinstance(base, PlanForward):
        base = base.base
    module.__dict__["forward"] = PlanForward(module, step, base, known_hooks=hook_ids(model),
                                             on_fallback=on_fallback)
    return module


def planned(module: nn.Module) -> Any:
    """What runs a planned module's plan: the `PlanForward` of a module `rewrite` returned, the
    `units.UnitsPlan` of one `units.rewrite_units` returned (None for any other module). Both
    have ``schedule``, ``loss_fn``, ``planned_steps``, ``fallback_steps``, ``traces`` and a
    settable ``on_fallback``."""
    if not isinstance(module, nn.Module):
        return None
    units = module.__dict__.get("_scheduler_units")
    if units is not None and hasattr(units, "forwards"):  # (`units.runtime` imports this)
        return units
    fwd = module.__dict__.get("forward")
    return fwd if isinstance(fwd, PlanForward) else None


class PlanForward:
    """The ``forward`` of a planned module (see the module docstring for when the plan runs).

    Attributes:
        schedule: the `Schedule` it runs.
        loss_fn: the loss the model was traced with (used by `scheduler.measure`).
        info: the `TraceInfo` of the trace the plan was solved on.
        base: the model's own instance-level ``forward``, if it had one (else its class's).
        planned_steps: eager training calls (gradients on, training mode) that ran the plan
            (under ``torch.compile`` the compiled calls are not counted).
        fallback_steps: eager training calls that ran the model's own forward instead.
        on_fallback: ``"warn"`` or ``"raise"`` (`FALLBACK_ACTIONS`), settable.
    """

    def __init__(self, module: nn.Module, step: CheckpointedStep,
                 base: Callable[..., Any] | None = None, *,
                 known_hooks: frozenset[int] = frozenset(), on_fallback: str = "warn"):
        self.module = module
        self.known_hooks = known_hooks  # hooks there were when it was traced (in the graph)
        self.schedule = step.schedule
        self.info = step.info
        self.loss_fn: Callable[[Any], torch.Tensor] = step.info.loss_fn
        self.base = base  # (`trace.bare_copy` puts it back on the copy it traces)
        self.planned_key = _signature(step.info.input_specs, step.info.constants,
                                      step.info.autocast, step.info.tracer)
        self._steps: dict[Any, CheckpointedStep | str] = {self.planned_key: step}
        self._warned: set[str] = set()
        self.planned_steps = 0
        self.fallback_steps = 0
        self.on_fallback = check_on_fallback(on_fallback)

    @property
    def traces(self) -> int:
        """How many call signatures it holds a traced, scheduled step for."""
        return sum(isinstance(s, CheckpointedStep) for s in self._steps.values())

    def __getstate__(self) -> dict[str, Any]:
        state = dict(vars(self))
        state["_steps"], state["_warned"] = {}, set()  # (traced graphs do not copy or pickle)
        # the output's TreeSpec is the graph's business, and the next trace records it again
        state["info"] = dataclasses.replace(self.info, out_spec=None)
        return state

    def __repr__(self) -> str:
        rc = len(self.schedule.recompute_regions)
        return (f"PlanForward({type(self.module).__name__}, {len(self.schedule.regions)} "
                f"regions, {rc} recomputed)")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The planned step or the model's own forward (module docstring). Under
        ``torch.compile`` this dispatch is traced as it stands: its checks become guards."""
        positional = self._positional(args, kwargs)
        specs = None if positional is None else input_specs(positional)
        why = self._fallback_reason(specs)
        step = None
        if why is None:
            call = (specs, input_constants(positional), autocast_state())
            step, why = self._step_for(positional, call)
        if step is None:
            self._fall_back(why)
            return self._own_forward(*args, **kwargs)
        self._count("planned_steps")
        self._warn_unplanned(call)
        check_wrapping(self.module, step.prog.called_modules, known=self.known_hooks)
        return step(positional)

    def _own_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.base is not None:
            return self.base(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def _count(self, attr: str) -> None:
        # (not while dynamo traces: it would guard on the count's value and compile again at
        # every step; compiled steps are not counted)
        if not torch.compiler.is_compiling():
            setattr(self, attr, getattr(self, attr) + 1)

    def _fall_back(self, why: str) -> None:
        """Count a training call that cannot run the plan, and warn at its 1st, 10th, 100th,
        ... such call (or raise, with ``on_fallback="raise"``). Calls outside training
        (gradients off, eval mode) are what the plan leaves to the model, silently."""
        if not (torch.is_grad_enabled() and self.module.training):
            return
        self._count("fallback_steps")
        n = self.fallback_steps
        message = (f"this training step runs the model's own forward, not the checkpointed "
                   f"plan: {why}. It computes the same loss and gradients, but its memory is "
                   f"not what the plan predicted")
        report_fallback(message, why, self._warned, self.on_fallback,
                        f"{n} training step(s) have run unplanned so far, "
                        f"{self.planned_steps} planned", n, stacklevel=4)

    def _positional(self, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> tuple[Any, ...] | None:
        """The call as positional inputs (`calls.bind_call`; None when it cannot be)."""
        own = self.base if self.base is not None else functools.partial(
            type(self.module).forward, self.module)
        return bind_call(own, args, kwargs)

    def _fallback_reason(self, specs: tuple[Any, ...] | None) -> str | None:
        """Why this call runs the model's own forward whatever its shapes (None: it need not);
        ``specs`` are its inputs' `input_specs` (None: its arguments do not bind)."""
        info = self.info
        if not torch.is_grad_enabled():
            return "gradients are disabled"
        if self.module.training != info.training:
            return (f"the module is in {'training' if self.module.training else 'eval'} mode "
                    f"but was traced in {'training' if info.training else 'eval'} mode; solve "
                    f"or apply with the model in the mode it trains in")
        if specs is None:
            return ("its keyword arguments do not map onto the positional inputs it was "
                    "traced with (a traced input left out, or filled out of order); call it "
                    "with those inputs, in order")
        if [s is None for s in specs] != [s is None for s in info.input_specs]:
            return (f"it was called with {len(specs)} inputs ({_kinds(specs)}) but traced with "
                    f"{len(info.input_specs)} ({_kinds(info.input_specs)}); call it with the "
                    f"inputs it was traced with, or solve for this call")
        return None

    def _step_for(self, args: tuple[Any, ...], call: tuple[Any, Any, Any]
                  ) -> tuple[CheckpointedStep | None, str | None]:
        """The scheduled step for this call's ``(input specs, constants, autocast state)``,
        tracing it the first time."""
        key = _signature(*call, self.info.tracer)
        got = self._steps.get(key)
        if got is None:
            if self.traces >= MAX_TRACES:
                return None, (f"it was called with more than {MAX_TRACES} distinct input "
                              f"signatures (shapes, non-tensor arguments, autocast); pad "
                              f"inputs to a few fixed shapes")
            got = self._trace(args)
            self._steps[key] = got
        if isinstance(got, str):
            return None, got
        return got, None

    @torch.compiler.disable
    def _trace(self, args: tuple[Any, ...]) -> CheckpointedStep | str:
        # (under torch.compile, tracing runs eagerly: dynamo would otherwise try to compile
        # the tracer itself)
        try:
            gm = trace(self.module, args, loss_fn=self.loss_fn)
            return CheckpointedStep(gm, self.schedule, root=self.module)
        except (ScheduleError, RuntimeError) as e:
            return (f"at these inputs the model traces to another graph than the one the "
                    f"plan was made for ({first_line(e)}); solve for these inputs")

    def _warn_unplanned(self, call: tuple[Any, Any, Any]) -> None:
        """Warn once per kind when a training call the plan runs (its ``(input specs,
        constants, autocast state)``) differs from the call it was solved for: its memory
        there was not predicted."""
        if {"shapes", "constants", "autocast"} <= self._warned:
            return
        specs, constants, autocast = call
        checks = {
            "shapes": ([s for s in specs if s], [s for s in self.info.input_specs if s],
                       "tensor inputs of shapes and dtypes"),
            "constants": (constants, self.info.constants, "non-tensor arguments"),
            "autocast": (autocast, self.info.autocast,
                         "autocast (device, dtype; its cache where off)"),
        }
        for kind, (now, then, what) in checks.items():
            if kind in self._warned or tuple(now) == tuple(then):
                continue
            self._warned.add(kind)
            if kind == "shapes":
                now, then = ([(list(s[0]), str(s[1]).removeprefix("torch.")) for s in x]
                             for x in (now, then))
            warnings.warn(
                f"the plan runs its schedule on {what} {list(now)}, but it was solved for "
                f"{list(then)}: its predicted peak memory holds for that call only. Solve for "
                f"the largest inputs you train with, in the autocast you train in",
                RuntimeWarning, stacklevel=4)


def report_fallback(message: str, why: str, warned: set[str], on_fallback: str, counts: str,
                    n: int, *, stacklevel: int) -> None:
    """Say the ``n``-th training call that fell back (``message``, for the reason ``why``):
    `PlanFallbackError` with ``on_fallback="raise"``; else a warning with ``counts`` at the
    1st, 10th, 100th, ... such call and at each reason not in ``warned`` yet."""
    if on_fallback == "raise":
        raise PlanFallbackError(message + " (on_fallback='raise')")
    if n == 10 ** (len(str(n)) - 1) or why not in warned:  # 1, 10, 100, ... or new
        warned.add(why)
        warnings.warn(f"{message}; {counts} (pass on_fallback='raise' to stop instead)",
                      RuntimeWarning, stacklevel=stacklevel + 1)


def _signature(specs: tuple[Any, ...], constants: tuple[Any, ...], autocast: tuple[Any, ...],
               tracer: str) -> tuple[Any, ...]:
    """What a traced graph is specialised to: an fx graph to its non-tensor arguments and the
    autocast state (shapes stay symbolic), an exported one to shapes and dtypes as well."""
    tensors = tuple((s[1],) if s is not None and tracer == "fx" else s for s in specs)
    return tensors, constants, autocast


def _kinds(specs: tuple[Any, ...]) -> str:
    return ", ".join("tensor" if s is not None else "other" for s in specs) or "none"


def first_line(e: BaseException) -> str:
    """The first line of an error's message (its type's name if it has none)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
