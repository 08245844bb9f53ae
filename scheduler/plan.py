"""The public entry points that tie the pipeline together: `profile`, `solve`, `solve_graph`,
`apply`.

``solve`` traces and profiles a model once, solves for a schedule under a budget and rewrites
the model into a `Plan`; ``profile`` (`profiling`) is its first step alone, the `CostGraph`
to save and solve later; ``solve_graph`` is the torch-free middle step on a `CostGraph`; ``apply``
(`reapply`) re-applies a saved schedule without solving.
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .budget import InfeasibleBudgetError, budget_spec, infeasible_error, parse_budget
from .capture.profile import check_profile_options
from .compiled_fit import (
    COMPILED_PEAK,
    compile_and_measure,
    fit_compiled_form,
    warn_unmeasured,
)
from .cost.compiled import check_execution, costs_for
from .cost.compiled_form import compiled_form
from .cost.simulate import simulate
from .distributed import check_unwrapped, process_group, same_schedule
from .ir.graph import CostGraph
from .ir.schedule import Schedule
from .parallel import parse_parallel
from .plan_result import Plan
from .profiling import profile
from .reapply import apply
from .rewrite import check_on_fallback
from .run_watch import watch_compiled_run, watch_eager_run
from .solvers.base import INFEASIBLE, SolveResult, get_solver
from .solvers.chain import applies as chain_applies
from .solvers.deadline import within
from .solvers.stash import solve_with_rng_stash
from .step_checks import INPUT_SHAPES, input_shapes, own_peak
from .units import profile_units, warm_up
from .units.step import plan_variants, planned_module
from .units.variants import VARIANTS
from .units.apply import stamped, units_meta
from .quantities import check_time_limit, format_bytes

__all__ = ["INPUT_SHAPES", "Plan", "apply", "input_shapes", "profile", "solve", "solve_graph"]


def _variant_solve(graph: CostGraph, budget_bytes: int, *, solver: str, **kw: Any
                   ) -> SolveResult:
    """A call variant's schedule (`units.step.plan_variants`): with ``solver="auto"``, the
    exact chain DP over unit calls first (`solvers.chain`: deterministic, a fraction of a
    second, no clock), kept where it fits the budget; else, and for a named solver,
    `solve_graph` as the step was solved. A variant runs only on the batches it is met on
    (padded or not), so its schedule needs the budget first and the least recompute over a
    stated space second; the step's own schedule keeps the full solve."""
    if solver == "auto" and chain_applies(graph):
        try:
            result = solve_graph(graph, budget_bytes, solver="chain", **kw)
        except InfeasibleBudgetError:
            result = None
        if result is not None and result.fits:
            return result
    return solve_graph(graph, budget_bytes, solver=solver, **kw)


def solve_graph(graph: CostGraph | str | Path, budget: int | float | str, *,
                solver: str = "auto",
                time_limit_s: float | None = 30.0, headroom: float = 0.0,
                execution: str = "eager", measured: bool = False) -> SolveResult:
    """Solve a profiled graph for the schedule with the least recompute time within a budget.

    Args:
        graph: the profiled `CostGraph`, or the path of one saved (`CostGraph.save`,
            ``scheduler profile``): no model is needed.
        budget: see `parse_budget`; fractions refer to ``simulate(graph, Schedule.none(graph))``.
        solver: a registered solver name (`scheduler.solvers.available`), e.g. ``"auto"``,
            ``"dp"``, ``"greedy"``, ``"uniform:4"``.
        time_limit_s: the seconds this call may take to solve: the solver (the baselines
            ignore it), certifying its result (`solvers.certify.certify`) and the solves
            again with more room for the RNG state that checkpoints stash
            (`solvers.stash`) all keep to one deadline, so the call returns within it and
            what runs past it (bounded and small: `solvers.deadline`). A finite number of
            seconds > 0, or None for no limit (`units.check_time_limit`).
        headroom: fraction of the budget held back for error in the cost model: the solver gets
            ``budget * (1 - headroom)``. In [0, 1); default 0, because the budget given here
            is the step's peak the caller asks for (`advise` and `max_batch`, which start
            from a device's memory, default to 0.1).
        execution: how the plan's step will run, which sets what a replay costs:
            ``"eager"`` (default: as profiled) or ``"compiled"``, for ``torch.compile`` of the
            plan's module (`cost.compiled`: matmuls, convolutions and attention replay at
            their eager time, the ops that fuse into backward's kernels and the checkpoint's
            machinery cost nothing, and it stashes no RNG state). Peaks are the eager cost
            model's either way. A schedule for ``"compiled"`` is returned in its compiled form
            (`cost.compiled_form`: per block one selective checkpoint that replays the ops
            without FLOPs it can), in every block whose form keeps the predicted peak within
            the budget.
        measured: with ``"compiled"``, the caller measures the compiled step's peak against
            the budget (`solve`'s `compiled_fit.fit_compiled_form`): every block takes its
            compiled form, even where the eager predicted peak is then above the budget.

    Returns:
        The solver's `SolveResult`, certified: ``OPTIMAL`` or ``FEASIBLE`` over the full
        schedule space, under ``execution``'s time model (its estimate's recompute is that
        model's; ``schedule.meta["execution"]`` names it); its ``budget_bytes`` is the
        budget after headroom.

    Raises:
        InfeasibleBudgetError: the solver found nothing that fits; the message names the
            smallest feasible budget.
        UnknownSolverError: ``solver`` is not registered (the message lists valid names).
        ValueError: a bad budget, time limit, headroom or execution.
    """
    time_limit_s = check_time_limit(time_limit_s)
    if not isinstance(measured, bool):
        raise ValueError(f"measured must be True or False, got {measured!r}")
    if not (isinstance(headroom, numbers.Real) and 0 <= headroom < 1):
        raise ValueError(f"headroom must be a fraction in [0, 1), got {headroom!r}")
    get_solver(solver)  # (an unknown name fails before anything runs)
    if not isinstance(graph, CostGraph):
        graph = CostGraph.load(graph)
    costs = costs_for(graph, execution)
    unconstrained = simulate(costs, Schedule.none(costs)).peak_bytes
    budget_bytes = parse_budget(budget, unconstrained)
    target = int(budget_bytes * (1 - headroom))
    result = solve_with_rng_stash(costs, target, solver, time_limit_s,
                                  unscheduled_bytes=unconstrained)
    if result.status == INFEASIBLE:
        raise infeasible_error(costs, solver, result, budget_bytes, headroom, budget)
    stamp = ({"execution": execution} if execution != "eager" else {}) | (
        units_meta(graph.units, "the units recorded in the profiled graph")
        if graph.units else {}) | (  # (`apply` runs the plan in them)
        {"parallel": graph.meta["parallel"]} if "parallel" in graph.meta else {})
    if stamp and result.schedule is not None:
        result = dataclasses.replace(result, schedule=dataclasses.replace(
            result.schedule, meta={**result.schedule.meta, **stamp}))
    if execution == "compiled" and result.schedule is not None:
        form = compiled_form(costs, result.schedule, check_budget=not measured)
        if form is not result.schedule:
            estimate = simulate(costs, form)
            result = dataclasses.replace(result, schedule=dataclasses.replace(
                form, estimate=estimate.to_dict()), estimate=estimate)
    return result


def solve(model: nn.Module, example_inputs: Sequence[Any] | Mapping[str, Any], *,
          budget: int | float | str,
          loss_fn: Callable[[Any], torch.Tensor] | None = None, solver: str = "auto",
          time_limit_s: float | None = 30.0, headroom: float = 0.0, repeats: int = 3,
          progress: Callable[[str], None] | None = None, mode: str = "auto",
          times: str | None = None, device: str | torch.device | None = None,
          device_spec: Any = None, small_inputs: Sequence[Any] | None = None,
          execution: str = "eager", on_fallback: str = "warn", units: Any = "default",
          parallel: Any = None, measure_compiled: bool = True) -> Plan:
    """Find the checkpointing schedule with the least recompute time whose predicted peak
    memory fits ``budget``, and apply it.

    Traces the model once, profiles one training step (``repeats`` timed repeats), solves
    (`solve_graph`) and rewrites the model (`rewrite`). The model is not modified.

    Under ``torch.distributed`` (initialised, more than one rank) this is a collective: every
    rank must call it, with the same model and input shapes, before wrapping ``plan.module``
    in DDP or ``fully_shard``. Each rank profiles and solves, and rank 0's schedule is used
    on every rank (`distributed.same_schedule`), so all ranks run the same step: the plan's
    ``status`` and ``gap`` are rank 0's, its ``estimate`` the simulation of that schedule on
    this rank's own profile.

    Args:
        model: the model.
        example_inputs: positional inputs with the shapes to plan for, or a mapping of
            keyword inputs (a Hugging Face-style batch), bound to the model's ``forward``.
        budget: peak bytes of one forward + backward step, see `parse_budget`: ``"6GiB"``,
            ``6 * 2**30``, ``0.6`` or ``"60%"`` of the unconstrained predicted peak.
        loss_fn: ``loss_fn(output) -> scalar``; default `trace.default_loss_recipe`.
        solver: a registered solver name; ``"auto"`` picks the exact one for the graph.
        time_limit_s: the seconds the call may spend solving: every solve it runs to reach
            the schedule (`solve_graph`'s, and with ``measure_compiled`` its solve again at
            the least feasible budget) keeps to one deadline, so the solve phase ends within
            it and what runs past it (bounded and small: `solvers.deadline`). Profiling
            before it and applying the plan after it are not counted: checking the model's
            own checkpointing, building ``plan.module`` and tracing its units, and with
            ``measure_compiled`` the compiled fit (its compiles, measurements and solves at
            other targets, each within the limit), nor the step's call variants (with units:
            each profiled, and solved within the limit). ``plan.phases_s`` has each phase's
            seconds, ``plan.solve_s`` the solve phase's. A finite number of seconds > 0, or
            None for no limit (`units.check_time_limit`).
        headroom: fraction of the budget held back for cost-model error (see `solve_graph`);
            default 0: the budget is the peak asked for. Pass 0.1 to keep 10% in reserve.
        repeats: timed profile steps (medians are kept).
        progress: called with a short message as each phase starts.
        mode, times, device, device_spec, small_inputs: how the step is profiled (see
            `capture.profile.profile`). The default ``mode="auto"`` profiles under fake
            tensors first and runs the real step only if its predicted peak fits the
            device's free memory; a model that does not fit is planned from the fake
            profile (``plan.graph.meta["profile"]`` says which ran). With ``mode="fake"``
            inputs may be meta tensors or ``(shape, dtype)`` specs; ``device="cuda"`` plans
            for a device the model is not on (``plan.module`` runs where the model is).
        execution: ``"eager"`` (default), or ``"compiled"`` to plan for
            ``torch.compile(plan.module)``: what a replay costs compiled (see `solve_graph`).
            With ``measure_compiled``, the budget is the compiled step's measured peak.
        on_fallback: what a training call of ``plan.module`` that cannot run the plan does:
            ``"warn"`` (default: the model's own forward runs, with a warning at its 1st,
            10th, 100th, ... such step) or ``"raise"`` (`rewrite.PlanFallbackError`); the
            counts are ``plan.module.forward.planned_steps`` and ``.fallback_steps``
            (for a units plan, `units.units_plan` ``(plan.module).planned_calls`` and
            ``.fallback_calls``).
        units: the submodules the plan takes over (`units.find_units`): ``"auto"`` (the
            repeated blocks, a Hugging Face model's ``_no_split_modules``, modules wrapped by
            ``fully_shard``), a module class, a glob of module paths, a predicate ``(path,
            module) -> bool``; or None for one traced graph of the whole step. The default,
            ``"default"``, is ``"auto"`` for a model that declares ``_no_split_modules``
            (Hugging Face, diffusers), the identical children of a ModuleList or Sequential
            for such a model whose list is empty, and None for the rest (`units.find`).
            With units,
            ``plan.module`` runs the model's own ``forward`` (its signature, masks,
            hooks: what ``transformers.Trainer`` needs) and each unit's
            regions inside its calls (`units.runtime`), and the step is profiled as the
            model runs it eagerly; without, the traced step replaces the forward
            (`rewrite.rewrite`). ``plan.units`` says which and why.
        parallel: plan one rank of data-parallel training (`parallel`): ``"ddp"`` or
            `parallel.DDP` for ``DistributedDataParallel(plan.module)``; ``"fsdp2"`` (the
            process group's size), ``"fsdp2:8"`` or `parallel.FSDP2` for ``fully_shard`` on
            each of ``plan.units.paths``, then on ``plan.module`` (units default to
            ``"auto"``). The budget, fractions and the estimate are then per rank. None
            (default): one device.
        measure_compiled: with ``execution="compiled"``, where the model runs here (a real
            profile on one device), compile each candidate plan (``torch.compile``, inductor)
            and measure its step's peak, solving again at other targets until the fastest
            plan measured within the budget (`compiled_fit.fit_compiled`; a few compiles; a
            plan in units is measured compiled with static and with dynamic shapes, the
            larger peak kept, as dynamo compiles it after a second sequence length);
            ``plan.compiled_peak_bytes`` is that measurement. A budget below every plan's
            predicted peak is tried with the plan at the least one: inductor's step often
            needs less than the eager prediction. Elsewhere, or False, the budget
            holds for the eager step's predicted peak (a `compiled_fit.CompiledPeakWarning`
            says so unless False). A plan measured within the budget compiled whose eager
            step is predicted over it (after ``headroom``) warns once at its module's first
            call outside ``torch.compile`` (`run_watch.EagerRunWarning`).

    Returns:
        A `Plan`: ``plan.module``, ``plan.estimate``, ``plan.status``, ``plan.save(path)``.

    Raises:
        InfeasibleBudgetError: nothing fits; the message names the smallest feasible budget
            (measured compiled, with ``measure_compiled``).
        TraceError: the model cannot be traced.
        ValueError: a bad budget or time limit (both checked before profiling), solver name or
            headroom.
        ScheduleError: under ``torch.distributed``, rank 0's schedule does not fit the graph
            of some rank (another model or input shapes); raised on every rank, naming it.

    Example:
        >>> plan = scheduler.solve(model, (x,), budget="60%", solver="greedy")  # doctest: +SKIP
        >>> loss = plan.module(x).sum(); loss.backward()  # doctest: +SKIP
    """
    check_unwrapped(model, "solve")
    budget_spec(budget)  # fail now, not after profiling
    check_time_limit(time_limit_s)
    check_execution(execution)
    check_on_fallback(on_fallback)
    if not isinstance(measure_compiled, bool):
        raise ValueError(f"measure_compiled must be True or False, got {measure_compiled!r}")
    get_solver(solver)
    check_profile_options(mode, times, device_spec)
    parse_parallel(parallel, *process_group())  # (fail now, not after profiling)
    say = progress or (lambda _msg: None)
    phases: dict[str, float] = {}
    started = time.perf_counter()
    gm, graph, inputs, choice = profile_units(
        model, example_inputs, units, loss_fn=loss_fn, repeats=repeats, progress=say,
        mode=mode, times=times, device=device, device_spec=device_spec,
        small_inputs=small_inputs, parallel=parallel)
    if choice.paths:
        say(f"units: {choice.why}")
    unconstrained = simulate(graph, Schedule.none(graph)).peak_bytes
    budget_bytes = parse_budget(budget, unconstrained)
    runs_here = (graph.meta.get("profile", {}).get("mode") != "fake"
                 and "parallel" not in graph.meta)
    fit_here = (execution == "compiled" and measure_compiled and runs_here
                and not process_group()[0])
    say(f"solving with {solver}")
    phases["profile"] = time.perf_counter() - started
    with _phase(phases, "solve"), within(time_limit_s):  # (one deadline for both solves)
        try:
            result = solve_graph(graph, budget, solver=solver, time_limit_s=time_limit_s,
                                 headroom=headroom, execution=execution, measured=fit_here)
        except InfeasibleBudgetError as e:
            if not fit_here or e.min_feasible_bytes is None:
                raise
            # compiled, the plan at the least feasible budget may measure within this one
            say(f"no plan's predicted peak fits; compiling the plan at "
                f"{format_bytes(e.min_feasible_bytes)}")
            result = solve_graph(graph, e.min_feasible_bytes, solver=solver,
                                 time_limit_s=time_limit_s, headroom=headroom,
                                 execution=execution, measured=True)
    applying = time.perf_counter()
    assert result.schedule is not None and result.estimate is not None, result
    schedule = same_schedule(result.schedule, graph=graph)  # rank 0's, under torch.distributed
    if schedule is not result.schedule:
        result = dataclasses.replace(result, schedule=schedule,
                                     estimate=simulate(costs_for(graph, execution), schedule),
                                     status=schedule.status, gap=schedule.gap)
    with _phase(phases, "variants"):  # (the step's call variants: profiled and solved)
        variants = plan_variants(
            model, example_inputs, graph, choice, budget_bytes, say,
            # (one timed repeat: a variant's times only rank its schedules within the budget,
            # which its memory decides; profiling it again costs as much as the step's)
            dict(loss_fn=loss_fn, repeats=1, mode=mode, times=times, device=device,
                 device_spec=device_spec, small_inputs=small_inputs, parallel=parallel),
            lambda g: _variant_solve(g, budget_bytes, solver=solver, time_limit_s=time_limit_s,
                                     headroom=headroom, execution=execution),
            execution) if choice.paths else []
    applying = time.perf_counter()

    def stamp(s: Schedule) -> Schedule:
        s = stamped(s, gm, choice)
        return dataclasses.replace(s, meta={**s.meta, VARIANTS: variants}) if variants else s

    result = dataclasses.replace(result, schedule=stamp(schedule))
    own = own_peak(gm, model, inputs, budget_bytes, result.estimate, say) if runs_here else None

    def build(res: SolveResult) -> nn.Module:
        module = planned_module(gm, graph, res.schedule, model, inputs, why=choice.why,
                                on_fallback=on_fallback)
        if (choice.paths and graph.meta.get("profile", {}).get("mode") != "fake"
                and "param_dtype=" not in graph.meta.get("parallel", "")):
            warm_up(module, inputs)  # (units trace now, for compile; under a
            # MixedPrecisionPolicy they run in another dtype: they trace at the first call)
        return module

    def solve_at(target: int, measured: bool) -> SolveResult:
        res = solve_graph(graph, target, solver=solver, time_limit_s=time_limit_s,
                          execution=execution, measured=measured)
        return dataclasses.replace(res, schedule=stamp(res.schedule))

    if execution != "compiled" or not measure_compiled:
        module = build(result)
    elif fit_here:
        say("compiling the plan to measure its peak")
        # (a units plan is measured compiled statically and with dynamic shapes, as dynamo
        # compiles it after a second sequence length: the larger peak is the plan's)
        found = fit_compiled_form(
            int(budget_bytes * (1 - headroom)), result, unconstrained, solve_at,
            lambda res: compile_and_measure(build(res), inputs,
                                            loss_fn=gm.meta["scheduler"].loss_fn,
                                            dynamic=build(res) if choice.paths else None),
            progress=say)
        result, module = found.result, found.module
    else:
        warn_unmeasured(graph)
        module = build(result)
    watch_eager_run(module, result.schedule)
    watch_compiled_run(module, result.schedule)
    phases["apply"] = time.perf_counter() - applying
    return Plan(module=module, units=choice,
                schedule=result.schedule,
                estimate=result.estimate, status=result.status, gap=result.gap,
                solve_s=phases["solve"], phases_s=phases, graph=graph, result=result,
                budget_bytes=budget_bytes, unconstrained_peak_bytes=unconstrained,
                own_peak_bytes=own, compiled_peak_bytes=result.schedule.meta.get(COMPILED_PEAK))


@contextmanager
def _phase(phases: dict[str, float], name: str) -> Iterator[None]:
    """Adds the seconds the block takes to ``phases[name]``, also where it raises."""
    started = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - started
