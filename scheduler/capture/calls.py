"""What one call of a model is specialised to, and the copies of a model that get traced.

A traced graph bakes in the non-tensor arguments of the call it was traced on
(`input_constants`) and the autocast state (`autocast_state`); `module_copy` and `bare_copy`
make new objects of the model's class that share all of its state, for the planned module and
for tracing.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

__all__ = ["as_tuple", "autocast_state", "bare_copy", "bind_call", "call_inputs",
           "check_differentiable", "constant_key", "input_constants", "input_specs", "module_copy"]

_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
               "_backward_pre_hooks")


def check_differentiable(model: nn.Module, inputs: Any) -> None:
    """Raise before any run when nothing in a training step of ``model`` can require grad.

    A step is ``loss.backward()``; with every parameter frozen and no input requiring grad,
    torch fails deep inside it ("element 0 of tensors does not require grad").

    Raises:
        ValueError: naming the model, how many parameters it has, and the fix.
    """
    params = list(model.parameters())
    if any(p.requires_grad for p in params):
        return
    if any(isinstance(t, torch.Tensor) and t.requires_grad
           for t in pytree.tree_leaves(inputs)):
        return
    what = (f"all {len(params)} parameters of {type(model).__name__} are frozen "
            f"(requires_grad=False)" if params else f"{type(model).__name__} has no parameters")
    raise ValueError(f"nothing requires grad: {what} and no input requires grad, so a training "
                     f"step has no backward pass to checkpoint; unfreeze some parameters "
                     f"(model.requires_grad_(True)) or give an input with requires_grad=True")


def input_specs(inputs: Sequence[Any]) -> tuple[tuple[tuple[int, ...], torch.dtype] | None, ...]:
    """(shape, dtype) of each leaf of ``inputs`` that is a tensor, None for the others."""
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else None
                 for x in pytree.tree_leaves(tuple(inputs)))


def input_constants(inputs: Sequence[Any]) -> tuple[Any, ...]:
    """The non-tensor leaves of ``inputs``, each as `constant_key`."""
    return tuple(constant_key(x) for x in pytree.tree_leaves(tuple(inputs))
                 if not isinstance(x, torch.Tensor))


def constant_key(x: Any) -> Any:
    """A non-tensor argument as part of a call's key: ``(type, value)`` (``True``, ``1`` and
    ``1.0`` are equal in Python but not the same argument), its ``repr`` where unhashable."""
    try:
        hash(x)
    except TypeError:
        return repr(x)
    return (type(x), x)


def autocast_state() -> tuple[tuple[str, Any], ...]:
    """``(device type, dtype)`` of each device type autocast is enabled for right now, then
    ``("cache", "off")`` where it is enabled with its cache of parameter casts off
    (``cache_enabled=False``): the casts are then tensors a checkpoint frees, not held all
    step, so a plan's memory differs (`capture.autocast_cache`)."""
    state = tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
                  if torch.is_autocast_enabled(d))
    return state + (("cache", "off"),) if state and not torch.is_autocast_cache_enabled() \
        else state


def module_copy(model: nn.Module, *, hooks: bool = True) -> nn.Module:
    """A new object of ``model``'s class sharing its submodules, parameters, buffers and
    attributes, with its own dictionaries of them (registering on the copy leaves the original
    alone); without the root's forward and backward hooks when ``hooks`` is False."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    module = model.__class__.__new__(model.__class__)
    state = {k: (v.copy() if isinstance(v, (dict, set)) else v) for k, v in vars(model).items()}
    if not hooks:
        for name in _HOOK_DICTS:
            if name in state:
                state[name] = type(state[name])()
    module.__dict__.update(state)
    return module


def bare_copy(model: nn.Module) -> nn.Module:
    """What `trace` traces: `module_copy` without root hooks (the planned module's own
    ``__call__`` fires those; traced too, they would run twice) and with a plan's ``forward``
    (an instance attribute with a ``base``) replaced by the model's own."""
    module = module_copy(model, hooks=False)
    fwd = module.__dict__.get("forward")
    if fwd is not None and hasattr(fwd, "schedule") and hasattr(fwd, "base"):
        del module.__dict__["forward"]
        if fwd.base is not None:
            module.__dict__["forward"] = fwd.base
    return module


def bind_call(forward: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
              ) -> tuple[Any, ...] | None:
    """A call ``forward(*args, **kwargs)`` as positional arguments: the parameters up to the
    last one given, in order, those left out before it at their defaults (what a keyword call
    such as ``model(input_ids=x, labels=y)`` means). None when it cannot be written so: an
    argument the signature does not take, a left-out parameter without a default, or
    ``*args``/``**kwargs`` among those parameters."""
    if not kwargs:
        return tuple(args)
    try:
        signature = inspect.signature(forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())
    last = max(i for i, p in enumerate(params) if p.name in bound.arguments)
    out = []
    for p in params[:last + 1]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.KEYWORD_ONLY):
            return None
        if p.name in bound.arguments:
            out.append(bound.arguments[p.name])
        elif p.default is not p.empty:
            out.append(p.default)
        else:
            return None
    return tuple(out)


def call_inputs(model: nn.Module, example_inputs: Any) -> tuple[Any, ...]:
    """Example inputs as the positional tuple that gets traced: a tuple or list as it is, a
    single tensor as a 1-tuple, a mapping (a Hugging Face-style batch,
    ``{"input_ids": ..., "labels": ...}``) bound to ``model.forward``'s parameters
    (`bind_call`).

    Raises:
        TypeError: a mapping whose keys do not bind to the model's forward as positional
            arguments (the message names the keys and the signature).
    """
    if isinstance(example_inputs, Mapping):
        got = bind_call(bare_copy(model).forward, (), dict(example_inputs))
        if got is None:
            raise TypeError(
                f"the example inputs' keys {sorted(example_inputs)} do not bind to "
                f"{type(model).__name__}.forward{_signature_text(bare_copy(model))} as positional "
                f"arguments (a key it does not take, a parameter left out without a default "
                f"before a given one, or **kwargs); pass the inputs as a tuple instead")
        return got
    return as_tuple(example_inputs)


def as_tuple(example_inputs: Any) -> tuple[Any, ...]:
    """Positional example inputs as a tuple: a tuple as it is, a list or one tensor wrapped."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    if not isinstance(example_inputs, tuple):
        raise TypeError(f"example_inputs must be a tuple of positional inputs, got "
                        f"{type(example_inputs).__name__}; a dict of keyword inputs "
                        f"goes to solve/apply, which bind it to the model's forward")
    return example_inputs


def _signature_text(model: nn.Module) -> str:
    try:
        return str(inspect.signature(model.forward))
    except (TypeError, ValueError):
        return "(...)"
