"""Warnings for a plan run otherwise than it was solved for, said once each.

* A plan fitted for ``torch.compile`` whose eager step is predicted over its budget, run
  eagerly: `EagerRunWarning` at its module's first call outside ``torch.compile``
  (`watch_eager_run`).
* A plan solved for eager execution (the default) run under ``torch.compile`` of the whole
  model: `CompiledRunWarning` at its first compiled run (`watch_compiled_run`), said after the
  graph through dynamo's reorderable logging functions, so that it breaks no graph: its budget
  bounds the eager step only (inductor keeps and reuses memory its own way).

`plan.solve` and `scheduler.apply` register both from the schedule they run.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch._dynamo.config as dynamo_config
import torch.nn as nn

from .compiled_fit import COMPILED_PEAK
from .ir.schedule import Schedule
from .quantities import format_bytes

__all__ = ["CompiledRunWarning", "EagerRunWarning", "WarnCompiledRun", "WarnEagerRun",
           "watch_compiled_run", "watch_eager_run"]


class EagerRunWarning(UserWarning):
    """A plan fitted for ``torch.compile`` ran eagerly, where its step is predicted over its
    budget."""


class WarnEagerRun:
    """A forward pre-hook for the module of a plan fitted for ``torch.compile`` whose eager
    step is predicted over its budget: at the module's first call outside ``torch.compile``
    it warns (`EagerRunWarning`) that the budget holds compiled only, and how to run it.
    Traced by dynamo, it finds itself compiling and says nothing. (A class, not a closure, so
    that the module still pickles.)"""

    def __init__(self, eager_peak_bytes: int, budget_bytes: int,
                 compiled_peak_bytes: int | None) -> None:
        self.eager_peak_bytes = eager_peak_bytes
        self.budget_bytes = budget_bytes
        self.compiled_peak_bytes = compiled_peak_bytes
        self.warned = False

    def __call__(self, module: nn.Module, args: Any) -> None:
        if self.warned or torch.compiler.is_compiling():
            return
        self.warned = True
        measured = ("" if self.compiled_peak_bytes is None else
                    f" (its compiled step measured {format_bytes(self.compiled_peak_bytes)})")
        warnings.warn(
            f"this plan was fitted for torch.compile{measured}, but it runs eagerly here, "
            f"where its step is predicted at {format_bytes(self.eager_peak_bytes)}, over the "
            f"budget {format_bytes(self.budget_bytes)}: compiled, it replays fused ops that "
            f"an eager step would keep. Run torch.compile(plan.module), or solve with "
            f"execution=\"eager\" to train eagerly",
            EagerRunWarning, stacklevel=2)


class CompiledRunWarning(UserWarning):
    """A plan solved for eager execution runs under ``torch.compile``, where its budget
    bounds no measured peak."""


#: what `_say_compiled` has said, once each per process
_SAID: set[str] = set()


def _say_compiled(message: str) -> None:
    """Warn ``message`` once (`CompiledRunWarning`). Registered with dynamo as a logging
    function it may reorder (``reorderable_logging_functions``): called from traced code, it
    runs after the compiled graph, at every call of it, with no graph break."""
    if message not in _SAID:
        _SAID.add(message)
        warnings.warn(message, CompiledRunWarning, stacklevel=2)


# (at import, not in the hook's __init__: a hook unpickled in another process imports this
# module, and its call must stay reordered there too)
dynamo_config.reorderable_logging_functions.add(_say_compiled)


class WarnCompiledRun:
    """A forward pre-hook for the module of a plan solved for eager execution: when the
    module runs inside ``torch.compile`` (the whole model compiled: ``torch.compile(
    plan.module)``, ``model.compile()``, ``Trainer(torch_compile=True)``) it warns once that
    the budget bounds the eager step only (`CompiledRunWarning`), and what to do. Eagerly it
    says nothing. (A class, not a closure, so that the module still pickles.)"""

    def __init__(self, budget_bytes: int) -> None:
        self.message = (
            f"this plan was solved for eager execution and runs under torch.compile here: its "
            f"budget {format_bytes(budget_bytes)} bounds the eager step's peak, not the "
            f"compiled one (inductor keeps and reuses memory its own way; a tiny Llama's "
            f"eager plan at 60% measured 0.91-1.04x its budget compiled). To train compiled "
            f"within the budget, solve with execution=\"compiled\" (its compiled step "
            f"measured)")

    def __call__(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            _say_compiled(self.message)


def watch_compiled_run(module: nn.Module, schedule: Schedule) -> None:
    """Register `WarnCompiledRun` on ``module``, which runs ``schedule``, where the schedule
    is for eager execution (``meta["execution"]`` not ``"compiled"``) and has a budget.
    `plan.solve` and `scheduler.apply` both read it from the schedule."""
    if schedule.meta.get("execution", "eager") != "compiled" \
            and schedule.budget_bytes is not None:
        module.register_forward_pre_hook(WarnCompiledRun(schedule.budget_bytes))


def watch_eager_run(module: nn.Module, schedule: Schedule) -> None:
    """Register `WarnEagerRun` on ``module``, which runs ``schedule``, where the schedule is
    for compiled execution (``meta["execution"]``) and its estimate's peak is over its
    ``budget_bytes`` (the budget after headroom, or the one a fitted plan was measured
    against). `plan.solve` and `scheduler.apply` both read it from the schedule, so a plan
    and the module applied from its file warn alike."""
    eager_peak = (schedule.estimate or {}).get("peak_bytes")
    if schedule.meta.get("execution") == "compiled" and eager_peak is not None \
            and schedule.budget_bytes is not None and eager_peak > schedule.budget_bytes:
        module.register_forward_pre_hook(WarnEagerRun(
            eager_peak, schedule.budget_bytes, schedule.meta.get(COMPILED_PEAK)))
