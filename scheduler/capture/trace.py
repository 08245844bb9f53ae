"""Tracing: a model, its example inputs and a loss into one `torch.fx.GraphModule`.

`trace` tries `torch.fx.symbolic_trace` first (module-level nodes, fast, keeps the user's
modules) and falls back to non-strict `torch.export` (ATen-level training IR; handles Hugging
Face models and Python that symbolic tracing cannot follow). Either way the graph computes
``(model_output, loss)`` and `TraceInfo` is attached as ``gm.meta["scheduler"]``.

The default loss (no ``loss_fn``) is deterministic and documented in `default_loss_recipe`.
The user's model is never modified: tracing runs it once under ``torch.no_grad`` with its
buffers restored afterwards.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from . import usercode
from .calls import as_tuple, autocast_state, bare_copy, input_constants, input_specs
from .eager_choices import choices as _choices
from .mutation import alias_groups, mutated_inputs
from .recorded import record_step
from .shapes import any_sizes, export_dims, exported_pattern, hoist_sizes, quiet_auto_dims
from .state import preserved_state

__all__ = ["trace", "TraceError", "TraceInfo", "LossRecipe", "as_tuple",
           "default_loss_recipe", "model_nodes"]

#: Name of the attribute that holds the user's model inside the traced wrapper.
MODEL_ATTR = "model"
_SKIP_TARGETS = {"_guards_fn"}  # export's input guards: not part of the computation


class TraceError(RuntimeError):
    """Neither tracer could capture the model; the message names the failing op and the fix.
    ``needs_values``: the step of a units plan that could be recorded on real tensors
    (`recorded`), traced on fake ones."""

    needs_values = False



@dataclass(frozen=True)
class LossRecipe:
    """How the default loss is computed from the model output's pytree leaves.

    ``kind == "scalar"``: the loss is leaf ``indices[0]`` (the model returned a scalar, or a
    dict/ModelOutput with a scalar ``loss``). ``kind == "mean"``: the loss is the sum of
    ``leaf.mean()`` over the floating-point leaves ``indices``.
    """

    kind: str
    indices: tuple[int, ...]

    def __call__(self, out: Any) -> torch.Tensor:
        leaves = pytree.tree_leaves(out)
        if self.kind == "scalar":
            return leaves[self.indices[0]]
        loss = leaves[self.indices[0]].mean()
        for i in self.indices[1:]:
            loss = loss + leaves[i].mean()
        return loss


def default_loss_recipe(out: Any) -> LossRecipe:
    """The loss used when no ``loss_fn`` is given, decided from a real model output:

    1. a scalar tensor output is the loss;
    2. a dict (or Hugging Face ``ModelOutput``) with a scalar tensor under ``"loss"``: that entry;
    3. otherwise the sum of ``.mean()`` over every floating-point tensor in the output (for a
       single tensor, its mean), which gives every output element a gradient.
    """
    leaves = pytree.tree_leaves(out)
    if isinstance(out, torch.Tensor) and out.numel() == 1 and out.is_floating_point():
        return LossRecipe("scalar", (0,))
    loss = out.get("loss") if hasattr(out, "get") else None
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        idx = next(i for i, t in enumerate(leaves) if t is loss)
        return LossRecipe("scalar", (idx,))
    idxs = tuple(i for i, t in enumerate(leaves)
                 if isinstance(t, torch.Tensor) and t.is_floating_point())
    if not idxs:
        raise TraceError(
            f"the model's output has no floating-point tensor to take a default loss from "
            f"(got {type(out).__name__}); pass loss_fn=lambda out: ... returning a scalar")
    return LossRecipe("mean", idxs)


@dataclass
class TraceInfo:
    """What `trace` learnt, kept in ``gm.meta["scheduler"]``."""

    tracer: str  # "fx" or "export"
    out_spec: pytree.TreeSpec  # spec of (model_output, loss)
    loss_fn: Callable[[Any], torch.Tensor]
    model_outputs: list[str] = field(default_factory=list)  # names of model-output nodes
    loss_nodes: set[str] = field(default_factory=set)  # nodes that only compute the loss
    fallback_reason: str = ""  # why symbolic_trace was not used
    training: bool = True  # the model's ``training`` flag while it was traced
    # (shape, dtype) of each tensor leaf of the inputs it was traced with (None: not a tensor);
    # an exported graph is specialised to them
    input_specs: tuple[tuple[tuple[int, ...], torch.dtype] | None, ...] = ()
    # the non-tensor leaves of those inputs (`input_constants`): both tracers bake them in
    constants: tuple[Any, ...] = ()
    autocast: tuple[tuple[str, Any], ...] = ()  # `autocast_state` while it was traced
    user_checkpoints: tuple[str, ...] = ()  # "file:line" of the model's own checkpoint calls
    unfired_hooks: tuple[usercode.LostHook, ...] = ()  # hooks the plan's step does not run
    # traced with ``dynamic=True``: the input shapes the graph holds for (`shapes.ShapePattern`;
    # None: only ``input_specs``), and its size nodes, moved to its start (`shapes.hoist_sizes`)
    shapes: Any = None
    size_nodes: tuple[str, ...] = ()
    recorded: str = ""  # both tracers' failures, where a units step was recorded as it ran


class _Step(nn.Module):
    """``(model_output, loss)`` of one step: what gets traced. Holds the user's model as a
    submodule (no copy), so traced parameter names are ``model.<name>``."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any], torch.Tensor]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn


def _step_module(model: nn.Module, loss_fn: Callable[[Any], torch.Tensor],
                 n_inputs: int) -> _Step:
    """A `_Step` whose ``forward`` takes exactly ``n_inputs`` named positional arguments
    (``in_0, in_1, ...``): symbolic tracing needs a fixed signature, not ``*args``."""
    names = ", ".join(f"in_{i}" for i in range(n_inputs))
    src = (f"def forward(self, {names}):\n"
           f"    out = self.model({names})\n"
           f"    return out, self.loss_fn(out)\n")
    scope: dict[str, Any] = {}
    exec(compile(src, usercode.STEP_FILE, "exec"), scope)  # noqa: S102 - fixed template
    cls = type("_Step", (_Step,), {"forward": scope["forward"]})
    return cls(model, loss_fn)


def trace(model: nn.Module, example_inputs: Sequence[Any], *,
          loss_fn: Callable[[Any], torch.Tensor] | None = None,
          fake: Any = None, tracer: str | None = None, dynamic: bool = False
          ) -> fx.GraphModule:
    """Capture one forward of ``model`` on ``example_inputs``, plus the loss, as a graph.

    Args:
        model: the model; not modified.
        example_inputs: positional inputs (a tuple; a single tensor is accepted).
        loss_fn: ``loss_fn(model_output) -> scalar``; default: `default_loss_recipe`.
        fake: a `fake.FakeStep`: the forward that finds the output's structure runs under
            it, on fake tensors, so that tracing allocates nothing of activation size (the
            inputs may then be fake tensors of it, and `torch.export` traces with them; a
            model on the meta device is exported with its parameters' fakes in place).
        tracer: ``"fx"`` or ``"export"`` to use that tracer only (a unit is traced with the
            tracer its model's step was); None (default) tries fx, then export.
        dynamic: trace for every size the model's code allows (`shapes`: export with
            ``Dim.AUTO`` dimensions); `TraceInfo.shapes` says for which (None: these only).

    Returns:
        A ``GraphModule`` computing ``(model_output, loss)`` whose parameters are the model's
        own objects, with `TraceInfo` in ``gm.meta["scheduler"]``.

    Raises:
        TraceError: if neither ``torch.fx.symbolic_trace`` nor ``torch.export`` can capture
            the model; the message names the failing op or line and what to do.

    Warns:
        UserCodeWarning: naming the model's own checkpoint calls and hooks the plan won't run.

    Limitation: the graph holds tensor operations only. Python side effects in ``forward`` (a
    counter, appending to a list, printing, reading a global) run while tracing and profiling,
    several times during `solve`, and never in the plan's training step. They cannot be
    detected in general: keep them out of ``forward`` (in the loop, or a root-module hook).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inputs = as_tuple(example_inputs)
    watch = usercode.Watch()  # the model's own checkpoint calls run as plain calls
    recorded = ""  # (`TraceInfo.recorded`)
    probe = fake.active(model) if fake is not None else contextlib.nullcontext()
    answers: list[Any] = []  # (`EAGER_CHOICES`, under `eager_choices`)
    with preserved_state(model), torch.no_grad(), watch.running(), probe, _choices(answers, True):
        out = model(*inputs)
        if loss_fn is None:
            loss_fn = default_loss_recipe(out)
        loss = loss_fn(out)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        raise TraceError(f"loss_fn must return a scalar tensor, got "
                         f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}")
    _, out_spec = pytree.tree_flatten((out, loss))
    step = _step_module(bare_copy(model), loss_fn, len(inputs))

    with watch.running():
        fx_error = ""
        try:
            with preserved_state(model):
                state = list(_state(model))
                before = [t._version for _, t in state]
                if tracer == "export":
                    raise TraceError("the export tracer was asked for")
                gm = fx.symbolic_trace(step)
                written = [name for (name, t), v in zip(state, before) if t._version != v]
            if written:
                # fx ran the write on the real tensor while tracing and recorded nothing
                raise TraceError(f"symbolic trace wrote {written[0]!r} in place outside the "
                                 f"graph")
            used = "fx"
            _check_fx_outputs(gm, out_spec)
            sizes, shapes = [], any_sizes(inputs) if dynamic else None
        except Exception as e:  # noqa: BLE001 - any failure means: try the other tracer
            fx_error = usercode.first_line(e)
            if tracer == "fx":
                raise TraceError(f"could not trace {type(model).__name__} with "
                                 f"torch.fx.symbolic_trace: {fx_error}") from e
            # torch.export bakes the devices it sees into the graph (``arange(device=...)``,
            # ``_assert_tensor_metadata``): a model on the meta device is exported with its
            # fakes in place, on the device the fake step runs on, then given its own back
            swap = fake is not None and _on_meta(model)
            try:
                with (preserved_state(model), usercode.export_quietly(), _choices(answers, False),
                      fake.swapped(step) if swap else contextlib.nullcontext(),
                      quiet_auto_dims()):
                    ep = torch.export.export(step, inputs, strict=False,
                                             dynamic_shapes=export_dims(inputs) if dynamic
                                             else None)
                gm = ep.module()
                sizes = hoist_sizes(gm) if dynamic else None
                shapes = (exported_pattern(gm, ep.range_constraints,
                                           getattr(ep, "_guards_code", None))  # (torch's)
                          if sizes is not None else None)
                if swap:
                    fake.put_back(gm)
                used = "export"
            except Exception as e2:  # noqa: BLE001
                failed = (f"torch.fx.symbolic_trace failed with {fx_error}; torch.export failed "
                          f"with {usercode.first_line(e2)}{usercode.where(e2)}")
                gm = _recorded(model, step, inputs, fake, answers)
                if gm is None:
                    cache = _cache_in(out)
                    if cache is not None:
                        raise TraceError(
                            f"could not trace {type(model).__name__}: its output holds a "
                            f"{cache} (past_key_values: the model runs with use_cache=True), "
                            "which neither tracer can return, and a training step does not "
                            "use it. Set model.config.use_cache = False before solving (or "
                            f"build the model with use_cache=False in its config). ({failed})"
                        ) from e2
                    units = (" The step of a units plan is recorded as it runs where both "
                             "fail, but only with real tensors: profile with mode='real'"
                             if fake is not None and usercode.unit_paths() else "")
                    error = TraceError(
                        f"could not trace {type(model).__name__}: {failed}. Make the failing "
                        "line free of data-dependent Python control flow (branch on shapes, "
                        "not tensor values; use torch.where), move it into the loss via "
                        "loss_fn=..., or wrap the model so it returns tensors only."
                        + units)
                    error.needs_values = bool(units)
                    raise error from e2
                used, sizes, shapes, recorded = "export", None, None, failed
    kept = [module_path(n) for n in model_nodes(gm) if n.op == "call_module"]  # fx's leaves
    info = TraceInfo(tracer=used, out_spec=out_spec, loss_fn=loss_fn,
                     fallback_reason=fx_error, training=model.training,
                     input_specs=input_specs(inputs), constants=input_constants(inputs),
                     autocast=autocast_state(), user_checkpoints=tuple(watch.checkpoints),
                     unfired_hooks=usercode.unfired_hooks(model, watch.called, kept),
                     shapes=shapes, size_nodes=tuple(sizes or ()) if shapes is not None else (),
                     recorded=recorded)
    _classify(gm, info)
    gm.meta["scheduler"] = info
    usercode.warn_user_code(type(model).__name__, used, watch.checkpoints, info.unfired_hooks)
    return gm


def _recorded(model: nn.Module, step: nn.Module, inputs: tuple[Any, ...], fake: Any,
              answers: list[Any]) -> fx.GraphModule | None:
    """The step of a units plan (`usercode.within_units`) on real inputs recorded as it runs
    (`recorded`) where both tracers failed; None otherwise or if recording fails too."""
    if fake is not None or not usercode.unit_paths():
        return None
    try:
        with preserved_state(model), _choices(answers, False):
            return record_step(step, inputs)
    except Exception:  # noqa: BLE001 - the tracers' errors say more
        return None


def _on_meta(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for _, t in _state(model))


def _cache_in(out: Any) -> str | None:
    """The class name of a Hugging Face key/value cache (a ``transformers`` ``Cache``: what a
    model returns as ``past_key_values`` with ``use_cache=True``) among the leaves of a model
    output, or None. Such an object is not a pytree of tensors: no tracer can return it."""
    for leaf in pytree.tree_leaves(out):
        if any(c.__name__ == "Cache" and c.__module__.startswith("transformers.")
               for c in type(leaf).__mro__):
            return type(leaf).__name__
    return None


def _state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def model_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes that run, in order: call_module / call_function / call_method (export's
    input guards excluded)."""
    return [n for n in gm.graph.nodes
            if n.op in ("call_module", "call_function", "call_method")
            and n.target not in _SKIP_TARGETS]


def module_path(node: fx.Node) -> str:
    """Dotted path of the innermost module the node belongs to, without the wrapper prefix."""
    if node.op == "call_module":
        path = str(node.target)
    else:
        stack = node.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else ""
    path = re.sub(r"\[(\d+)\]", r".\1", path.replace("L['self'].", ""))
    path = path.removeprefix(MODEL_ATTR + ".")
    return "" if path == MODEL_ATTR else path


def block_of(path: str) -> str:
    """The outermost repeated block in a module path: the shortest prefix ending in an integer
    index (``transformer.h.3.attn`` -> ``transformer.h.3``); "" when there is none."""
    parts = path.split(".") if path else []
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def _classify(gm: fx.GraphModule, info: TraceInfo) -> None:
    """Split the nodes into the model's and the loss's (`TraceInfo.loss_nodes`).

    A node belongs to the model when a model output depends on it, by data flow or by
    mutation: an in-place write (``copy_``, ``masked_fill_``, ``operator.setitem``, ...) into a
    value that aliases one the model needs, or into a graph input or attribute (state the
    user can observe). Such a write has no reader of its own: by data flow alone it would look
    like dead code and never run (Hugging Face's ``shift_tokens_right`` fills a new tensor
    this way). Everything else only computes the loss, or nothing, and is left to ``loss_fn``.
    """
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    flat = pytree.tree_leaves(out_node.args[0])
    model_leaves = flat[:-1]
    info.model_outputs = [n.name for n in model_leaves if isinstance(n, fx.Node)]
    nodes = model_nodes(gm)
    group = alias_groups(gm, nodes)
    writes = {n: w for n in nodes if (w := mutated_inputs(n))}
    state = {group[n] for n in gm.graph.nodes if n.op in ("placeholder", "get_attr")}
    needed: set[fx.Node] = set()
    stack = [n for n in model_leaves if isinstance(n, fx.Node)]
    while stack:
        while stack:
            n = stack.pop()
            if n in needed:
                continue
            needed.add(n)
            stack.extend(n.all_input_nodes)
        live = state | {group[n] for n in needed}
        stack = [n for n, w in writes.items()
                 if n not in needed and any(group[a] in live for a in w)]
    info.loss_nodes = {n.name for n in nodes if n not in needed}


def _check_fx_outputs(gm: fx.GraphModule, out_spec: pytree.TreeSpec) -> None:
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    n = len(pytree.tree_leaves(out_node.args[0]))
    if n != out_spec.num_leaves:
        raise TraceError(f"symbolic trace returned {n} output leaves, the model "
                         f"{out_spec.num_leaves}")

