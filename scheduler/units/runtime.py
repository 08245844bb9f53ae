"""The planned module of a units plan: the user's model, its own ``forward`` running as
written, with each planned unit replaced by a copy whose ``forward`` runs the unit's regions.

`rewrite_units` copies the model object (`capture.calls.module_copy`: the same class and
parameters, its own dictionaries) and, along the path to each unit with a recompute region,
the modules that hold it, so that the user's model is never modified. The unit's copy is still
called as a module (``unit(*args, **kwargs)`` from the model's code): its hooks, FSDP2's
unshard and reshard among them, run as they would. Its ``forward`` is a `UnitForward`:

* a training call (gradients on, training mode) traces the unit once per call signature
  (the tensor arguments' ranks and dtypes, the other arguments' values, autocast), for
  every size the trace holds for (`capture.shapes`; where it holds for the call's shapes
  only, once per shapes), with the arguments it really receives and the tracer the step was
  profiled with, checks that the trace has the ops, in order, of the unit's call in the
  profiled step, and runs them under the unit's regions (`regions.CheckpointedStep`,
  parameters read live from the unit). Looking a call's step up reads no size, only
  relations the trace needs between them (`capture.shapes.ShapePattern.fits`), so that
  ``torch.compile(..., dynamic=True)`` captures one graph for every size;
* anything else (gradients off, eval mode) runs the unit's own ``forward``;
* what transformers' output-capture hooks inside the unit collect (MoE router logits, hidden
  states) its trace returns, and each planned call hands to the model's collector
  (`capture`);
* a training call whose trace differs from the profiled call runs the unit's own forward
  and warns, as a whole-graph plan's fallback does (`rewrite.PlanForward`); with
  ``on_fallback="raise"`` it raises `rewrite.PlanFallbackError`.

As Hugging Face's own gradient checkpointing does, a training call drops a key/value cache
(``use_cache``, ``cache``, ``past_key_values``, ``layer_past``) with a warning, once; and a
model whose Hugging Face gradient checkpointing is switched on (``Trainer(
gradient_checkpointing=True)``) is refused with one line, since the plan is the checkpointing.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..capture.calls import autocast_state, constant_key, input_specs, module_copy
from ..capture.fingerprint import target_str
from ..capture.trace import model_nodes
from ..cost.compiled_form import flop_saves_meta
from ..ir.graph import CostGraph
from ..ir.region import Region, ScheduleError
from ..ir.replays import check
from ..ir.schedule import Schedule
from ..regions import CheckpointedStep
from ..rewrite import MAX_TRACES, check_on_fallback, first_line, report_fallback
from . import capture
from .cache import NoCacheInTraining, without_cache
from .engine import EngineCheck
from .own import OwnForward, Uncached
from .plans import UnitsPlan, input_shapes
from .share import SharedTraces, kind
from .variants import UnitRun, match_ops, renamed, runs_from_meta, unit_op, unit_runs, with_extras

__all__ = ["UnitForward", "rewrite_units"]

#: how a call says its unit could not be traced (tried again later: it may pass)
UNTRACED = "the unit could not be traced"


def rewrite_units(model: nn.Module, graph: CostGraph, schedule: Schedule, *, tracer: str,
                  why: str = "", on_fallback: str = "warn",
                  loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  inputs: Any = None) -> nn.Module:
    """The planned copy of ``model`` for ``schedule`` over ``graph``, a step profiled with
    units (`CostGraph.units`): the model's own forward, and each unit with a recompute region
    replaced by a copy that runs it (module docstring). ``tracer``: the tracer the step was
    traced with (``"fx"`` or ``"export"``), which the units are traced with too; ``loss_fn``
    and ``inputs``: the step's loss and the inputs it was solved with (a training call with
    other tensor shapes warns once: its memory was predicted for these).

    Raises:
        ScheduleError: a recompute region leaves its unit's call, or a unit with a recompute
            region is called more than once in the step.
    """
    check_on_fallback(on_fallback)
    check(graph, schedule)
    capture.find()  # (transformers' output capture, looked up now: not under compile)
    runs = unit_runs(graph, schedule)
    others = runs_from_meta(schedule)  # (the call variants: `variants`)
    root = module_copy(model)
    copies: dict[str, nn.Module] = {"": root}
    forwards: dict[str, UnitForward] = {}
    once: set[str] = set()  # warnings said once for the whole plan
    shared = SharedTraces()  # one trace per kind of unit and call signature (`share`)
    for path, at_calls in runs.items():
        variants = tuple(others.get(path, ()))
        if not any(r.recomputes for r in (at_calls[0], *variants)):
            if graph.meta.get("autocast"):  # (its own code, with autocast's cache off)
                unit = _copy_path(copies, path)
                unit.__dict__["forward"] = Uncached(unit)
            continue
        if len(at_calls) > 1:
            raise ScheduleError(
                f"unit {path!r} is called {len(at_calls)} times in the step and has a "
                "recompute region: a unit's plan is for one call; name units called once "
                "(units=...)")
        unit = _copy_path(copies, path)
        fwd = UnitForward(unit, at_calls[0], tracer, path=path, on_fallback=on_fallback,
                          once=once, variants=variants, shared=shared)
        unit.__dict__["forward"] = fwd
        forwards[path] = fwd
    plan = UnitsPlan(schedule, why, forwards, loss_fn,
                     input_shapes(inputs) if inputs is not None else ())
    root.__dict__["_scheduler_units"] = plan
    if inputs is not None:
        root.register_forward_pre_hook(plan.check_shapes, with_kwargs=True)
    no_cache = NoCacheInTraining.of(root)
    if schedule.meta.get("execution") == "compiled" and no_cache is not None:
        # (a plan fitted for compile was measured compiled without the cache: its calls run
        # so; an eager plan's step is the same with or without it, eagerly)
        root.register_forward_pre_hook(no_cache, with_kwargs=True)
    root.register_forward_pre_hook(EngineCheck(graph.units, schedule.meta.get("parallel")))
    for name in ("gradient_checkpointing_enable", "activation_checkpointing_enable"):
        if callable(getattr(model, name, None)):
            root.__dict__[name] = _refuse_hf_checkpointing
    return root


def _refuse_hf_checkpointing(*args: Any, **kwargs: Any) -> None:
    raise ValueError(
        "this model runs a checkpointing plan (scheduler.solve), which is its gradient "
        "checkpointing: Hugging Face's would checkpoint on top of it. Train without "
        "gradient_checkpointing (TrainingArguments(gradient_checkpointing=False), the default)")


def _copy_path(copies: dict[str, nn.Module], path: str) -> nn.Module:
    """A copy of the module at ``path`` installed in the copied tree, copying its parents
    that are not copies yet (``copies`` maps the paths copied so far)."""
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        here = ".".join(parts[:i])
        if here not in copies:
            parent = copies[".".join(parts[:i - 1])]
            copies[here] = module_copy(parent._modules[parts[i - 1]])
            parent._modules[parts[i - 1]] = copies[here]
    return copies[path]


class _UnitCall(nn.Module):
    """What a unit's trace traces: the unit's own forward (no hooks: its copy's ``__call__``
    runs those) on one call's arguments, the tensor leaves as positional inputs."""

    def __init__(self, unit: nn.Module, forward: Callable[..., Any], spec: Any,
                 consts: tuple[Any, ...], collector: dict[str, Any] | None):
        super().__init__()
        self.unit = unit
        self._call = (forward, spec, consts)
        self.collector = collector  # (transformers' output capture: `capture`)
        self.where: tuple = ()

    def forward(self, *tensors: torch.Tensor) -> Any:
        forward, spec, consts = self._call
        it = iter(tensors)
        leaves = [next(it) if c is _TENSOR else c for c in consts]
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        if self.collector is None:
            return forward(self.unit, *args, **kwargs)
        with capture.recording(self.collector) as stand:
            out = forward(self.unit, *args, **kwargs)
        extra, self.where = capture.recorded(stand)
        return out, extra


_TENSOR = object()  # a tensor leaf's place among a call's constants


class UnitForward(OwnForward):
    """The ``forward`` of a planned unit's copy (module docstring).

    Attributes:
        path: the unit's module path in the model.
        run: the unit's call in the profiled step, a `variants.UnitRun`: its ops, its
            regions (nodes named by position: ``"#0"``, ``"#1"``, ...) and the save-set nodes
            that save only their ops with FLOPs under ``torch.compile``
            (`cost.compiled_form.flop_saves`); ``regions``, ``ops`` and ``flop_saves`` are
            its.
        variants: the `variants.UnitRun` of its call at the step's other variants (a padded
            batch, a compiled step: `variants`); a call runs the regions of the first run
            whose ops its trace has, the profiled one first.
        planned_steps, fallback_steps: training calls that ran the regions, and that ran
            the unit's own forward instead; inside compiled code too (a tensor the graph adds
            to at each run: the count stays true under ``torch.compile``).
        on_fallback: ``"warn"`` or ``"raise"``.
        trial: while True, a call whose step cannot be traced runs the unit's own forward
            and keeps no record of it (no warning, no count, traced again at the next).
    """

    def __init__(self, unit: nn.Module, run: UnitRun, tracer: str, *, path: str,
                 on_fallback: str = "warn", once: set[str] | None = None,
                 variants: tuple[UnitRun, ...] = (), shared: SharedTraces | None = None):
        super().__init__(unit)
        self.run, self.variants, self.tracer = run, variants, tracer
        self.regions, self.ops, self.flop_saves = run.regions, run.ops, run.flop_saves
        self.path = path
        self._steps: dict[Any, CheckpointedStep | str] = {}  # per call signature and shapes
        # per call signature but its sizes: a step traced for all sizes (`capture.shapes`), or
        # None where the first trace was not (the steps are then per shapes, in ``_steps``)
        self._generic: dict[Any, CheckpointedStep | None] = {}
        self._where: dict[Any, tuple] = {}  # per key: where its captured outputs go
        self._untraced: dict[Any, int] = {}  # per key: unplanned calls for want of a trace
        self._warned: set[str] = set()
        self._once = once if once is not None else set()  # shared by the plan's units
        self._shared = shared if shared is not None else SharedTraces()  # (`share`)
        self._kind = kind(unit, self.base)
        self._shared.join(self._kind)
        self._planned = self._fallen = 0  # eager calls; calls inside compiled code in:
        self._counted = torch.zeros(2, dtype=torch.int64)
        self.on_fallback = check_on_fallback(on_fallback)
        self.trial = False  # (`step.warm_up`'s compiled-call pass: a step not traced is dropped)

    def __getstate__(self) -> dict[str, Any]:  # (traces do not copy or pickle)
        return {**vars(self), "_steps": {}, "_generic": {}, "_warned": set(), "_where": {},
                "_untraced": {}}

    @property
    def planned_steps(self) -> int:
        """Training calls that ran the unit's regions, eagerly or inside compiled code."""
        return self._planned + int(self._counted[0])

    @planned_steps.setter
    def planned_steps(self, n: int) -> None:
        self._planned = n
        self._counted[0] = 0

    @property
    def fallback_steps(self) -> int:
        """Training calls that ran the unit's own forward instead, eagerly or compiled."""
        return self._fallen + int(self._counted[1])

    @fallback_steps.setter
    def fallback_steps(self, n: int) -> None:
        self._fallen = n
        self._counted[1] = 0

    @property
    def traces(self) -> int:
        """How many traced, scheduled steps it holds (one per call signature where the trace
        holds for all its sizes, else per signature and shapes)."""
        return sum(isinstance(s, CheckpointedStep) for s in (*self._steps.values(),
                                                             *self._generic.values()))

    def __repr__(self) -> str:  # noqa: D105
        rc = sum(r.policy != "keep" for r in self.regions)
        return f"UnitForward({self.path!r}, {len(self.regions)} regions, {rc} recomputed)"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not (torch.is_grad_enabled() and self.module.training):
            return self.own(*args, **kwargs)
        if getattr(self.module, "gradient_checkpointing", False):
            _refuse_hf_checkpointing()
        kwargs = without_cache(kwargs, self.path, self._once)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = tuple(x for x in leaves if isinstance(x, torch.Tensor))
        consts = tuple(_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves)
        collector = capture.active()
        # the call's signature but its sizes (read no size here: under torch.compile with
        # dynamic shapes, the graph then holds for every size the unit's trace holds for)
        base = (str(spec), tuple("<tensor>" if c is _TENSOR else constant_key(c)
                                 for c in consts), tuple((t.dim(), t.dtype) for t in tensors),
                autocast_state(), capture.signature(collector))
        key, step = base, self._generic.get(base)
        if step is None or not step.info.shapes.fits(tensors):
            key = (*base, input_specs(tensors))
            step = self._steps.get(key)
            if step is None:
                key, step = self._new_step(base, key, spec, consts, tensors, collector)
        if isinstance(step, str):
            if self.trial:  # (a call that may never come: said, or raised, when it does)
                del self._steps[key]
                return self.own(*args, **kwargs)
            self._fall_back(step)
            if step.startswith(UNTRACED):  # (what failed may pass: tried again at the
                # signature's 2nd, 4th, 8th, ... unplanned call)
                n = self._untraced[key] = self._untraced.get(key, 0) + 1
                if n & (n - 1) == 0:
                    self._steps.pop(key, None)
                    if self._generic.get(base, False) is None:
                        del self._generic[base]
            return self.own(*args, **kwargs)
        if torch.compiler.is_compiling():
            self._counted[0].add_(1)  # (a tensor: in the graph, counted at every run of it)
        else:
            self._planned += 1
        if collector is None:
            return step(tensors)
        out, extra = step(tensors)
        capture.replay(collector, self._where[key], extra)
        return out

    def _new_step(self, base: Any, key: Any, spec: Any, consts: tuple[Any, ...],
                  tensors: tuple[torch.Tensor, ...], collector: dict[str, Any] | None
                  ) -> tuple[Any, CheckpointedStep | str]:
        """The key and step of a call with no step yet: at a signature's first call, its
        trace for all sizes (`capture.shapes`) under ``base``; where that is not one (a size
        baked in, ops other than the profiled ones, a failure), a trace for these shapes
        under ``key``, as at the signature's calls at shapes the first trace does not fit."""
        if base not in self._generic:
            step = self._trace(base, spec, consts, tensors, collector, dynamic=True)
            ok = isinstance(step, CheckpointedStep) and step.info.shapes is not None
            self._generic[base] = step if ok and step.info.shapes.fits(tensors) else None
            if self._generic[base] is not None:
                return base, step
        if len(self._steps) + len(self._generic) >= MAX_TRACES:
            step = f"it was called with more than {MAX_TRACES} signatures"
        else:
            step = self._trace(key, spec, consts, tensors, collector, dynamic=False)
        self._steps[key] = step
        return key, step

    @torch.compiler.disable
    def _trace(self, key: Any, spec: Any, consts: tuple[Any, ...],
               tensors: tuple[torch.Tensor, ...], collector: dict[str, Any] | None,
               dynamic: bool) -> CheckpointedStep | str:
        forward = self.base if not self._bound else (lambda unit, *a, **k: self.base(*a, **k))
        call = _UnitCall(self.module, forward, spec, consts, collector)
        # (a sibling of the same kind that traced this signature and ran the same ops: its
        # trace, read with this unit's parameters, `share`)
        skey = (self._kind, key, dynamic) if self._kind is not None else None
        try:
            gm, captured, like, ops = self._shared.graph(skey, call, self.module, tensors,
                                                         tracer=self.tracer, dynamic=dynamic)
        except RuntimeError as e:
            return f"{UNTRACED} at this call ({first_line(e)})"
        finally:
            call.collector = None  # (the user's: not kept)
        self._where[key] = captured
        info = gm.meta["scheduler"]
        sizes = tuple(n for n in info.size_nodes if n not in info.loss_nodes)
        nodes = [n for n in model_nodes(gm) if n.name not in info.loss_nodes
                 and n.name not in sizes]
        got = tuple(unit_op(n.op, target_str(n), "unit") for n in nodes)
        run, where = next(((r, w) for r in (self.run, *self.variants)
                           if (w := match_ops(got, r.ops)) is not None), (None, None))
        if run is None or where is None:
            at = next((i for i, (x, y) in enumerate(zip(got, self.ops)) if x != y),
                      min(len(got), len(self.ops)))
            held = f" nor of its {len(self.variants)} planned variant(s)" if self.variants else ""
            return (f"at this call the unit traces to other ops than its call in the profiled "
                    f"step{held} ({len(got)} against {len(self.ops)}; first difference at op "
                    f"{at}: {got[at][1] if at < len(got) else None!r} against "
                    f"{self.ops[at][1] if at < len(self.ops) else None!r}); solve for the "
                    "inputs you train with")
        rel = {f"#{j}": n.name for n, j in zip(nodes, where) if j is not None}
        # (views the trace for all sizes holds and the profiled one did not: each runs with
        # the op after it)
        before: dict[str, list[str]] = {}
        pending: list[str] = []
        for n, j in zip(nodes, where):
            if j is None:
                pending.append(n.name)
            elif pending:
                before[n.name], pending = pending, []
        try:
            first = [Region("keep", sizes)] if sizes else []  # (size nodes: kept, first)
            regions = with_extras([renamed(r, rel) for r in run.regions], before, pending)
            schedule = Schedule(first + regions,
                                meta=flop_saves_meta(rel[n] for n in run.flop_saves))
            step = CheckpointedStep(gm, schedule, root=call, like=like)
        except (ScheduleError, AttributeError) as e:
            if isinstance(e, AttributeError) and like is None:
                raise
            # (a sibling's trace reads an attribute this unit lacks: never met, but loud)
            return f"the unit's regions do not run at this call ({first_line(e)})"
        self._shared.add(skey, step.prog, ops, captured)
        return step

    def _fall_back(self, why: str) -> None:
        if torch.compiler.is_compiling():
            self._counted[1].add_(1)
        else:
            self._fallen += 1
        n = self.fallback_steps
        message = (f"unit {self.path!r} runs its own forward, not the checkpointed plan: "
                   f"{why}. It computes the same values, but its memory is not what the plan "
                   "predicted")
        report_fallback(message, why, self._warned, self.on_fallback,
                        f"{n} call(s) of it have run unplanned so far, "
                        f"{self.planned_steps} planned", n, stacklevel=3)

