"""What a schedule costs when its step runs under ``torch.compile``: `compiled_costs`.

Compiled, a plan's recompute regions reach AOTAutograd's partitioner as selective-checkpoint
tags (``torch.utils.checkpoint`` is traced, not run), and inductor generates the backward
with the replayed ops in it. What a replay then costs differs from eager in three ways:

* ops with FLOPs (matmuls, convolutions, attention: those ``torch.utils.flop_counter``
  counts) run as the same library kernels as in eager, at their eager time;
* every other op (pointwise, reductions, views) fuses into the kernels of the backward that
  reads its result, so replaying it costs about nothing beyond reading its inputs instead of
  the saved output;
* the checkpoint's own machinery (the call, its saved-tensor hooks, a selective policy's
  dispatch) does not run at all, nor does it stash the RNG state (dynamo's checkpoint sets
  ``preserve_rng_state=False``; inductor's seeds replay random ops), so the graph has no
  ``meta["rng"]`` (`cost.rng`) and `solvers.stash` holds back no room for it.

So a node's replay costs ``time_s * flop_share`` (`Node.flop_share`, recorded by the
profile), plus `FUSED_REPLAY_SHARE` (0) of the rest of its time, and regions cost nothing of
their own. A replay of fused ops is not free only in time: saving them costs the write of
their outputs in forward and the read in backward, which the partitioner spares by
recomputing them (on the GPT example, a step that saved only FLOP ops' outputs ran 3-5%
faster than compile's default, at a lower peak; `docs/benchmarks.md`, ``partitioner``).
So a plan for compiled execution runs in its compiled form (`cost.compiled_form`), which
replays every fused op whose replay needs no FLOP replay; plans whose FLOP replays cost the
same then run alike, and the solver's choice among fused replays decides nothing. (Until
then fused replays were priced at a thousandth of their eager time, a tie-break towards
fewer of them; `peers_cuda` and ``peers_fit_tiebreak`` measured it with opposite readings.)

Memory is the same as the eager cost model's: every storage and saved tensor as recorded.
Inductor often needs less (it frees or never materialises fused intermediates) and sometimes
more (its own buffers, other kernels' scratch); the compiled peak is to be measured
(`measurement.compiled.compiled_peak`).

The time model only ranks schedules: every schedule runs forward once, so step time differs
between schedules by recompute alone. With ``step_s``, a measured step of the compiled
unscheduled model, a schedule's predicted step is that plus its compiled recompute.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

from ..ir.graph import CostGraph
from .rng import RNG_META

__all__ = ["EXECUTIONS", "FUSED_REPLAY_SHARE", "CompiledCostWarning", "check_execution",
           "compiled_costs", "costs_for"]

#: how a plan's step runs: its time model (`costs_for`)
EXECUTIONS = ("eager", "compiled")

#: the share of a node's non-FLOP time its compiled replay is priced at: none, since the
#: compiled form (`cost.compiled_form`) replays the fused ops it can whatever the solver chose
FUSED_REPLAY_SHARE = 0.0


class CompiledCostWarning(UserWarning):
    """A graph's nodes lack `Node.flop_share`, so their compiled replay is priced as eager."""


def compiled_costs(graph: CostGraph, *, step_s: float | None = None) -> CostGraph:
    """``graph`` with each node's forward time its compiled replay cost, ``time_s *
    (flop_share + FUSED_REPLAY_SHARE * (1 - flop_share))``, no per-region checkpoint costs or
    selective-policy dispatch and no RNG stash (`RNG_META` dropped from its meta); the same
    nodes, storages and events, so the same peaks and the same fingerprint.

    Nodes recorded without a share (graphs profiled before it was recorded) keep their eager
    time, with a `CompiledCostWarning` naming how many and the fix (profile again).

    Args:
        graph: the profiled `CostGraph`.
        step_s: the measured step of the compiled unscheduled model, which becomes the
            graph's ``measured_step_s`` (predicted steps are then compiled ones); None
            keeps the eager step (only differences between schedules are then meaningful).
    """
    if step_s is not None and not (isinstance(step_s, (int, float)) and 0 < step_s < float("inf")):
        raise ValueError(f"step_s must be a positive number of seconds, got {step_s!r}")
    missing = [n.name for n in graph.nodes if n.flop_share is None and n.time_s > 0]
    if missing:
        warnings.warn(
            f"{len(missing)} node(s) of graph {graph.name!r} (first: {missing[0]!r}) have no "
            f"flop_share, so their replay under torch.compile is priced at its eager time; "
            f"profile the model again (scheduler profile) to record it",
            CompiledCostWarning, stacklevel=2)
    nodes = [replace(n, time_s=n.time_s * (1.0 if n.flop_share is None else n.flop_share
                                           + FUSED_REPLAY_SHARE * (1.0 - n.flop_share)),
                     sac_s=None) for n in graph.nodes]
    return replace(graph, nodes=nodes, checkpoint_call_s=0.0, checkpoint_saved_s=0.0,
                   measured_step_s=graph.measured_step_s if step_s is None else float(step_s),
                   meta={**{k: v for k, v in graph.meta.items() if k != RNG_META},
                         "execution": "compiled"})


def check_execution(execution: object) -> str:
    """``execution`` if it is one of `EXECUTIONS`.

    Raises:
        ValueError: another value (the message lists the valid ones).
    """
    if execution not in EXECUTIONS:
        raise ValueError(f"execution must be one of {', '.join(map(repr, EXECUTIONS))}, got "
                         f"{execution!r}")
    return execution  # type: ignore[return-value]


def costs_for(graph: CostGraph, execution: str) -> CostGraph:
    """The graph whose times are those of ``execution`` (`check_execution`): ``graph`` itself
    for ``"eager"``, `compiled_costs` for ``"compiled"``."""
    if check_execution(execution) == "compiled":
        return compiled_costs(graph)
    return graph
