"""``scheduler.floor``: the smallest budget that fits a model or a graph, with what is proven.

See `solvers.floor` for what the result means; this is the entry point that also takes a model
and example inputs (traced and profiled as `scheduler.solve` does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable

import torch
import torch.nn as nn

from ..capture.profile import check_profile_options
from ..ir.graph import CostGraph
from ..solvers.config import SolverConfig
from ..solvers.floor import Floor
from ..solvers.floor import floor as graph_floor
from ..quantities import check_time_limit
from ..units.step import profile_units

__all__ = ["Floor", "floor"]


def floor(model_or_graph: nn.Module | CostGraph,
          example_inputs: Sequence[Any] | Mapping[str, Any] | torch.Tensor | None = None, *,
          time_limit_s: float | None = 30.0,
          loss_fn: Callable[[Any], torch.Tensor] | None = None, repeats: int = 3,
          mode: str = "auto", times: str | None = None, device: Any = None,
          device_spec: Any = None, config: SolverConfig | None = None,
          units: Any = "default", parallel: Any = None) -> Floor:
    """The least peak of any schedule found (``bytes``, with its ``schedule``), the proven
    lower bound beside it (``lower_bound_bytes``, over ``space``; ``universal_bytes`` for any
    schedule at all), and a ``status`` (``OPTIMAL`` when they meet).

    Args:
        model_or_graph: a profiled `CostGraph`, or a model (traced and profiled with
            ``example_inputs``, ``loss_fn``, ``repeats``, ``mode``, ``times``, ``device``,
            ``device_spec`` as `scheduler.solve` does).
        example_inputs: the model's inputs (a sequence, a mapping of keywords, or one tensor);
            not given with a graph.
        time_limit_s: seconds for the search (None: no limit). `scheduler.solve` at
            ``budget=floor.bytes`` with the same limit solves in this process (which keeps
            the floor); at ``floor.reproducible_bytes``, where set, in a new process too.
        config: the solvers' tunables.
        units: with a model, the units `scheduler.solve` would plan with (``"auto"``, a class,
            globs, a predicate, ``"default"``: `units.find_units`): the floor of that units
            plan, whose regions stay inside the units' calls; None: the whole-graph plan's.
        parallel: with a model, the floor of one rank of DDP or FSDP2 (``"ddp"``,
            ``"fsdp2:8"``: see `scheduler.solve`).

    Raises:
        ValueError: a graph given with inputs, a model without them, or a bad time limit.
    """
    time_limit_s = check_time_limit(time_limit_s)
    if isinstance(model_or_graph, CostGraph):
        if example_inputs is not None:
            raise ValueError("scheduler.floor(graph) takes no inputs: the graph is profiled "
                             "already; pass a model to trace it with inputs")
        graph = model_or_graph
    else:
        if example_inputs is None:
            raise ValueError(f"scheduler.floor({type(model_or_graph).__name__}) needs example "
                             "inputs: scheduler.floor(model, (x,)) or a profiled CostGraph")
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        check_profile_options(mode, times, device_spec)
        _, graph, _, _ = profile_units(model_or_graph, example_inputs, units, loss_fn=loss_fn,
                                       repeats=repeats, progress=lambda _m: None, mode=mode,
                                       times=times, device=device, device_spec=device_spec,
                                       parallel=parallel)
    return graph_floor(graph, time_limit_s=time_limit_s, config=config)
