"""transformers' output capture inside a planned unit.

transformers (5.x) hands tensors computed inside one forward of a model to that forward's
output through forward hooks on inner modules (`capture.usercode.LIBRARY_HOOKS`: MoE router
logits for the auxiliary loss, hidden states, attentions): the model's forward opens a
*collector* (a dict of lists, in a context variable), the hooks append to it, and the model
reads it when its forward ends. A planned unit runs its traced regions, not its inner
modules, so their hooks would not fire; and its trace, which calls them, would append the
trace's own tensors to the user's collector (autograd then fails with "Tried to backward()
through example input").

So a unit's trace runs with a stand-in collector (`recording`: the same keys, lists that
report the user's lengths, so that hooks which index by length append the same), its
traced program returns what the hooks appended as extra outputs, and each planned call
appends those, computed by the regions, to the user's collector (`replay`) in the order the
hooks would have. `signature` is part of a unit call's key: another set of keys or lengths is
another trace.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["active", "find", "recorded", "recording", "replay", "signature"]

MODULE = "transformers.utils.output_capturing"


#: transformers' collector variable, once `find` has found its module imported (eagerly): under
#: ``torch.compile`` `active` reads it here, never ``sys.modules`` (dynamo would guard on the
#: length of ``sys.modules``, and any later import would compile the unit again)
_FOUND: list[Any] = []


def active() -> dict[str, Any] | None:
    """The collector transformers' output capture has open now, or None (also for an empty
    one: no hook appends to it, and a unit compiled by itself cannot read the one transformers
    opened eagerly). Under ``torch.compile`` the one transformers opened there (its
    ``CompileableContextVar`` keeps it in a plain attribute while compiling: dynamo cannot read
    a ``ContextVar``)."""
    if torch.compiler.is_compiling():
        if not _FOUND or not getattr(_FOUND[0], "compiling", False):
            return None
        return _FOUND[0].global_var or None
    find()
    return (_FOUND[0].get() or None) if _FOUND else None


def find() -> None:
    """Look for transformers' output capture, eagerly (`rewrite_units` calls it as it builds a
    plan, so that a plan compiled before any eager call still reads the collector)."""
    mod = None if _FOUND else sys.modules.get(MODULE)
    if mod is not None:
        _FOUND.append(mod._active_collector)


def signature(collector: dict[str, Any] | None) -> tuple | None:
    """What a unit's trace depends on of ``collector``: each key with its list's length, or
    its setting's value (``_hidden_states_layers``)."""
    if collector is None:
        return None
    return tuple((k, ("list", len(v)) if _captured(k, v) else ("value", repr(v)))
                 for k, v in collector.items())


class _Recorder(list):
    """A list that reports, as its length, the user's list's (``base``) plus its own."""

    def __init__(self, base: int):
        super().__init__()
        self.base = base

    def __len__(self) -> int:
        return self.base + super().__len__()

    def own(self) -> list[Any]:
        return [list.__getitem__(self, i) for i in range(super().__len__())]


@contextlib.contextmanager
def recording(collector: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Within it, output-capture hooks append to a stand-in of ``collector`` (yielded)."""
    var = sys.modules[MODULE]._active_collector
    stand = {k: _Recorder(len(v)) if _captured(k, v) else v for k, v in collector.items()}
    token = var.set(stand)
    try:
        yield stand
    finally:
        var.reset(token)


def recorded(stand: dict[str, Any]) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """The tensors the hooks appended to a stand-in, and where each goes: ``(key, index into
    the tensors)``, or ``(key, None)`` for an appended None."""
    tensors: list[torch.Tensor] = []
    where: list[tuple[str, int | None]] = []
    for k, v in stand.items():
        if isinstance(v, _Recorder):
            for x in v.own():
                if isinstance(x, torch.Tensor):
                    where.append((k, len(tensors)))
                    tensors.append(x)
                else:
                    where.append((k, None))
    return tuple(tensors), tuple(where)


def replay(collector: dict[str, Any], where: tuple, tensors: tuple[torch.Tensor, ...]
           ) -> None:
    """Append a planned call's captured ``tensors`` to the user's ``collector``."""
    for k, i in where:
        collector[k].append(None if i is None else tensors[i])


def _captured(key: str, value: Any) -> bool:
    return isinstance(value, list) and not key.startswith("_")
