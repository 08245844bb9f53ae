"""A traced step run under a schedule: recompute regions as non-reentrant checkpoints.

`CheckpointedStep` checks a schedule against a `trace`d graph (`capture.program.Program`) and
runs it as generated code (`executor.generate`): keep regions inline, each ``recompute``
region under ``torch.utils.checkpoint.checkpoint(use_reentrant=False,
preserve_rng_state=True)``, a region with a save set under a selective-checkpoint policy that
marks every op of those nodes MUST_SAVE. Buffers a region mutates in forward (BatchNorm
running statistics) are updated once per step; values are freed after their last reader, as
profiling frees them, so the lifetimes are the profiled ones. Eagerly it computes bit for bit
what the node-by-node `Program` computes; the same code runs under ``torch.compile`` (see
`executor` for what differs there).

`rewrite` wraps it into the planned module; nothing here decides when it runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from .capture.autocast_cache import cache_off, caches_casts
from .capture.mutation import written_reads
from .capture.program import Program
from .cost.compiled_form import flop_saves
from .executor import PlannedRegion, generate
from .ir.replays import labelled_recomputed
from .ir.schedule import Region, Schedule, ScheduleError

__all__ = ["CheckpointedStep"]


class CheckpointedStep:
    """The model part of a traced step with ``schedule`` applied, as generated code
    (`executor.generate`); ``root`` is the module that stands for the traced model at run
    time (`capture.program.Program`); ``like``: the program of an identical unit's trace whose
    graph ``gm`` is (`units.share`).

    Attributes:
        prog: the traced step (`capture.program.Program`).
        schedule: the `Schedule` it runs.
        regions: the schedule's regions resolved against the graph (`executor.PlannedRegion`).
        code: the generated executor, an ``fx.GraphModule`` (``print(step.code.code)``).

    Raises:
        ScheduleError: the schedule's regions do not name the graph's model nodes in order,
            or a recompute region would replay a value written in place after it.
    """

    def __init__(self, gm: fx.GraphModule, schedule: Schedule, root: nn.Module | None = None,
                 *, like: Program | None = None):
        # (attributes are read from ``root``, the planned module, at each run: what a wrapper
        # such as FSDP2's fully_shard swaps in is what the step uses; ``like``: an identical
        # module's program, whose graph ``gm`` is, `Program`)
        self.prog = Program(gm, root=root, like=like)
        self.schedule = schedule
        self.regions = _plan(self.prog, schedule)
        self.code = generate(self.prog, self.regions)
        self._attr_names = tuple(self.prog.attrs)
        self._n_inputs = len(self.prog.placeholders)
        # the output's leaves that are constants, not graph values (None for those that are)
        self._out_consts = tuple((False, x) if isinstance(x, fx.Node) else (True, x)
                                 for x in self.prog.model_out_leaves)

    @property
    def info(self) -> Any:
        """The graph's `TraceInfo`."""
        return self.prog.info

    def __call__(self, args: tuple[Any, ...]) -> Any:
        """The model's output for positional ``args`` (gradients on: the caller checks).

        Plain Python over the generated code, which ``torch.compile`` traces into one graph:
        the inputs' leaves and the attributes, read from the live module now, go in; the
        model's output comes back in its own structure."""
        flat = pytree.tree_leaves(tuple(args))
        if len(flat) != self._n_inputs:
            raise TypeError(f"the traced model takes {self._n_inputs} inputs, got {len(flat)}")
        attrs = self.prog.attrs
        args = (*flat, *[attrs[name] for name in self._attr_names])
        if torch.compiler.is_compiling() or not caches_casts():
            values = iter(self.code(*args))
        else:  # (the casts it makes are then freed with the activations: as profiled)
            with cache_off():
                values = iter(self.code(*args))
        leaves = [leaf if const else next(values) for const, leaf in self._out_consts]
        return pytree.tree_unflatten(leaves, self.prog.model_out_spec)


def _plan(prog: Program, schedule: Schedule) -> list[PlannedRegion]:
    by_name = prog.by_name
    model_names = [n.name for n in prog.nodes if n.name not in prog.info.loss_nodes]
    got = [n for r in schedule.regions for n in r.nodes]
    if got != model_names:
        diff = next((i for i, (a, b) in enumerate(zip(got, model_names)) if a != b),
                    min(len(got), len(model_names)))
        a = got[diff] if diff < len(got) else None
        b = model_names[diff] if diff < len(model_names) else None
        raise ScheduleError(
            f"schedule does not match the traced model: at node {diff} the schedule has {a!r} "
            f"and the model {b!r}; solve again for this model")
    readers: dict[str, list[int]] = {}
    regions = []
    flops = flop_saves(schedule)
    for r in schedule.regions:
        nodes = [by_name[n] for n in r.nodes]
        regions.append(PlannedRegion(r.recompute, nodes, [], [], r.save,
                                     flop_save=r.save & flops))
    out_names = {x.name for x in prog.model_out_leaves if isinstance(x, fx.Node)}
    for ri, r in enumerate(regions):
        inside = {n.name for n in r.nodes}
        ins: dict[str, None] = {}
        for n in r.nodes:
            for a in n.all_input_nodes:
                if a.name not in inside and a.op != "get_attr":
                    ins[a.name] = None
                    readers.setdefault(a.name, []).append(ri)
        r.inputs = list(ins)
    for ri, r in enumerate(regions):
        r.outputs = [n.name for n in r.nodes
                     if n.name in out_names or any(x != ri for x in readers.get(n.name, ()))]
        r.attrs = _attrs(r.nodes)
    for r, sr in zip(regions, schedule.regions):
        r.inner = [_inner(prog, x, out_names) for x in sr.inner]
    _check_mutations(prog, regions)
    return regions


def _attrs(nodes: list[fx.Node]) -> list[str]:
    return list(dict.fromkeys(a.name for n in nodes for a in n.all_input_nodes
                              if a.op == "get_attr"))


def _inner(prog: Program, r: Region, out_names: set[str]) -> PlannedRegion:
    """An inner region of a nested one: its inputs are the values its nodes read from outside
    it, its outputs those of its nodes read outside it (anywhere) or returned by the model."""
    nodes = [prog.by_name[n] for n in r.nodes]
    inside = set(r.nodes)
    inputs = list(dict.fromkeys(a.name for n in nodes for a in n.all_input_nodes
                                if a.name not in inside and a.op != "get_attr"))
    outputs = [n.name for n in nodes
               if n.name in out_names or any(u.name not in inside for u in n.users)]
    return PlannedRegion(r.recompute, nodes, inputs, outputs, r.save, _attrs(nodes),
                         [_inner(prog, x, out_names) for x in r.inner])


def _check_mutations(prog: Program, regions: list[PlannedRegion]) -> None:
    """Refuse a recompute region whose backward replay would see other data than its forward.

    The replay reads the region's inputs as they are in backward. If a value the region reads
    from outside (or a view of it) is written in place by the region itself or by any later
    node, the replay computes from the written value: autograd's saved-tensor check stops it
    in backward ("modified by an inplace operation") without naming the op, so it is refused
    here, before any step. Buffers are exempt: the replay restores those it mutates
    (BatchNorm statistics), and they are not region inputs. The reads are the ones profiling
    records (`mutation.written_reads`, `CostGraph.written_reads`), by which every solver keeps
    its regions clear of this (`ir.replays`): one rule on both sides.
    """
    reads = written_reads(prog.gm, prog.nodes)
    for label, r in labelled_recomputed(regions) if reads else ():
        start = prog.pos[r.nodes[0]]
        inside = {n.name for n in r.nodes}
        for reader, value, writer in reads:
            if reader in inside and value not in inside and \
                    prog.pos[prog.by_name[writer]] >= start:
                node = prog.by_name[writer]
                raise ScheduleError(
                    f"{label} recomputes from {value.removeprefix('input:')!r}, which node "
                    f"{writer!r} ({node.target}) writes in place afterwards: the backward "
                    f"replay would read the written value. Keep {label} (policy keep), or let "
                    f"one recompute region hold both {writer!r} and the allocation of the "
                    f"value it writes into")
