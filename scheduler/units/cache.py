"""A units plan in training runs without a key/value cache: the keywords that hold one
(`CACHE_KWARGS`, dropped from a unit's call) and, for a plan fitted for compile, the root's
pre-hook that turns ``use_cache`` off (`NoCacheInTraining`), as Hugging Face's gradient
checkpointing does."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
import torch.nn as nn

__all__ = ["CACHE_KWARGS", "NoCacheInTraining", "without_cache"]

#: keyword arguments holding a key/value cache, dropped in training (Hugging Face's names)
CACHE_KWARGS = {"use_cache": False, "cache": None, "past_key_values": None, "layer_past": None}


def without_cache(kwargs: dict[str, Any], path: str, once: set[str]) -> dict[str, Any]:
    """A training call's keywords to unit ``path`` without a key/value cache (`CACHE_KWARGS`),
    said once per plan (``once``: the plan's warnings said so far) where one was passed."""
    dropped = [k for k in CACHE_KWARGS if kwargs.get(k) not in (None, False)]
    if not dropped:
        return kwargs
    if "cache" not in once and not torch.compiler.is_compiling():
        # (not under compile: a warning breaks the graph; eager calls say it)
        once.add("cache")
        warnings.warn(
            f"the plan's units (first {path!r}) were called with a key/value cache in "
            f"training ({', '.join(dropped)}); the plan runs them without one, as Hugging "
            "Face's gradient checkpointing does (set use_cache=False to silence this)",
            UserWarning, stacklevel=3)
    return {k: (CACHE_KWARGS[k] if k in dropped else v) for k, v in kwargs.items()}


class NoCacheInTraining:
    """A forward pre-hook of the root of a units plan fitted for ``torch.compile``
    (``execution="compiled"``: `runtime.rewrite_units` registers it there only, by `of`)
    whose ``forward`` takes ``use_cache``: a training call (module in training mode,
    gradients on) runs with ``use_cache=False``, as Hugging Face's gradient checkpointing
    runs it, and as the step was profiled and its compiled peak measured
    (`units.step.without_cache`). The units drop a cache in training anyway, so the model
    would return an empty one; but with its cache on, the model's own code outside the units
    runs otherwise, and under ``torch.compile`` that step measured 4.06 MB against 3.13 MB
    without it (a tiny Llama planned at 3.45 MB). Said once, at an eager call that asked
    for the cache (under compile a warning would break the graph). (A class, not a
    closure, so that the module still pickles.)"""

    def __init__(self, position: int | None) -> None:
        self.position = position  # (of ``use_cache`` among the positional parameters)
        self.warned = False

    @staticmethod
    def of(root: nn.Module) -> "NoCacheInTraining | None":
        """The hook for ``root``, where its ``forward`` takes ``use_cache`` and the model's
        config turns the cache on (``config.use_cache``); else None: only then is it needed,
        and a module without it compiles as before (with it, a model compiled with
        ``dynamic=True`` measured two graphs where it had one, no graph break)."""
        if not getattr(getattr(root, "config", None), "use_cache", False):
            return None
        try:
            params = list(inspect.signature(root.forward).parameters.values())
        except (TypeError, ValueError):
            return None
        for i, p in enumerate(params):
            if p.name == "use_cache":
                return NoCacheInTraining(i if p.kind == p.POSITIONAL_OR_KEYWORD else None)
        return None

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not (module.training and torch.is_grad_enabled()) or kwargs.get("use_cache") is False:
            return None
        if self.position is not None and len(args) > self.position:
            return None  # (given by position: the units drop the cache, and say so)
        asked = kwargs.get("use_cache")
        if asked is None:
            asked = getattr(getattr(module, "config", None), "use_cache", False)
        if not asked:
            return None  # (the call as it is runs without a cache)
        if not self.warned and not torch.compiler.is_compiling():
            self.warned = True
            warnings.warn(
                "the plan runs its training calls with use_cache=False (asked for a cache, "
                "or the model's config turns it on): its units drop a key/value cache in "
                "training, as Hugging Face's gradient checkpointing does, and the step was "
                "planned without one (set use_cache=False, or model.config.use_cache = False, "
                "to silence this)",
                UserWarning, stacklevel=2)
        return args, {**kwargs, "use_cache": False}
