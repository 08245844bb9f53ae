"""Per-rank memory under data-parallel training: a profiled step as one rank of DDP or FSDP2
runs it, so that a budget is what each device holds.

The profile is of the unsharded step on one device. `per_rank` turns it into the step of one
rank: what the engine adds is written into the graph in the forms every solver already
prices, so the solvers, `simulate` and the floor need no other change:

* what lives through the step (sharded parameters, DDP's gradient buckets, optimizer state)
  is in ``param_bytes``;
* what the engine holds while a unit runs in forward (FSDP2's gathered parameters) is in
  `CostGraph.engine_bytes` (no schedule changes it and no replay allocates it: in backward the
  parameters are gathered already);
* what it does in backward (FSDP2's gathers and prefetch, the unsharded gradients' reduce-
  scatter into sharded ones; DDP's copy into its buckets) is in ``bwd_steps``' events, which
  no schedule changes either.

The engines' memory was measured on torch 2.13 (gloo, CPU; docs/distributed.md). DDP: the
reducer keeps one flat bucket per dtype of the trainable parameters' bytes from construction
on; with ``gradient_as_bucket_view=False`` (the default) each gradient also lives as
``param.grad``, with ``True`` the one backward computed is freed once copied into its bucket
(at the end of the backward step that made it). FSDP2: see `fsdp2.fsdp2_rank`.

Parameters come from the model (`distributed.param_groups`), by unit and root (``""``): FSDP2
shards dim 0 into ``ceil(rows / world)`` rows per rank, padded."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ..ir.graph import CostGraph
from ..ir.graph_json import check_references
from .engines import (DDP, FSDP2, OPTIMIZER_STATES, Param, Parallel, ParallelError,
                      optimizer_bytes, parse_parallel)
from .fsdp2 import fsdp2_rank, persistent_grads

__all__ = ["DDP", "FSDP2", "OPTIMIZER_STATES", "Param", "ParallelError", "parse_parallel",
           "per_rank"]


def per_rank(graph: CostGraph, parallel: Parallel,
             groups: Mapping[str, Sequence[Param]]) -> CostGraph:
    """``graph`` (the unsharded step on one device) as one rank of ``parallel`` runs it.

    ``groups``: the parameters of each unit (by path) and of the root (``""``), see the module
    docstring. The graph's units are FSDP2's: each is sharded on its own, the rest with the
    root. Raises `ParallelError` where the step's gradients cannot be told apart by unit."""
    if isinstance(parallel, DDP):
        return _ddp(graph, parallel, groups)
    return _stamped(fsdp2_rank(graph, parallel, groups), parallel)


def _ddp(graph: CostGraph, cfg: DDP, groups: Mapping[str, Sequence[Param]]) -> CostGraph:
    buckets = sum(p.bytes for ps in groups.values() for p in ps if p.trainable)
    state = optimizer_bytes(cfg.optimizer, groups, lambda p: p.bytes)
    steps = list(graph.bwd_steps)
    if cfg.gradient_as_bucket_view:
        for gid, (i, _) in persistent_grads(graph).items():
            steps[i] = dataclasses.replace(steps[i], events=(*steps[i].events, ("f", gid, 0)))
    return _stamped(dataclasses.replace(graph, param_bytes=graph.param_bytes + buckets + state,
                                        bwd_steps=steps), cfg)


def _stamped(graph: CostGraph, cfg: Parallel) -> CostGraph:
    out = dataclasses.replace(graph, measured_peak_bytes=0,
                              meta={**graph.meta, "parallel": cfg.describe()})
    check_references(out, {n.name: i for i, n in enumerate(out.nodes)})
    return out
