"""A units plan's unit copy running the unit's own code: its ``forward`` is the one the
instance overrides or its class's (`OwnForward`); a planned unit's (`runtime.UnitForward`)
falls back to it, and a unit the plan keeps whole runs it with autocast's cache off
(`Uncached`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..capture.autocast_cache import cache_off, caches_casts

__all__ = ["OwnForward", "Uncached"]


class OwnForward:
    """Holds ``unit`` (``module``) and its own forward (``base``: the instance's override,
    already bound, or its class's function), which `own` calls."""

    def __init__(self, unit: nn.Module):
        self.module = unit
        base = unit.__dict__.get("forward")  # (a forward the instance already overrides)
        self.base = base if base is not None else type(unit).forward
        self._bound = base is not None

    def own(self, *args: Any, **kwargs: Any) -> Any:
        """The unit's own forward."""
        if self._bound:
            return self.base(*args, **kwargs)
        return self.base(self.module, *args, **kwargs)


class Uncached(OwnForward):
    """The ``forward`` of a unit the plan keeps whole (no recompute region, so it runs its own
    code): that code with autocast's cache off, as the profile recorded every unit's
    (`capture.program.Program.planned`); the cast weights are then freed as backward uses
    them, not held until autocast exits. Off under ``torch.compile`` (whose graphs cache no
    casts)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or not caches_casts():
            return self.own(*args, **kwargs)
        with cache_off():
            return self.own(*args, **kwargs)
