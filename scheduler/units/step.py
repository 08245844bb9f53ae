"""A profiled step fitted to its units: the inputs it is profiled with (`without_cache`), the
units it keeps (`called_once`), and the profile itself (`profile_units`)."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from copy import deepcopy
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from ..capture.eager_choices import compiled_choices, eager_choices
from ..capture.profile import profile_step
from ..capture.state import preserved_state
from ..capture.autocast_cache import caches_casts
from ..capture.usercode import UserCodeWarning, within_units
from ..budget import InfeasibleBudgetError
from ..cost.compiled import costs_for
from ..cost.simulate import simulate
from ..distributed import param_groups, process_group, same_schedule
from ..quantities import format_bytes
from ..parallel import FSDP2, ParallelError, parse_parallel, per_rank
from ..ir.graph import CostGraph
from ..ir.replays import unit_calls
from .find import UnitChoice, find_units
from ..ir.schedule import Schedule
from ..rewrite import rewrite
from .plans import units_plan
from .runtime import rewrite_units
from .variants import VariantWarning, unit_runs, variant_inputs, variant_record

__all__ = ["called_once", "gives_positions", "in_param_dtype", "plan_variants", "planned_module",
           "profile_units", "profile_variants", "trainer_keywords", "warm_up", "without_cache"]


def gives_positions(model: nn.Module, example_inputs: Any) -> bool:
    """Whether the example inputs give the model ``position_ids`` (else a Hugging Face model
    makes them, one sequence per row: `capture.trace.eager_choices`' ``unpacked``)."""
    if isinstance(example_inputs, Mapping):
        return example_inputs.get("position_ids") is not None
    try:
        bound = inspect.signature(model.forward).bind_partial(*example_inputs)
    except (TypeError, ValueError):
        return True
    return bound.arguments.get("position_ids") is not None


def without_cache(model: nn.Module, example_inputs: Any) -> Any:
    """Keyword inputs with ``use_cache=False`` added where the model's ``forward`` takes
    ``use_cache`` and they do not set it: a Hugging Face config defaults to ``use_cache=True``,
    whose cache no tracer can return, and which the units drop in training anyway (as
    Hugging Face's gradient checkpointing does), so the step profiled is the one that runs."""
    if not isinstance(example_inputs, Mapping) or "use_cache" in example_inputs:
        return example_inputs
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return example_inputs
    if "use_cache" not in params:
        return example_inputs
    return {**example_inputs, "use_cache": False}


def called_once(graph: CostGraph, choice: UnitChoice) -> UnitChoice:
    """``choice`` less the units the profiled step calls more than once (a shared module:
    its plan would be for one call) or never; no units at all when fewer than two remain
    (the whole-graph plan then has the larger space), with the reason in ``why``."""
    if not choice.paths:
        return choice
    probe = dataclasses.replace(graph, units=choice.paths)
    counts: dict[str, int] = {}
    for path, _, _ in unit_calls(probe):
        counts[path] = counts.get(path, 0) + 1
    keep = tuple(p for p in choice.paths if counts.get(p) == 1)
    shared = [p for p in choice.paths if counts.get(p, 0) > 1]
    note = (f"; {len(shared)} called more than once left to the model's code ({shared[0]}, ...)"
            if shared else "")
    if len(keep) < 2:
        return UnitChoice((), f"{choice.why}, but fewer than two are called once in the step"
                              f"{note}: one traced graph for the whole step")
    return UnitChoice(keep, choice.why + note)


def profile_units(model: nn.Module, example_inputs: Any, units: Any, *, parallel: Any = None,
                  **kwargs: Any
                  ) -> tuple[fx.GraphModule, CostGraph, tuple[Any, ...], UnitChoice]:
    """`capture.profile.profile_step` of ``model`` as `scheduler.solve` profiles it for
    ``units`` (`find.find_units`): with units, the eager step (`capture.eager_choices`,
    `without_cache`) and the graph's ``units`` set to those called once (`called_once`).
    With ``parallel`` (`parallel.parse_parallel`: ``"ddp"``, ``"fsdp2"``, ...), the graph is
    one rank's (`parallel.per_rank`), and FSDP2 plans with units by default; with an FSDP2
    ``param_dtype``, the step profiled is a copy's in that dtype (`in_param_dtype`), the
    parameters' shards keep the model's dtype.
    Returns the traced step, the graph, the positional inputs and the units chosen."""
    engine = parse_parallel(parallel, *process_group())
    units = "auto" if isinstance(engine, FSDP2) and units == "default" else units
    choice = find_units(model, units)
    unpacked = not gives_positions(model, example_inputs)
    given = without_cache(model, example_inputs) if choice.paths else example_inputs
    dtype = getattr(engine, "param_dtype", None)
    run, originals = model, {}
    if dtype is not None:  # (as FSDP2's MixedPrecisionPolicy runs the step)
        if not choice.paths:
            raise ParallelError(
                f"{engine.describe()} is modelled for a plan with units (each one "
                f"fully_shard-ed), not for a whole-graph plan (units={units!r}): solve with "
                "units='auto', or without param_dtype for the model cast to the dtype it runs in")
        run, given, originals = in_param_dtype(model, given, getattr(torch, dtype))
        if kwargs.get("small_inputs") is not None:
            kwargs["small_inputs"] = [in_param_dtype(None, x, getattr(torch, dtype))[1]
                                      for x in kwargs["small_inputs"]]
    with (eager_choices(unpacked=unpacked) if choice.paths else contextlib.nullcontext(),
          within_units(choice.paths)):
        gm, graph, inputs = profile_step(run, given, **kwargs)
    found, choice = choice, called_once(graph, choice)
    if choice.paths != found.paths and caches_casts():
        # (the plan's code runs with autocast's cache off, and was profiled so: the units
        # left out run as the model's own code, with the cache, so the step is profiled again;
        # as a whole graph, all of it is the plan's)
        with (eager_choices(unpacked=unpacked) if found.paths else contextlib.nullcontext(),
              within_units(choice.paths)):
            gm, graph, inputs = profile_step(run, given, **kwargs)
    inputs = pytree.tree_map(lambda x: originals.get(id(x), x), inputs)
    if choice.paths:
        graph = dataclasses.replace(graph, units=choice.paths)
    if engine is not None:
        graph = per_rank(graph, engine, param_groups(model, choice.paths))
    return gm, graph, inputs, choice


def profile_variants(model: nn.Module, example_inputs: Any, graph: CostGraph,
                     choice: UnitChoice, **kwargs: Any
                     ) -> list[tuple[str, CostGraph | str]]:
    """The step's call variants (`variants.variant_inputs`: a compiled step's explicit mask,
    a padded or unpadded batch) whose units run other ops than in ``graph``, the step
    `profile_units` profiled at ``example_inputs`` with units ``choice``: ``(name, graph)``
    for each, profiled as ``graph`` was (``kwargs``), one per distinct set of unit ops; or
    ``(name, why)`` for one that could not be profiled with the same units."""
    seen = {_unit_ops(graph)}
    out: list[tuple[str, CostGraph | str]] = []
    for name, inputs, context in variant_inputs(model, example_inputs):
        try:
            with context(), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserCodeWarning)  # (said of the main step)
                _, g, _, got = profile_units(model, inputs, list(choice.paths), **kwargs)
        except Exception as e:  # noqa: BLE001 - said, and its calls run unplanned (warned)
            out.append((name, f"its step could not be profiled ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''})"))
            continue
        if got.paths != choice.paths:
            out.append((name, f"its units differ ({got.why})"))
            continue
        ops = _unit_ops(g)
        if ops not in seen:
            seen.add(ops)
            out.append((name, g))
    return out


def plan_variants(model: nn.Module, example_inputs: Any, graph: CostGraph, choice: UnitChoice,
                  budget_bytes: int, say: Callable[[str], None], profile_kw: dict[str, Any],
                  solve: Callable[[CostGraph], Any], execution: str) -> list[dict[str, Any]]:
    """The step's call variants (`profile_variants`) profiled as ``profile_kw`` says and
    solved by ``solve`` (`scheduler.solve_graph` under the plan's budget, ``budget_bytes``),
    as the schedule records them (``meta[variants.VARIANTS]``: `variants.variant_record`). A
    variant that cannot be profiled, or fits no schedule (``solve`` raises
    `InfeasibleBudgetError`), is said (`variants.VariantWarning`): its calls run the unit's
    own forward, warned. Under ``torch.distributed`` each schedule is rank 0's."""
    out = []
    for name, vgraph in profile_variants(model, example_inputs, graph, choice, **profile_kw):
        if isinstance(vgraph, str):
            warnings.warn(f"units' calls at the step's {name!r} variant cannot be planned: "
                          f"{vgraph}; such calls run the unit's own forward (warned)",
                          VariantWarning, stacklevel=3)
            continue
        say(f"solving the {name!r} variant of the step")
        try:
            res = solve(vgraph)
        except InfeasibleBudgetError as e:
            least = (f"; its least feasible peak is {format_bytes(e.min_feasible_bytes)}"
                     if e.min_feasible_bytes is not None else "")
            warnings.warn(
                f"units' calls at the step's {name!r} variant (their ops differ from the "
                f"profiled step's) fit no schedule within {format_bytes(budget_bytes)}{least}: "
                "such calls run the unit's own forward, warned; solve with a larger budget, "
                "or for the batches you train with", VariantWarning, stacklevel=3)
            continue
        sched = same_schedule(res.schedule, graph=vgraph)
        peak = simulate(costs_for(vgraph, execution), sched).peak_bytes
        out.append(variant_record(name, vgraph, sched, peak, {
            "solver": res.solver, "status": res.status,
            "space": res.schedule.meta.get("space")}))  # (None: the solver names none)
    return out


def _unit_ops(graph: CostGraph) -> tuple[Any, ...]:
    return tuple(sorted((path, tuple(r.ops for r in runs))
                        for path, runs in unit_runs(graph, Schedule.none(graph)).items()))


def in_param_dtype(model: nn.Module | None, example_inputs: Any, dtype: torch.dtype
                   ) -> tuple[nn.Module | None, Any, dict[int, torch.Tensor]]:
    """A copy of ``model`` whose floating parameters are ``dtype`` (buffers as they are) and
    the inputs with their floating tensors cast to it, as ``fully_shard`` with
    ``MixedPrecisionPolicy(param_dtype=dtype)`` runs the step (the root's pre-forward casts
    the inputs); and ``{id(cast input): the input}``. ``model`` is not changed."""
    originals: dict[int, torch.Tensor] = {}

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            y = x.to(dtype)
            originals[id(y)] = x
            return y
        return x

    inputs = pytree.tree_map(cast, example_inputs)
    if model is None:
        return None, inputs, originals
    copy = deepcopy(model)
    with torch.no_grad():
        for p in copy.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)
    return copy, inputs, originals


def warm_up(module: nn.Module, inputs: tuple[Any, ...]) -> None:
    """Forwards of a units plan's ``module`` on the inputs it was solved with (gradients on;
    buffers, gradients and RNG restored after; its counts reset): each unit traces its call
    now rather than at the first training call, so that ``torch.compile(module)`` meets
    traced units and captures the step in one graph. Twice: as an eager call passes the
    units their arguments, and as a compiled one does (`capture.eager_choices.
    compiled_choices`: Hugging Face builds an attention mask under ``torch.compile`` that it
    skips eagerly; a unit called with it at its first compiled call would trace there, a
    graph break). And, for a model `transformers.Trainer` passes its loss keywords, once more
    with them (`trainer_keywords`): its layers receive them too, another call signature,
    which a compiled step would otherwise trace at its first call (a graph break)."""
    plan = units_plan(module)
    if plan is None or not module.training:
        return
    calls: list[dict[str, Any]] = [{}, *([trainer] if (trainer := trainer_keywords(
        module, inputs)) else [])]
    for as_compiled in (False, True):
        for forward in plan.forwards.values():
            forward.trial = as_compiled  # (a call the compiled step may never make)
        try:
            for keywords in calls:
                with (preserved_state(module), torch.enable_grad(),
                      compiled_choices() if as_compiled else contextlib.nullcontext()):
                    module(*inputs, **keywords)
        finally:
            for forward in plan.forwards.values():
                forward.trial = False
    for forward in plan.forwards.values():
        forward.planned_steps = forward.fallback_steps = 0


def trainer_keywords(module: nn.Module, inputs: tuple[Any, ...]) -> dict[str, Any] | None:
    """The keywords `transformers.Trainer` adds to a training call of ``module`` beside the
    batch: ``num_items_in_batch`` (a 0-dimensional float tensor on the model's device) where
    the model accepts loss keywords (its ``accepts_loss_kwargs``, else a ``**kwargs`` in its
    ``forward``, as Trainer decides), and the inputs bind a ``labels`` argument; else None."""
    if not type(module).__module__.startswith("transformers."):
        return None
    try:
        params = inspect.signature(module.forward).parameters
        bound = inspect.signature(module.forward).bind_partial(*inputs).arguments
    except (TypeError, ValueError):
        return None
    accepts = getattr(module, "accepts_loss_kwargs", None)
    if accepts is None:
        accepts = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    if not accepts or bound.get("labels") is None:
        return None
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    return {"num_items_in_batch": torch.tensor(1.0, device=device)}


def planned_module(gm: fx.GraphModule, graph: CostGraph, schedule: Schedule,
                   model: nn.Module, inputs: tuple[Any, ...], *, why: str = "",
                   on_fallback: str = "warn") -> nn.Module:
    """The module that runs ``schedule`` on the step `profile_units` profiled: inside the
    units (`runtime.rewrite_units`) where ``graph`` has them, else the traced step
    (`rewrite.rewrite`)."""
    if not graph.units:
        return rewrite(gm, schedule, model, on_fallback=on_fallback)
    info = gm.meta["scheduler"]
    return rewrite_units(model, graph, schedule, tracer=info.tracer, why=why,
                         on_fallback=on_fallback, loss_fn=info.loss_fn, inputs=inputs)
