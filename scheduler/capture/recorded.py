"""The step of a units plan recorded as it runs, for a model whose own code outside the units
neither tracer can follow (`record_step`).

A units plan runs the model's own ``forward`` as written and takes over only its units'
calls (`scheduler.units`), so the step's graph is needed only to profile it: what the code
between and around the units allocates, saves for backward and costs. Where that code reads
tensor values (a loss that checks its labels, ``nonzero`` of a mask, CTC's loss whose output
size depends on the targets, a layer drop drawn per step), ``torch.fx`` and ``torch.export``
both fail. `record_step` runs the step once on the real inputs under ``make_fx``, each value
read where it is read, and keeps the ATen ops it ran, in the form ``torch.export`` gives them
(pre-dispatch), each with the module path it ran in (``nn_module_stack``, as export records
it): the step that runs at these inputs. The units are then traced by ``torch.export`` at
their calls, as for any units plan; their own code must be traceable.

What the recording read from values it keeps as constants, so the graph is this batch's step
only: never a whole-graph plan's step (which would run it for every batch), and only with
real inputs (a fake tensor has no values). Two choices are made for the profile:

* a Hugging Face layer drop (``config.layerdrop``, ``encoder_layerdrop``,
  ``decoder_layerdrop``, which skips each layer at random in training) is off while
  recording, so that every unit is called: the step profiled is the largest the model runs;
* the random draws the recording makes are torch's, restored after it (`trace`); NumPy's
  global generator (wav2vec2's time masks) is restored too.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.modules import module as torch_module

__all__ = ["LAYER_DROPS", "record_step"]

#: Hugging Face config attributes that skip whole layers at random in training
LAYER_DROPS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


def record_step(step: nn.Module, inputs: tuple[Any, ...]) -> fx.GraphModule:
    """The ATen graph of one run of ``step`` (a `trace._Step`) on ``inputs`` (real tensors),
    recorded as it runs (module docstring). Parameters and buffers are ``get_attr`` nodes
    named by their paths in ``step`` (``model.<path>``), as an exported graph names them;
    other tensors the code made from values are constants of the graph.

    Raises:
        whatever the step raises when run (the caller reports it).
    """
    with _module_stack(step), _no_layer_drop(step), _numpy_rng():
        with fx_traceback.preserve_node_meta():
            gm = make_fx(lambda *args: step(*args), tracing_mode="real", pre_dispatch=True,
                         _error_on_data_dependent_ops=False)(*inputs)
    return _named_state(gm, step)


@contextlib.contextmanager
def _module_stack(step: nn.Module) -> Iterator[None]:
    """While recording: each node gets the module stack it was created in, as
    ``node.meta["nn_module_stack"]`` (``{path: (path, class)}``, outermost first), from
    global module hooks around every call of a module of ``step``."""
    paths = {id(m): p for p, m in step.named_modules() if p}
    stack: list[tuple[str, str]] = []

    def publish() -> None:
        fx_traceback.get_current_meta()["nn_module_stack"] = {p: (p, c) for p, c in stack}

    def enter(module: nn.Module, args: Any) -> None:
        path = paths.get(id(module))
        if path is not None:
            stack.append((path, f"{type(module).__module__}.{type(module).__qualname__}"))
            publish()

    def leave(module: nn.Module, args: Any, out: Any) -> None:
        path = paths.get(id(module))
        if path is not None and stack and stack[-1][0] == path:
            stack.pop()
            publish()

    pre = torch_module.register_module_forward_pre_hook(enter)
    post = torch_module.register_module_forward_hook(leave, always_call=True)
    try:
        yield
    finally:
        pre.remove()
        post.remove()


@contextlib.contextmanager
def _no_layer_drop(step: nn.Module) -> Iterator[None]:
    """Hugging Face configs' layer drops (`LAYER_DROPS`) at 0 while recording, restored."""
    saved: list[tuple[Any, str, Any]] = []
    seen: set[int] = set()
    for m in step.modules():
        config = getattr(m, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        for name in LAYER_DROPS:
            value = getattr(config, name, None)
            if isinstance(value, (int, float)) and value > 0:
                saved.append((config, name, value))
                setattr(config, name, 0.0)
    try:
        yield
    finally:
        for config, name, value in saved:
            setattr(config, name, value)


@contextlib.contextmanager
def _numpy_rng() -> Iterator[None]:
    state = np.random.get_state()
    try:
        yield
    finally:
        np.random.set_state(state)


def _named_state(gm: fx.GraphModule, step: nn.Module) -> fx.GraphModule:
    """``gm`` with its ``get_attr`` nodes that read a parameter or buffer of ``step`` renamed
    to that tensor's path in ``step``, on a module that holds them there (as
    ``torch.export``'s ``module()`` does); constants keep their names."""
    named = {id(t): n for n, t in (*step.named_parameters(), *step.named_buffers())}
    attrs: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = _attr(gm, node.target)
        name = named.get(id(value)) if isinstance(value, torch.Tensor) else None
        if name is not None:
            node.target = name
        attrs[node.target] = value
    out = fx.GraphModule(attrs, gm.graph)
    out.meta.update(gm.meta)
    return out


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
