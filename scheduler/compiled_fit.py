"""Plans for ``torch.compile`` whose compiled step is measured within the budget: `fit_compiled`.

Compiled with inductor, a plan's step allocates other buffers than the eager ops it was
profiled with: AOTAutograd's min-cut partitioner picks its own saved set around what the plan
keeps, fused kernels never materialise some intermediates, and inductor adds buffers of its
own. On the examples the compiled peak landed from 25% below the eager prediction to 28%
above it (`benchmarks/peers.py`), which the cost model does not predict. So where the model
runs on this machine, ``solve(..., execution="compiled")`` measures instead: each candidate
plan is compiled (``torch.compile``, inductor) and one training step's peak read from the
allocator (`measurement.compiled.compiled_peak`), and the solver's target moves by what the
measurement says, down by a plan's excess over the budget, up by the memory a plan left
unused, between the highest target that measured within the budget and the lowest that did
not; or, once a lower target's plan measured the higher compiled peak (recomputing more raised
it, on the GPT example), above every target tried. The plan kept is the one with the least
compiled recompute among those that measured within the budget; its schedule records the
measured peak (`COMPILED_PEAK`).

The search is `fit_compiled`, given how to solve at a target and how to build and measure a
plan, so that it is tested without compiling; `compile_and_measure` is the measurement.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch._dynamo.config as dynamo_config
import torch.nn as nn

from .budget import InfeasibleBudgetError
from .cost.compiled_form import flop_saves
from .ir.graph import CostGraph
from .measurement.compiled import compiled_peak
from .quantities import format_bytes
from .solvers.base import SolveResult

__all__ = ["COMPILED_PEAK", "CompiledFit", "CompiledPeakWarning", "CompiledTry",
           "compile_and_measure", "fit_compiled", "fit_compiled_form", "warn_unmeasured"]

#: ``schedule.meta`` key: the measured peak of the plan's compiled step, in bytes
COMPILED_PEAK = "compiled_peak_bytes"


class CompiledPeakWarning(UserWarning):
    """A plan for ``torch.compile`` whose compiled peak could not be measured here."""


@dataclass(frozen=True)
class CompiledTry:
    """One candidate of `fit_compiled`: the target the solver was given, the plan's predicted
    (eager) peak and compiled recompute seconds, and its measured compiled peak."""

    target_bytes: int
    predicted_peak_bytes: int
    recompute_s: float
    peak_bytes: int


@dataclass(frozen=True)
class CompiledFit:
    """What `fit_compiled` keeps: the solver's result (its schedule's meta records the
    measured peak under `COMPILED_PEAK`), the module built for it, its measured compiled peak
    and every candidate tried, in order."""

    result: SolveResult
    module: Any
    peak_bytes: int
    tries: tuple[CompiledTry, ...]


def schedule_key(result: SolveResult) -> str:
    """What makes two results' plans the same step: their regions and which save-set nodes
    save only their FLOP ops."""
    assert result.schedule is not None
    return json.dumps([[r.to_dict() for r in result.schedule.regions],
                       sorted(flop_saves(result.schedule))], sort_keys=True)


def fit_compiled(budget_bytes: int, target_bytes: int, ceiling_bytes: int,
                 solve_at: Callable[[int], SolveResult],
                 build_and_measure: Callable[[SolveResult], tuple[Any, int]], *,
                 compiles: int = 4, within: float = 0.02,
                 progress: Callable[[str], None] | None = None) -> CompiledFit:
    """The fastest plan (least compiled recompute) whose measured compiled peak is at most
    ``budget_bytes``, searching the solver's target.

    Args:
        budget_bytes: the peak the compiled step must keep to.
        target_bytes: the first target (the budget less any headroom).
        ceiling_bytes: the highest target worth solving at (the unscheduled predicted peak).
        solve_at: ``target -> SolveResult`` with a schedule; raises `InfeasibleBudgetError`
            where nothing fits the target.
        build_and_measure: ``result -> (module, measured compiled peak)``.
        compiles: how many plans may be built and measured (a plan met again is not
            measured again); at least 1.
        within: stop once a plan measures within this fraction below the budget.
        progress: called with a line per plan measured.

    Raises:
        InfeasibleBudgetError: no plan measured within the budget (its ``min_feasible_bytes``
            is the least compiled peak measured: a budget the plan measured keeps to, which a
            search from that budget may or may not meet again), or nothing fits the first
            target nor the least feasible one the solver names.
    """
    if compiles < 1:
        raise ValueError(f"compiles must be >= 1, got {compiles}")
    seen: dict[str, tuple[Any, int]] = {}
    tries: list[CompiledTry] = []
    best: tuple[float, int, SolveResult, Any] | None = None  # (recompute, peak, result, module)
    ok_at, over_at = None, None  # highest target within the budget, lowest above it
    rising = False  # (once the compiled peak measured falling as the target rose)
    target = target_bytes
    for _ in range(4 * compiles):  # (solves meeting a measured plan again cost no compile)
        try:
            result = solve_at(target)
        except InfeasibleBudgetError as e:
            # below the least predicted peak: try the plan there once (compiled, it may keep
            # to a budget its eager prediction does not)
            floor = e.min_feasible_bytes
            if floor is None or not target < floor <= ceiling_bytes \
                    or (tries and floor >= tries[-1].target_bytes) \
                    or any(t.target_bytes == floor for t in tries):
                if not tries:
                    raise
                break
            target = floor
            continue
        assert result.schedule is not None and result.estimate is not None
        key = schedule_key(result)
        if key not in seen:
            if len(seen) == compiles:
                break
            seen[key] = build_and_measure(result)
            if progress is not None:
                progress(f"solved at {format_bytes(target)}: compiled peak "
                         f"{format_bytes(seen[key][1])} against {format_bytes(budget_bytes)}")
        module, peak = seen[key]
        tries.append(CompiledTry(target, result.estimate.peak_bytes,
                                 result.estimate.recompute_s, peak))
        if peak <= budget_bytes:
            ok_at = target if ok_at is None else max(ok_at, target)
            candidate = (result.estimate.recompute_s, peak, result, module)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
            if peak >= budget_bytes * (1 - within) or not result.schedule.recompute_regions:
                break
            step = target + (budget_bytes - peak)
        else:
            over_at = target if over_at is None else min(over_at, target)
            # each plan in a row still over the budget doubles the next step down: a lower
            # target's plan may keep the same compiled buffers, and the excess alone would
            # then creep down by the same few bytes
            overs = next((i for i, t in enumerate(reversed(tries))
                          if t.peak_bytes <= budget_bytes), len(tries))
            step = target - (peak - budget_bytes) * 2 ** (overs - 1)
        rising = rising or falls_as_target_rises(tries, budget_bytes)
        if rising:
            # a lower target's plan measured higher than a higher one's, both over: here
            # recomputing more raises the compiled peak, so search above every target tried,
            # by this plan's excess over the budget (or the memory it left unused)
            step = max(t.target_bytes for t in tries) + abs(peak - budget_bytes)
        step = min(step, ceiling_bytes)
        if step <= 0:
            break
        low, high = (None, None) if rising else (ok_at, over_at)
        if rising and any(t.target_bytes == step for t in tries):
            break
        if (high is not None and step >= high) or (low is not None and step <= low):
            if low is None or high is None:  # (only at the ceiling: nothing left above)
                break
            step = (low + high) // 2
        if step == target or (low is not None and high is not None and high - low <= max(
                1, int(budget_bytes * within / 4))):
            break
        target = step
    if best is None:
        least = min(tries, key=lambda t: t.peak_bytes)
        raise InfeasibleBudgetError(
            f"no plan's compiled step measured within the budget "
            f"{format_bytes(budget_bytes)}: {len(seen)} plan(s) compiled and measured peaks "
            f"of {', '.join(format_bytes(t.peak_bytes) for t in tries)} (solved at "
            f"{', '.join(format_bytes(t.target_bytes) for t in tries)}), the least "
            f"{format_bytes(least.peak_bytes)}. Give a budget of that or more (the plan solved "
            f"at {format_bytes(least.target_bytes)} keeps to it), or pass "
            f"measure_compiled=False to plan against the eager step's predicted peak",
            budget_bytes=budget_bytes,
            min_feasible_bytes=least.peak_bytes)
    _, peak, result, module = best
    return _fitted(result, module, peak, tuple(tries), budget_bytes)


def _fitted(result: SolveResult, module: Any, peak: int, tries: tuple[CompiledTry, ...],
            budget_bytes: int) -> CompiledFit:
    """The `CompiledFit` keeping ``result``, its schedule stamped with its measured peak and
    with the budget it was measured against, not the target it was solved at (``result``'s
    own ``budget_bytes``): its file, `scheduler apply`'s check and `EagerRunWarning` then name
    the budget the plan keeps."""
    assert result.schedule is not None
    schedule = dataclasses.replace(result.schedule, budget_bytes=budget_bytes,
                                   meta={**result.schedule.meta, COMPILED_PEAK: peak})
    return CompiledFit(dataclasses.replace(result, schedule=schedule), module, peak, tries)


def fit_compiled_form(budget_bytes: int, first: SolveResult, ceiling_bytes: int,
                      solve_at: Callable[[int, bool], SolveResult],
                      build_and_measure: Callable[[SolveResult], tuple[Any, int]], *,
                      progress: Callable[[str], None] | None = None) -> CompiledFit:
    """`fit_compiled` over plans in their compiled form (`cost.compiled_form`), after the
    form of the plan at ``ceiling_bytes``, and then, where no form measured within the
    budget, over the plans as solved.

    The plan at the ceiling replays no FLOP op, so its form is the fastest plan there is
    under the compiled time model, and compiled it can need less memory than forms that
    replay more (on the GPT example, 11.44 MiB, against 12.29 MiB for the form solved at
    12.86 MiB): where it measures within the budget it is kept at the cost of one compile.
    A form replays each block's fused ops in one replay, which below compile's own peaks can
    need more memory than the plan it came from (on a small GPT at 65% of its eager peak,
    forms measured 3.49-3.73 MiB against a budget of 3.47 MiB), so where the budget is that
    tight up to one compile and twice `fit_compiled`'s are spent. A plan met again is not
    compiled again.

    Args:
        budget_bytes, ceiling_bytes, build_and_measure, progress: as `fit_compiled`'s.
        first: the solver's result at the first target, its schedule in its whole form.
        solve_at: ``(target, whole) -> SolveResult``: the plan at ``target``, in its compiled
            form in every block (``whole``) or only where its predicted peak keeps to the
            target (`plan.solve_graph`'s ``measured``).

    Raises:
        InfeasibleBudgetError: neither search measured a plan within the budget; of the two
            errors, the one naming the lower least measured peak.
    """
    measured: dict[str, tuple[Any, int]] = {}

    def measure(result: SolveResult) -> tuple[Any, int]:
        key = schedule_key(result)
        if key not in measured:
            measured[key] = build_and_measure(result)
        return measured[key]

    def fit(start: SolveResult, whole: bool) -> CompiledFit:
        return fit_compiled(budget_bytes, start.budget_bytes, ceiling_bytes,
                            lambda t: start if t == start.budget_bytes else solve_at(t, whole),
                            measure, progress=progress)
    if first.budget_bytes < ceiling_bytes:
        top = solve_at(ceiling_bytes, True)
        module, peak = measure(top)
        if progress is not None:
            progress(f"the plan replaying no FLOP op: compiled peak {format_bytes(peak)} "
                     f"against {format_bytes(budget_bytes)}")
        if peak <= budget_bytes:
            assert top.estimate is not None
            return _fitted(top, module, peak, (CompiledTry(
                ceiling_bytes, top.estimate.peak_bytes, top.estimate.recompute_s, peak),),
                budget_bytes)
    try:
        return fit(first, True)
    except InfeasibleBudgetError as e:
        if progress is not None:
            progress("no plan in its compiled form measured within the budget; trying the "
                     "plans as solved")
        try:
            return fit(solve_at(first.budget_bytes, False), False)
        except InfeasibleBudgetError as again:
            raise min(e, again, key=lambda x: x.min_feasible_bytes or math.inf) from None


def falls_as_target_rises(tries: list[CompiledTry], budget_bytes: int) -> bool:
    """Whether two of ``tries`` measured over the budget where the one solved at the lower
    target measured the higher compiled peak (on the GPT example, plans recomputing more
    compiled to higher peaks: solved at 10.02, 9.45 and 8.52 MiB they measured 10.58, 10.87
    and 11.53 MiB)."""
    over = [t for t in tries if t.peak_bytes > budget_bytes]
    return any(a.target_bytes < b.target_bytes and a.peak_bytes > b.peak_bytes
               for a in over for b in over)


def compile_and_measure(module: nn.Module, inputs: Any, *,
                        loss_fn: Callable[[Any], torch.Tensor] | None = None,
                        dynamic: nn.Module | None = None) -> tuple[nn.Module, int]:
    """``module`` and the peak of one training step of ``torch.compile(module)`` (inductor),
    measured from the allocator's events after two steps that compile
    (`measurement.compiled.compiled_peak`); the module's buffers, gradients and RNG are
    restored. Dynamo's recompile limits are raised meanwhile: every candidate plan's module
    runs the same ``forward`` code, which dynamo counts as recompiles of one function, and
    past its limit it would run the step eagerly, measuring the wrong step.

    ``dynamic``: another copy of the same plan (a units plan, whose batches change length),
    compiled with ``dynamic=True`` and measured too; the peak is the larger. Dynamo compiles
    with dynamic shapes after a second sequence length, and that graph's buffers are
    inductor's to lay out, not this measurement's to assume (a tiny Llama's plan measured
    the same both ways, within 4 bytes). A copy, not ``module`` again: dynamo would reuse
    the static graph, whose guards the same module and inputs pass."""
    limits = {name: max(getattr(dynamo_config, name), 64) for name in (
        "recompile_limit", "accumulated_recompile_limit") if hasattr(dynamo_config, name)}
    with dynamo_config.patch(**limits):
        peak = compiled_peak(torch.compile(module), inputs, loss_fn=loss_fn)
        if dynamic is not None:
            peak = max(peak, compiled_peak(torch.compile(dynamic, dynamic=True), inputs,
                                           loss_fn=loss_fn))
        return module, peak


def warn_unmeasured(graph: CostGraph) -> None:
    """Warn that a plan for compiled execution keeps to the budget in the eager prediction
    only: its model was profiled on fake tensors or for one rank of several, so its compiled
    step cannot be run here."""
    why = ("it was profiled for one rank of data-parallel training"
           if "parallel" in graph.meta else
           "it was profiled on fake tensors (it does not run here)"
           if graph.meta.get("profile", {}).get("mode") == "fake" else
           "torch.distributed runs more than one rank")
    warnings.warn(
        f"the plan for torch.compile keeps to the budget in the eager step's predicted peak "
        f"only, not measured compiled: {why}. Inductor's buffers move the compiled peak "
        f"(from 25% below to 28% above the eager prediction on the examples); hold memory "
        f"back with headroom=0.1, and measure the compiled step "
        f"(scheduler.measurement.compiled.compiled_peak) where it runs",
        CompiledPeakWarning, stacklevel=3)
