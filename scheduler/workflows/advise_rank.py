"""`advise` for one rank of data-parallel training (``parallel=``): predicted, not measured.

One rank's step runs only under its engine, on all the ranks, so nothing here runs it: the
batch and each micro-batch are profiled as `solve` profiles them for one rank
(`units.profile_units` with ``parallel``: the engine's memory and the optimizer's state,
sharded with the parameters under FSDP2, are in the graph), and every option is priced on
those graphs, as `advise` prices them on one device. What is not predicted: the optimizer
step itself (its time, and the temporaries it allocates, about one parameter shard's size
for Adam), which the report says.

The breakdown's parts are those a rank holds through the step (its parameters or their
shards, DDP's gradient buckets, the optimizer state) and the rest of the peak, which one rank's
prediction does not split: saved activations, gradients before their reduction, and FSDP2's
gathered parameters together, reported as ``activations``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch.nn as nn

from ..budget import InfeasibleBudgetError
from ..cost.simulate import simulate
from ..distributed import param_groups, process_group
from ..ir.graph import CostGraph, with_step_time
from ..ir.schedule import Schedule
from ..measurement.breakdown import StepBreakdown
from ..measurement.step import measure_in_turns
from ..parallel import DDP, FSDP2, parse_parallel
from ..parallel.engines import optimizer_bytes
from ..plan import solve_graph
from ..quantities import format_bytes, format_seconds
from ..units.step import profile_units
from .advice import Advice, Option, beyond_summary, recommend, remedies, shares

__all__ = ["advise_per_rank", "least_peak_result", "rank_engine"]

#: `advise`'s optimizer names -> `parallel.OPTIMIZER_STATES`' names
_NAMES = {"adamw": "adamw", "adam": "adam", "sgd": "sgd", "sgd_momentum": "sgd-momentum"}


def rank_engine(parallel: Any, optimizer: Any, optimizer_state_bytes: Any) -> DDP | FSDP2:
    """The engine ``parallel`` names, counting ``optimizer``'s state per rank.

    Raises:
        ValueError: a bad ``parallel``; an optimizer given as a callable or as
            ``optimizer_state_bytes``, or one whose state is not modelled per rank.
    """
    engine = parse_parallel(parallel, *process_group())
    assert engine is not None
    name = optimizer.lower() if isinstance(optimizer, str) else None
    if optimizer_state_bytes is not None or name not in _NAMES:
        given = (f"optimizer_state_bytes={optimizer_state_bytes!r}"
                 if optimizer_state_bytes is not None else f"optimizer={optimizer!r}")
        raise ValueError(
            f"advise(parallel={parallel!r}) counts the optimizer's state per rank from its "
            f"name, and {given} cannot be: name one of {', '.join(_NAMES)}")
    if engine.optimizer not in (None, _NAMES[name]):
        raise ValueError(f"parallel={parallel!r} counts {engine.optimizer!r} state but "
                         f"optimizer={optimizer!r}: name the optimizer once")
    return dataclasses.replace(engine, optimizer=_NAMES[name])


def _held(model: nn.Module, paths: Sequence[str], engine: DDP | FSDP2) -> dict[str, int]:
    """What a rank holds through the step: its parameters (FSDP2: their shards), DDP's
    gradient buckets and the optimizer state (`parallel.engines.optimizer_bytes`)."""
    groups = param_groups(model, paths)
    world = engine.world if isinstance(engine, FSDP2) else 1
    params = [p for ps in groups.values() for p in ps]
    trainable = sum(p.shard_bytes(world) for p in params if p.trainable)
    return {"parameters": sum(p.shard_bytes(world) for p in params),
            "gradients": 0 if isinstance(engine, FSDP2) else trainable,  # DDP's buckets
            "optimizer_state": optimizer_bytes(engine.optimizer, groups,
                                               lambda p: p.shard_bytes(world))}


def advise_per_rank(model: nn.Module, inputs: tuple[Any, ...], engine: DDP | FSDP2, *,
                    device_bytes: int, headroom: float, usable: int, batch: int | None,
                    ks: list[int], loss_fn: Any, solver: str, time_limit_s: float | None,
                    repeats: int, slicer: Callable[[tuple[Any, ...], int], tuple[Any, ...]],
                    accumulation: Callable[[CostGraph], CostGraph],
                    say: Callable[[str], None]) -> Advice:
    """`advise`'s answer for one rank of ``engine`` (module docstring)."""
    graphs: dict[int, CostGraph] = {}
    cases: dict[int, tuple[nn.Module, tuple[Any, ...]]] = {}
    paths: Sequence[str] = ()

    def profiled(k: int) -> CostGraph:
        nonlocal paths
        say(f"profiling {'the batch' if k == 1 else f'a micro-batch of 1/{k}'} as one rank "
            f"of {engine.describe()}")
        cases[k] = (model, inputs if k == 1 else slicer(inputs, k))
        _, g, _, choice = profile_units(
            model, cases[k][1], "default", parallel=engine, loss_fn=loss_fn, repeats=repeats,
            name=type(model).__name__)
        paths = choice.paths
        return g

    graphs[1] = profiled(1)
    g1 = graphs[1]
    peak = simulate(g1, Schedule.none(g1), timeline=False).peak_bytes
    parts = _held(model, paths, engine)
    parts["activations"] = peak - sum(parts.values())
    parts["other"] = 0
    bd = StepBreakdown(peak_bytes=peak, parts=parts, phase="one rank's forward and backward "
                       "(predicted)", forward_backward_peak_bytes=peak,
                       optimizer_step_peak_bytes=0, step_s=g1.measured_step_s,
                       optimizer_step_s=0.0, optimizer=f"{engine.optimizer}, per rank of "
                       f"{engine.describe()}", device=g1.meta.get("device") or _device(model))
    advice = Advice(device_memory_bytes=device_bytes, headroom=headroom, usable_bytes=usable,
                    breakdown=bd, fits=peak <= usable, recommendation="fits", summary="")
    unpredicted = ("Predicted for one rank, not measured; the optimizer step's own "
                   "temporaries (about a parameter shard for Adam) are not counted.")
    if advice.fits:
        advice.summary = (f"one rank's step fits: it peaks at {format_bytes(peak)}, "
                          f"{peak / usable:.0%} of the usable {format_bytes(usable)}. No "
                          f"checkpointing needed. {unpredicted}")
        return advice
    graphs.update((k, profiled(k)) for k in ks)
    if all(g.meta.get("profile", {}).get("mode") == "real" for g in graphs.values()):
        # profiles taken one after another see different load: re-time them in turns
        say("timing the batch and its micro-batches in turns")
        timed = measure_in_turns(cases, repeats=max(3, repeats), loss_fn=loss_fn)
        graphs = {k: with_step_time(g, timed[k].step_s) for k, g in graphs.items()}
    g1 = graphs[1]
    options = [Option("as is", 1, batch, False, peak, g1.measured_step_s, False),
               _checkpointed(advice, "checkpoint", 1, batch, g1, solver, time_limit_s)]
    for k in ks:
        g = accumulation(graphs[k])
        size = batch // k if batch else None
        p = simulate(g, Schedule.none(g), timeline=False).peak_bytes
        options.append(Option(f"accumulate {k}", k, size, False, p, k * g.measured_step_s,
                              p <= usable))
        if not options[-1].fits:
            options.append(_checkpointed(advice, f"accumulate {k} + checkpoint", k, size, g,
                                         solver, time_limit_s))
    kind, chosen = recommend(options)
    advice.options, advice.recommendation, advice.chosen = options, kind, chosen
    if chosen is None:
        best = min(options, key=lambda o: o.predicted_peak_bytes)
        advice.shortfall_bytes = best.predicted_peak_bytes - usable
        advice.summary = f"{beyond_summary(bd, shares(bd), best, usable)}"
        advice.remedies = ([f"shard over more ranks than {engine.world}"]
                           if isinstance(engine, FSDP2) else []) + remedies(bd)
        return advice
    how = (f"accumulate gradients over {chosen.micro_batches} micro-batches of "
           f"{chosen.micro_batch_size}" + (" with checkpointing" if chosen.checkpoint else "")
           if chosen.micro_batches > 1 else "checkpoint")
    advice.summary = (f"one rank's step needs {format_bytes(peak - usable)} more than the "
                      f"usable {format_bytes(usable)}; {how}: predicted peak "
                      f"{format_bytes(chosen.predicted_peak_bytes)}, "
                      f"{format_seconds(chosen.predicted_time_s)} per batch"
                      + (f" (+{chosen.overhead:.1%} recompute)" if chosen.checkpoint else "")
                      + f", the fastest option that fits. {unpredicted}")
    return advice


def _device(model: nn.Module) -> str:
    first = next(model.parameters(), None)
    return "cpu" if first is None else str(first.device)


def _checkpointed(advice: Advice, name: str, k: int, size: int | None, g: CostGraph,
                  solver: str, time_limit_s: float | None) -> Option:
    """The optimal plan of ``g`` within the usable bytes (its schedule kept in the advice);
    where none fits, the least peak any schedule reaches."""
    try:
        result = solve_graph(g, advice.usable_bytes, solver=solver, time_limit_s=time_limit_s)
    except InfeasibleBudgetError:
        least = least_peak_result(g, solver, time_limit_s).estimate
        return Option(name, k, size, True, least.peak_bytes, k * least.step_s, False,
                      least.overhead, "no schedule fits")
    est = result.estimate
    advice.schedules[name] = result.schedule
    return Option(name, k, size, True, est.peak_bytes, k * est.step_s,
                  est.peak_bytes <= advice.usable_bytes, est.overhead)


def least_peak_result(graph: CostGraph, solver: str, time_limit_s: float | None) -> Any:
    """The solver's schedule with the least peak: solved at its smallest feasible budget."""
    try:
        return solve_graph(graph, 1, solver=solver, time_limit_s=time_limit_s)
    except InfeasibleBudgetError as e:
        return solve_graph(graph, e.min_feasible_bytes, solver=solver,
                           time_limit_s=time_limit_s)
