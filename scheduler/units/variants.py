"""Call variants of a units plan: the other op sequences a unit's call runs in training, each
planned under the same budget.

A unit's plan is tied to the ops its call ran in the profiled step. The same unit is called
with other ops when the model's own code passes it other arguments: a Hugging Face model
given an ``attention_mask`` with zeros (any padding collator) builds an explicit mask and its
layers run ``scaled_dot_product_attention`` with it, where an unpadded batch passes no mask
(``is_causal``); under ``torch.compile`` the same model builds the explicit mask even
unpadded. Each such step is a **variant**: `solve` profiles the step again as the model runs
it then (`variant_inputs`: the compiled mask choices, a padded or an unpadded mask), solves
it under the same budget, and records each unit's ops and regions at that variant in the
schedule (``meta[VARIANTS]``). A unit's call then runs the regions of the variant whose ops it
traces to (`runtime.UnitForward`), so a padded batch, an unpadded one and a compiled step all
run planned, each within the budget by its own prediction. A variant that fits no schedule
within the budget is said once at solve time with its least feasible peak; its calls run the
unit's own forward, warned, as any call of ops no variant holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from ..capture.trace import MODEL_ATTR
from ..cost.compiled_form import flop_saves
from ..ir.graph import CostGraph
from ..ir.region import Region, ScheduleError, region_from_dict
from ..ir.replays import unit_calls
from ..ir.schedule import Schedule

__all__ = ["VARIANTS", "VIEW_EXTRAS", "UnitRun", "VariantWarning", "match_ops", "runs_from_meta",
           "unit_runs", "variant_inputs", "variant_record", "with_extras"]

#: the schedule's ``meta`` key of its call variants: a list of `variant_record`s
VARIANTS = "unit_variants"


class VariantWarning(UserWarning):
    """A call variant of the step that `solve` could not plan (its calls run unplanned)."""


@dataclass(frozen=True)
class UnitRun:
    """How one unit's call runs at one variant: the ops its trace has, in order (op and
    target, a module target relative to the unit), and the regions over them (nodes named by
    position: ``"#0"``, ``"#1"``, ...), with the save-set nodes that save only their FLOP ops
    under ``torch.compile`` (`cost.compiled_form.flop_saves`)."""

    ops: tuple[tuple[str, str], ...]
    regions: tuple[Region, ...]
    flop_saves: frozenset[str] = frozenset()

    @property
    def recomputes(self) -> bool:
        return any(r.policy != "keep" for r in self.regions)


def unit_op(op: str, target: str, path: str) -> tuple[str, str]:
    """A node's op and target as a unit's own trace names it (a module target relative to
    the unit)."""
    if op == "call_module":  # (the traced wrapper holds the model as `MODEL_ATTR`)
        target = target.removeprefix(MODEL_ATTR + ".").removeprefix(path + ".")
    return op, target


def renamed(r: Region, rel: dict[str, str]) -> Region:
    """``r`` with its nodes (and inner regions' and save sets') renamed by ``rel``."""
    return Region(r.policy, tuple(rel[n] for n in r.nodes), frozenset(rel[n] for n in r.save),
                  tuple(renamed(x, rel) for x in r.inner))


def unit_runs(graph: CostGraph, schedule: Schedule) -> dict[str, list[UnitRun]]:
    """Each unit's `UnitRun` at each of its calls in ``graph`` under ``schedule``, by unit
    path. Kept regions that run across a unit's edges are clipped to its call."""
    names = graph.compute_nodes
    pos = {n: i for i, n in enumerate(names)}
    flops = flop_saves(schedule)
    out: dict[str, list[UnitRun]] = {}
    for path, a, b in unit_calls(graph):
        inside = set(names[a:b])
        regions = [r if r.policy != "keep" else Region("keep", tuple(n for n in r.nodes
                                                                      if n in inside))
                   for r in schedule.regions if inside.intersection(r.nodes)]
        rel = {n: f"#{pos[n] - a}" for n in names[a:b]}
        ops = tuple(unit_op(graph.node(n).op, graph.node(n).target, path)
                    for n in names[a:b])
        out.setdefault(path, []).append(UnitRun(
            ops, tuple(renamed(r, rel) for r in regions),
            frozenset(rel[n] for n in flops if n in rel)))
    return out


#: ops a trace for all sizes may hold that the trace at one size dropped as no-ops (export
#: drops ``x[:, :n]`` where ``n`` is the size it traces at): views, allocating nothing
VIEW_EXTRAS = (("call_function", "aten.slice.Tensor"),)


def match_ops(got: tuple[tuple[str, str], ...], ops: tuple[tuple[str, str], ...]
              ) -> list[int | None] | None:
    """Where each of a trace's ops ``got`` is in a run's ``ops``: its position there, or None
    for a view of `VIEW_EXTRAS` that ``ops`` does not have; None where ``got`` is not ``ops``
    with such views added."""
    out: list[int | None] = []
    j = 0
    for op in got:
        if j < len(ops) and op == ops[j]:
            out.append(j)
            j += 1
        elif op in VIEW_EXTRAS:
            out.append(None)
        else:
            return None
    return out if j == len(ops) else None


def with_extras(regions: list[Region], before: dict[str, list[str]], last: list[str]
                ) -> list[Region]:
    """``regions`` with the extra nodes ``before[name]`` put just before node ``name``, in the
    region (and inner regions) that holds it, and ``last`` after the last node: a view then
    runs where the op that reads it runs (kept or replayed with it)."""
    def put(r: Region, tail: list[str]) -> Region:
        nodes = [x for n in r.nodes for x in (*before.get(n, ()), n)]
        if tail:
            nodes += tail
        inner = tuple(put(x, tail if x.nodes and r.nodes and x.nodes[-1] == r.nodes[-1]
                          else []) for x in r.inner)
        return Region(r.policy, tuple(nodes), r.save, inner)

    return [put(r, last if i == len(regions) - 1 else []) for i, r in enumerate(regions)]


def variant_record(name: str, graph: CostGraph, schedule: Schedule, peak_bytes: int,
                   solved: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the schedule's ``meta[VARIANTS]`` holds of one variant: its name, the predicted
    peak of its step under its own schedule, how it was solved (``solved``: the solver, its
    status, the space its status refers to), and per unit its `UnitRun` (JSON)."""
    units = {}
    for path, runs in unit_runs(graph, schedule).items():
        run = runs[0]
        units[path] = {"ops": [list(o) for o in run.ops],
                       "regions": [r.to_dict() for r in run.regions],
                       "flop_saves": sorted(run.flop_saves)}
    return {"name": name, "peak_bytes": int(peak_bytes), **({"solved": solved} if solved else {}),
            "units": units}


def runs_from_meta(schedule: Schedule) -> dict[str, list[UnitRun]]:
    """The variants' `UnitRun` of each unit, by path, read back from ``meta[VARIANTS]``.

    Raises:
        ScheduleError: the entry is not in the shape `variant_record` writes (a file edited
            by hand), naming where.
    """
    raw = schedule.meta.get(VARIANTS, [])
    if not isinstance(raw, list):
        raise ScheduleError(f"meta.{VARIANTS}: expected a list, got {type(raw).__name__}")
    out: dict[str, list[UnitRun]] = {}
    for i, v in enumerate(raw):
        where = f"meta.{VARIANTS}[{i}]"
        units = v.get("units") if isinstance(v, dict) else None
        if not isinstance(units, dict):
            raise ScheduleError(f"{where}.units: expected an object of unit paths")
        for path, u in units.items():
            at = f"{where}.units[{path!r}]"
            try:
                ops = tuple((str(o), str(t)) for o, t in u["ops"])
                regions = tuple(region_from_dict(f"{at}.regions[{j}]", r, nested=True)
                                for j, r in enumerate(u["regions"]))
                flops = frozenset(str(n) for n in u.get("flop_saves", []))
            except (KeyError, TypeError, ValueError) as e:
                if isinstance(e, ScheduleError):
                    raise
                raise ScheduleError(f"{at}: expected ops, regions and flop_saves as "
                                    f"written by solve ({e!r:.80})") from None
            out.setdefault(path, []).append(UnitRun(ops, regions, flops))
    return out


def variant_inputs(model: torch.nn.Module, example_inputs: Any
                   ) -> list[tuple[str, Any, Callable[[], ContextManager[None]]]]:
    """The variants of the step at ``example_inputs`` that the model's units may also be
    called with in training: ``(name, inputs, context)``, profiled as the model runs inside
    ``context``. For a Hugging Face model's keyword batch: without its ``attention_mask``
    (an unpadded batch: eager code then passes its layers no mask, ``is_causal``) and with
    one padded position (a padding collator's batch, and a compiled step's, whose mask
    builder cannot read the mask's values: an explicit mask). None for other models or
    positional inputs: their calls run the same ops whatever the batch."""
    import sys

    if "transformers.masking_utils" not in sys.modules:
        return []
    out: list[tuple[str, Any, Callable[[], ContextManager[None]]]] = []
    if not isinstance(example_inputs, Mapping):
        return out
    mask = example_inputs.get("attention_mask")
    if mask is not None:  # (all ones, eager code passes its layers no mask: as without one)
        out.append(("unpadded", {k: v for k, v in example_inputs.items()
                                 if k != "attention_mask"}, contextlib.nullcontext))
    if isinstance(mask, torch.Tensor):
        if mask.dim() == 2 and mask.numel() > 1 and not bool((mask == 0).any()):
            out.append(("padded", {**example_inputs, "attention_mask": _padded(mask)},
                        contextlib.nullcontext))
    elif mask is None and _takes_mask(model):
        ids = next((x for x in example_inputs.values()
                    if isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point()),
                   None)
        if ids is not None and ids.numel() > 1:
            out.append(("padded", {**example_inputs,
                                   "attention_mask": _padded(torch.ones_like(ids))},
                        contextlib.nullcontext))
    return out


def _padded(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` with its first row's last position padded (a padding collator's batch)."""
    out = mask.clone()
    out[0, -1] = 0
    return out


def _takes_mask(model: torch.nn.Module) -> bool:
    import inspect

    try:
        return "attention_mask" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
