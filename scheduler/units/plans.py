"""What a units plan's module carries (`UnitsPlan`, found by `units_plan`): its units'
`runtime.UnitForward`s and the counts over them, and the check that a training call's
shapes are those the plan was solved for."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..ir.schedule import Schedule
from ..rewrite import check_on_fallback

if TYPE_CHECKING:
    from .runtime import UnitForward

__all__ = ["UnitsPlan", "input_shapes", "show_shapes", "units_plan"]


class UnitsPlan:
    """What a units plan's module carries (``units_plan(module)``, or `rewrite.planned`): the
    units, their `UnitForward`s by path, and the counts over them.

    Attributes:
        schedule: the `Schedule` over the profiled step.
        why: why these units (`find.UnitChoice.why`).
        forwards: ``{unit path: UnitForward}`` of the units that have a recompute region.
        loss_fn: the loss the step was profiled with (used by `scheduler.measure`).
        solved_specs: the ``(shape, dtype)`` of each tensor the step was solved with, sorted.
    """

    def __init__(self, schedule: Schedule, why: str, forwards: dict[str, "UnitForward"],
                 loss_fn: Callable[[Any], torch.Tensor] | None = None,
                 solved_specs: tuple[Any, ...] = ()):
        self.schedule, self.why, self.forwards = schedule, why, forwards
        self.loss_fn, self.solved_specs, self._warned_shapes = loss_fn, solved_specs, False

    @property
    def planned_steps(self) -> int:
        """Training steps in which every planned unit ran its regions (the least count of
        any planned unit's calls that did)."""
        return min((f.planned_steps for f in self.forwards.values()), default=0)

    @property
    def fallback_steps(self) -> int:
        """Training steps in which some planned unit ran its own forward instead (the most
        of any one unit's)."""
        return max((f.fallback_steps for f in self.forwards.values()), default=0)

    @property
    def traces(self) -> int:
        """The most traced steps any planned unit holds (`runtime.UnitForward.traces`)."""
        return max((f.traces for f in self.forwards.values()), default=0)

    def check_shapes(self, module: nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> None:
        """A forward pre-hook of the planned module: warn once when a training call has a
        tensor larger in some dimension than every tensor of its rank and dtype that the step
        was solved with, or of another rank or dtype (its memory was predicted for those; a
        shorter batch, or a padding mask beside the ids, fits what was predicted).

        Not under ``torch.compile``: comparing sizes there would guard on them (with
        ``dynamic=True``, a graph per length) and a warning breaks the graph; an eager
        training call at other shapes says it (docs/limitations.md)."""
        if (self._warned_shapes or torch.compiler.is_compiling()
                or not (torch.is_grad_enabled() and module.training)):
            return
        got = input_shapes((args, kwargs))
        # (a tensor more or fewer of a shape solved for, such as a padding mask beside the ids,
        # is a call variant the plan holds, not other shapes: `variants`)
        if not all(_within(spec, self.solved_specs) for spec in got):
            self._warned_shapes = True
            warnings.warn(
                f"the plan runs its schedule on tensor inputs of shapes and dtypes "
                f"{show_shapes(got)}, but it was solved for "
                f"{show_shapes(self.solved_specs)}: its predicted peak memory holds for that "
                "call's size and smaller ones. Solve for the largest inputs you train with",
                RuntimeWarning,
                stacklevel=3)

    @property
    def planned_calls(self) -> int:
        """Training calls of the planned units that ran their regions."""
        return sum(f.planned_steps for f in self.forwards.values())

    @property
    def fallback_calls(self) -> int:
        """Training calls of the planned units that ran the unit's own forward instead."""
        return sum(f.fallback_steps for f in self.forwards.values())

    @property
    def on_fallback(self) -> str:
        return next(iter(self.forwards.values())).on_fallback if self.forwards else "warn"

    @on_fallback.setter
    def on_fallback(self, value: str) -> None:
        for f in self.forwards.values():
            f.on_fallback = check_on_fallback(value)

    def __repr__(self) -> str:
        return (f"UnitsPlan({len(self.forwards)} planned units, {self.planned_calls} planned "
                f"calls, {self.fallback_calls} fallback calls)")


def input_shapes(tree: Any) -> tuple[Any, ...]:
    """The sorted ``(shape, dtype)`` of the tensors in ``tree`` but scalars (a loss keyword
    such as Trainer's ``num_items_in_batch`` is one: it moves no memory)."""
    return tuple(sorted((tuple(t.shape), str(t.dtype).removeprefix("torch."))
                        for t in pytree.tree_leaves(tree)
                        if isinstance(t, torch.Tensor) and t.dim() > 0))


def _within(spec: tuple[Any, str], solved: tuple[Any, ...]) -> bool:
    shape, dtype = spec
    return any(d == dtype and len(s) == len(shape) and all(a <= b for a, b in zip(shape, s))
               for s, d in solved)


def show_shapes(specs: tuple[Any, ...]) -> str:
    """`input_shapes` as a warning shows them: ``[([2, 128], 'int64'), ...]``."""
    return str([(list(s), d) for s, d in specs])


def units_plan(module: nn.Module) -> UnitsPlan | None:
    """The `UnitsPlan` of a module `rewrite_units` returned (None for any other module)."""
    got = module.__dict__.get("_scheduler_units") if isinstance(module, nn.Module) else None
    return got if isinstance(got, UnitsPlan) else None
