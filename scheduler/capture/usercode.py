"""What the user's code does that a traced plan will not: its own checkpointing and its hooks.

`trace` captures a model's forward as one graph and the plan runs that graph, so two things
the user wrote stop working, and this module finds them while tracing:

* **The model's own ``torch.utils.checkpoint`` calls** (`plain_checkpoints`). The plan
  decides what to recompute, so the model is traced as if it did not checkpoint: every call
  runs its function plainly (export would otherwise capture a reentrant call as a no-grad
  region running to the end of the step: no gradients) and the place it was called from is
  recorded. `checkpoint` reads ``CheckpointFunction`` and
  ``_checkpoint_without_reentrant_generator`` from its module at each call, so replacing those
  two names while tracing sees every call, however ``checkpoint`` was imported or wrapped
  (``from torch.utils.checkpoint import checkpoint``, ``functools.partial``, Hugging Face's
  ``_gradient_checkpointing_func``, ``checkpoint_sequential``), at no measurable cost to the
  trace. A call of ``CheckpointFunction.apply`` itself, bypassing ``checkpoint``, is not seen.
  Calls from other threads are left to the real functions.
* **Module hooks that will not fire** (`unfired_hooks`): forward, forward-pre and backward
  hooks of the submodules the trace inlines, and global module hooks, which fire only for the
  modules the plan still calls. The root model's own hooks are kept by the plan. Hooks that a
  library installs to pass tensors from inside one forward of the model to its output
  (`LIBRARY_HOOKS`: transformers' output capture, which returns MoE router logits, hidden
  states and attentions) are not lost: that data flow is in the traced graph, and they do
  nothing else.

`warn_user_code` says so in one `UserCodeWarning` per finding, with the way out.
`export_quietly` holds back what a failing ``torch.export`` of the user's code prints.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.nn.modules import module as torch_module

__all__ = ["UserCodeWarning", "LostHook", "LIBRARY_HOOKS", "STEP_FILE", "Watch",
           "plain_checkpoints", "called_modules", "export_quietly", "first_line",
           "is_library_hook", "unfired_hooks", "unit_paths", "warn_user_code", "is_user_file",
           "where", "within_units", "user_stacklevel"]

#: File name of the generated step module's ``forward`` (scheduler code, not the user's).
STEP_FILE = "<scheduler step>"
# torch's and this package's own files, by location: a user's file may well live under a
# directory that is merely *named* "scheduler" or "torch" (e.g. a checkout of this project)
_OWN = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)

#: (attribute of an `nn.Module` / of `torch.nn.modules.module`, the kind of hook it holds)
_HOOKS = (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"),
          ("_backward_pre_hooks", "backward pre-hook"), ("_backward_hooks", "backward hook"))


#: ``(module, function name)`` of hooks that libraries install on a model's submodules whose
#: only effect is to hand tensors computed inside one forward of the model to that forward's
#: output, through a collector the model's own forward opens and closes around the call: the
#: traced graph computes those outputs directly, so a plan loses nothing when they do not
#: run. transformers (5.x) installs ``output_capturing_hook`` on the layers named in a model's
#: ``_can_record_outputs`` (router logits for the MoE auxiliary loss, hidden states,
#: attentions).
LIBRARY_HOOKS = (("transformers.utils.output_capturing", "output_capturing_hook"),)


class UserCodeWarning(UserWarning):
    """Something the user's model does will not happen as written in the plan's step."""


@dataclass(frozen=True)
class LostHook:
    """A hook that the plan's training step does not run.

    ``module`` is the dotted path of the submodule it is registered on, or None for a global
    module hook (``torch.nn.modules.module.register_module_forward_hook`` and friends); ``kind``
    is ``"forward hook"``, ``"forward pre-hook"``, ``"backward hook"`` or
    ``"backward pre-hook"``; ``hook`` names the hook function.
    """

    module: str | None
    kind: str
    hook: str


def is_user_file(filename: str) -> bool:
    """Whether a frame's file is the user's: not torch's, not this package's, not the step."""
    return filename != STEP_FILE and not os.path.abspath(filename).startswith(_OWN)


def user_stacklevel() -> int:
    """The ``stacklevel`` for a warning its caller issues that names the first frame outside
    this package (the user's call of `scheduler.profile`, `solve`, ...), however many of the
    package's own frames lie between."""
    level, frame = 1, sys._getframe(1)  # stacklevel 1 is the caller itself
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        level, frame = level + 1, frame.f_back
    return level


def first_line(e: BaseException, limit: int = 400) -> str:
    """``"Type: first line of the message"``, cut at ``limit`` characters (an error quoted
    inside one of ours)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:limit]


def where(e: BaseException) -> str:
    """The innermost user-code frame of a traceback, as ' (at file:line: code)'."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if is_user_file(f.filename)]
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {f.filename}:{f.lineno}: {f.line})"


def _caller() -> str:
    """``file:line`` of the innermost user-code frame on the current stack."""
    frame = sys._getframe(1)
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"


class Watch:
    """What the user's code does inside `running` blocks: ``checkpoints``, the places it calls
    ``torch.utils.checkpoint`` from (`plain_checkpoints`), and ``called``, the ids of the
    modules it calls (`called_modules`). `trace` watches every run of the model, the tracers'
    too: the first, eager one runs without gradients, and Hugging Face's layers checkpoint
    only with gradients enabled."""

    def __init__(self) -> None:
        self.checkpoints: list[str] = []
        self.called: set[int] = set()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        with plain_checkpoints(self.checkpoints), called_modules(self.called):
            yield


@contextlib.contextmanager
def plain_checkpoints(places: list[str]) -> Iterator[None]:
    """Run ``torch.utils.checkpoint.checkpoint`` calls of this thread as plain calls of their
    function, adding the ``file:line`` each is called from to ``places`` (once per place)."""
    owner = threading.get_ident()
    real_function, real_generator = (torch_checkpoint.CheckpointFunction,
                                     torch_checkpoint._checkpoint_without_reentrant_generator)

    def record() -> None:
        place = _caller()
        if place not in places:
            places.append(place)

    class PlainFunction:
        """Stands in for ``CheckpointFunction``: ``checkpoint`` calls only its ``apply``."""

        @staticmethod
        def apply(function: Any, preserve_rng_state: bool, *args: Any) -> Any:
            if threading.get_ident() != owner:
                return real_function.apply(function, preserve_rng_state, *args)
            record()
            return function(*args)

    def plain_generator(*args: Any, **kwargs: Any) -> Iterator[None]:
        # ``checkpoint`` runs the function between the first and the second ``next``
        if threading.get_ident() != owner:
            yield from real_generator(*args, **kwargs)
            return
        record()
        yield

    torch_checkpoint.CheckpointFunction = PlainFunction  # type: ignore[misc,assignment]
    torch_checkpoint._checkpoint_without_reentrant_generator = plain_generator
    try:
        yield
    finally:
        torch_checkpoint.CheckpointFunction = real_function  # type: ignore[misc]
        torch_checkpoint._checkpoint_without_reentrant_generator = real_generator


@contextlib.contextmanager
def called_modules(called: set[int]) -> Iterator[None]:
    """Add the ``id`` of every module called (through ``__call__``) inside the block to
    ``called``."""
    handle = torch_module.register_module_forward_pre_hook(
        lambda mod, args: called.add(id(mod)))
    try:
        yield
    finally:
        handle.remove()


def unfired_hooks(model: nn.Module, called: set[int],
                  kept: Collection[str] = ()) -> tuple[LostHook, ...]:
    """The hooks of ``model`` that the plan's step does not run.

    Args:
        model: the user's model; its own (root) hooks are kept by the plan.
        called: ids of the modules its forward called (`called_modules`); hooks of modules it
            never calls do not fire in the original either.
        kept: dotted paths of the submodules the plan still calls through ``__call__`` (fx's
            ``call_module`` leaves); their hooks and their descendants' fire.

    `LIBRARY_HOOKS` are left out: what they do is in the graph.
    """

    def is_kept(path: str) -> bool:
        return path == "" or any(k == "" or path == k or path.startswith(k + ".")
                                 for k in kept)

    inlined = [(path, mod) for path, mod in model.named_modules()
               if id(mod) in called and not is_kept(path)]
    lost = [LostHook(path, kind, _name(hook)) for path, mod in inlined
            for attr, kind in _HOOKS for hook in getattr(mod, attr).values()
            if not is_library_hook(hook)]
    if inlined:
        lost += [LostHook(None, kind, _name(hook)) for attr, kind in _HOOKS
                 for hook in getattr(torch_module, "_global" + attr).values()
                 if not is_library_hook(hook)]
    return tuple(lost)


def is_library_hook(hook: Any) -> bool:
    """Whether ``hook`` is one of `LIBRARY_HOOKS`, by its function's module and name (the
    last part of its qualified name: they are closures)."""
    fn = getattr(hook, "func", hook)  # functools.partial
    module = getattr(fn, "__module__", None)
    name = (getattr(fn, "__qualname__", None) or "").rsplit(".", 1)[-1]
    return (module, name) in LIBRARY_HOOKS


def _name(hook: Any) -> str:
    fn = getattr(hook, "func", hook)  # functools.partial
    return getattr(fn, "__qualname__", None) or type(fn).__name__


_UNITS = threading.local()


@contextlib.contextmanager
def within_units(paths: Collection[str]) -> Iterator[None]:
    """While tracing the step of a units plan (``paths``: its units): only hooks on modules
    inside a unit are lost (the model's own code and the units themselves are called as
    modules), so `warn_user_code` names only those."""
    before = getattr(_UNITS, "paths", ())
    _UNITS.paths = tuple(paths)
    try:
        yield
    finally:
        _UNITS.paths = before


def unit_paths() -> tuple[str, ...]:
    """The units of the plan whose step is being traced (`within_units`); () otherwise."""
    return getattr(_UNITS, "paths", ())


def warn_user_code(model_name: str, tracer: str, checkpoints: Collection[str],
                   hooks: Collection[LostHook]) -> None:
    """Warn (`UserCodeWarning`) about the model's own checkpoint calls and its lost hooks
    (under `within_units`, those inside the units)."""
    units = getattr(_UNITS, "paths", ())
    if units:
        hooks = [h for h in hooks if h.module is None
                 or any(h.module.startswith(u + ".") for u in units)]
    if checkpoints:
        _warn(f"{model_name} calls torch.utils.checkpoint itself (at {', '.join(checkpoints)}). "
              "The plan replaces the model's own checkpointing: it was traced without it, and "
              "a budget given as a fraction (0.85, \"85%\") is a fraction of the peak without "
              "it, usually well above your model's current peak. To keep a budget relative to "
              "your model's current peak, give it in bytes (e.g. \"6GiB\"), or disable your "
              "checkpointing before solving (Hugging Face: "
              "model.gradient_checkpointing_disable(), in newer versions "
              "model.activation_checkpointing_disable()).")
    if hooks:
        names = "; ".join(f"{h.kind} {h.hook} on " + (
            repr(h.module) if h.module is not None
            else "every module (global; the inlined ones will not run it)") for h in hooks)
        where_to = ("unit itself or on a module outside the units (those are called as "
                    "modules: their hooks fire)" if units else
                    "root model (its hooks fire) or on a leaf module, one the trace calls as "
                    "a module (torch.nn layers such as nn.Linear)" if tracer == "fx" else
                    "root model (its hooks fire; the export path inlines every submodule)")
        why = ("the plan's units run them as traced regions" if units else
               "the trace inlines the modules they belong to")
        _warn(f"{model_name}: these module hooks will not run in the plan's training step, "
              f"because {why}: {names}. They ran while "
              "tracing: what a forward hook computes on tensors is part of the traced graph, "
              "but nothing else it does (recording, counting, logging) happens in the plan's "
              f"step, and backward hooks on these modules do not run at all. Register the hook "
              f"on the {where_to}, or, for a hook that changes tensors, compute that in the "
              "model's forward."
              + (_HF_INPUT_GRADS if any(h.hook.endswith("make_inputs_require_grads")
                                        for h in hooks) else ""))


_HF_INPUT_GRADS = (" (make_inputs_require_grads is the hook Hugging Face's gradient "
                   "checkpointing adds so that reentrant checkpoints get gradients; the plan "
                   "does not need it: model.disable_input_require_grads() removes it.)")


def _warn(message: str) -> None:
    """Warn at the first frame outside this package: the user's call of solve/trace."""
    level, frame = 2, sys._getframe(1)  # stacklevel 2 is this function's caller
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, UserCodeWarning, stacklevel=level)


@contextlib.contextmanager
def export_quietly() -> Iterator[None]:
    """Hold back what a failing ``torch.export`` prints (its partial graph on stderr, a
    symbolic-shapes warning): ``trace.TraceError`` says what failed. On success it is printed."""
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    held = io.StringIO()
    shapes_log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(held):
            yield
    finally:
        shapes_log.setLevel(level)
    sys.stderr.write(held.getvalue())
