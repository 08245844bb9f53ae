"""The form a schedule runs in under ``torch.compile``: `compiled_form`.

Compiled, a replayed op without FLOPs (pointwise ops, normalisations, dropout, views: what
`Node.flop_share` puts at 0) runs inside the backward kernel that reads its result, so its
replay launches no kernel of its own, and it spares writing its output in forward and
reading it back in backward. Saving such an op is then the slower choice wherever what its
replay reads is kept anyway. AOTAutograd's partitioner knows this for the ops nothing tags:
under an ``activation_memory_budget`` below 1 it recomputes them (dropout from its seed,
layer norms from their inputs) and, on the GPT example on a CPU, its step ran 3-5% faster
than at budget 1, at a lower peak (`docs/benchmarks.md`, ``partitioner``). A plan's tags
are orders to it, though, three ways: what a save set holds is saved; an op a recompute
region does not save is recomputed for every reader in backward (``must_recompute``), even
where a node outside the region saved its output, which eagerly keeps it; and an output
one recompute region hands to the next is saved at the boundary.

So a schedule for compiled execution runs in its compiled form, one repeated block
(`Node.block`; the nodes between blocks too) at a time: the block's regions become one
recompute region that saves what the schedule keeps there (its kept nodes with FLOPs, its
save sets, and the outputs that eagerly stay for a later region or for a node outside that
saved them), less every node without FLOPs whose replay needs no FLOP replay (what it reads
in the block is saved and has FLOPs, or is such a node itself). Nothing with FLOPs is
replayed that the schedule did not replay, and fused ops replay instead of being saved.

Saving a node saves every op of it, though, and a node with FLOPs has fused ops too (a
decomposed attention's scaling, softmax and dropout around its two matmuls). Under compile a
save-set node with FLOPs whose inputs in the region are saved or replayed without FLOPs
saves only its ops with FLOPs (`flop_saves`, `checkpointing.FLOP_OPS`): its other ops are
recomputed from them and its inputs, again without a FLOP replay. On the GPT example the
form of "no checkpointing" is then selective checkpointing that saves the matmuls' and the
attention matmuls' outputs, one region a block, as torchtitan's policy does by hand.

A block stays as the schedule has it where a recompute region may not cover it
(`ir.replays.recompute_limits`) or a nested region reaches into it. The eager cost model
prices the form's replays as memory held during a block's replay in backward, which says
little of the compiled step (on the GPT example the form of "no checkpointing" is predicted
at 18.16 MiB eagerly and measured 11.44 MiB compiled, against 15.46 MiB for the model). So
where the compiled peak is measured (``check_budget=False``: `compiled_fit`) every block
takes its form; elsewhere blocks take it one by one only as far as the eager prediction stays
within the schedule's budget. Under ``torch.autocast`` the schedule stays as it is (the form's
save sets under autocast are not checked compiled).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..ir.region import KEEP, RECOMPUTE, Region, ScheduleError
from ..ir.replays import recompute_limits
from .simulate import simulate

if TYPE_CHECKING:
    from ..ir.graph import CostGraph
    from ..ir.schedule import Schedule

__all__ = ["COMPILED_FORM", "FLOP_SAVES", "compiled_form", "flop_saves", "flop_saves_meta",
           "fused"]

#: ``schedule.meta`` key: what `compiled_form` changed (``{"replays_added": nodes the
#: schedule kept that the form replays, "blocks": blocks in their form, FLOP_SAVES: ...}``)
COMPILED_FORM = "compiled_form"
#: key in ``meta[COMPILED_FORM]``: the save-set nodes that save only their ops with FLOPs
FLOP_SAVES = "flop_saves"


def fused(graph: CostGraph, name: str) -> bool:
    """Whether node ``name`` has no FLOP work (`Node.flop_share` 0, or no share recorded and no
    time): under ``torch.compile`` its replay fuses into the backward kernel reading it."""
    n = graph.node(name)
    return n.flop_share == 0 or (n.flop_share is None and n.time_s == 0)


def _cheap(graph: CostGraph, nodes: tuple[str, ...], save: frozenset[str]) -> set[str]:
    """The nodes of a region (in order) without FLOPs whose replay needs no FLOP replay given
    ``save``: each of their inputs inside the region is a saved node with FLOPs or cheap."""
    inside, cheap = set(nodes), set()
    for name in nodes:
        if fused(graph, name) and all(
                p not in inside or p in cheap or (p in save and not fused(graph, p))
                for p in graph.node(name).inputs):
            cheap.add(name)
    return cheap


def _blocks(graph: CostGraph, regions: list[Region]) -> list[int]:
    """Where blocks start over ``graph.compute_nodes`` (and where they end: the last entry),
    but never inside a nested region."""
    blocks = [graph.node(x).block for x in graph.compute_nodes]
    bounds = {0, len(blocks)} | {i for i in range(1, len(blocks)) if blocks[i] != blocks[i - 1]}
    at = 0
    for r in regions:
        if r.inner:
            bounds -= set(range(at + 1, at + len(r.nodes)))
        at += len(r.nodes)
    return sorted(bounds)


def _split(regions: list[Region], bounds: list[int]) -> list[Region]:
    """``regions`` cut at positions ``bounds`` (none inside a nested region), save sets with
    them."""
    out: list[Region] = []
    at = 0
    for r in regions:
        a, b = at, at + len(r.nodes)
        cuts = [a, *(x for x in bounds if a < x < b), b]
        for s, t in zip(cuts, cuts[1:]):
            nodes = r.nodes[s - a:t - a]
            out.append(r if (s, t) == (a, b) else Region(r.policy, nodes, r.save & set(nodes)))
        at = b
    return out


def _kept_eagerly(graph: CostGraph, regions: list[Region]) -> set[str]:
    """The nodes whose outputs backward needs and the schedule keeps when run eagerly: in a
    kept region, those whose storage a node saves for backward; in a recompute region, its
    save set and those a node of another region (or the loss) saves; and those a later
    recompute region reads (its checkpoint keeps its inputs)."""
    where = {n: i for i, r in enumerate(regions) for n in r.nodes}
    kept = {n for r in regions if r.recompute for n in r.save}
    for s in graph.storages.values():
        at = where.get(s.producer)
        if at is not None and any(not regions[at].recompute or where.get(x) != at
                                  for x in s.savers):
            kept.add(s.producer)
    for c in graph.compute_nodes:
        if regions[where[c]].recompute:
            kept.update(p for p in graph.node(c).inputs if p in where and where[p] != where[c])
    return kept


def _kept(regions: Iterable[Region]) -> set[str]:
    """The nodes whose outputs a schedule keeps: those of kept regions and save sets."""
    return {n for r in regions for n in r.nodes if not r.recompute or n in r.save}


def compiled_form(graph: CostGraph, schedule: Schedule, *, check_budget: bool = True) -> Schedule:
    """``schedule`` in the form it runs in under ``torch.compile`` (see the module docstring),
    with ``meta[COMPILED_FORM]`` saying what changed; ``schedule`` itself where nothing does.

    Args:
        graph: the graph ``schedule`` was made for, with its compiled costs or its eager ones
            (peaks are the same).
        schedule: a valid schedule of ``graph``.
        check_budget: where ``schedule.budget_bytes`` is set, take the form only in blocks
            where the predicted peak keeps to it (default); False: in every block, for a
            caller that measures the compiled peak against the budget.
    """
    if graph.meta.get("autocast"):
        return schedule
    names = graph.compute_nodes
    limits = recompute_limits(graph)
    bounds = _blocks(graph, list(schedule.regions))
    pieces = _split(list(schedule.regions), bounds)
    kept = _kept_eagerly(graph, pieces)
    olds: list[tuple[Region, ...]] = []  # (each block's regions as the schedule has them)
    forms: list[tuple[Region, ...]] = []
    flops: list[frozenset[str]] = []  # (each form's save-set nodes that save their FLOP ops)
    k = 0
    for a, b in zip(bounds, bounds[1:]):
        old: list[Region] = []
        while a + sum(len(r.nodes) for r in old) < b:
            old.append(pieces[k])
            k += 1
        olds.append(tuple(old))
        nodes = tuple(names[a:b])
        if any(r.inner for r in old) or b > limits[a]:
            forms.append(olds[-1])
            flops.append(frozenset())
            continue
        run = {n for r in old for n in r.nodes if not r.recompute or n in r.save}
        save = frozenset(n for n in nodes if graph.allocates(n) and (
            n in kept or (n in run and not fused(graph, n))))
        cheap = _cheap(graph, nodes, save)
        save -= cheap
        forms.append((Region(KEEP, nodes) if len(save) == len(nodes)
                      else Region(RECOMPUTE, nodes, save),))
        flops.append(frozenset() if len(save) == len(nodes) else _flop_saves(
            graph, nodes, save, cheap))
    budget = schedule.budget_bytes

    def fits(choice: list[tuple[Region, ...]]) -> bool:
        return budget is None or simulate(graph, replace(
            schedule, regions=[r for c in choice for r in c])).peak_bytes <= budget

    choice = forms
    if check_budget and not fits(choice):  # (block by block, as far as it stays within)
        choice = list(olds)
        for i, f in enumerate(forms):
            if f != choice[i] and fits(choice[:i] + [f] + choice[i + 1:]):
                choice[i] = f
        # (the schedule's regions cut at the blocks' edges are another schedule: where no
        # block takes its form, or they do not keep to the budget, it stays as it is)
        if choice == olds or not fits(choice):
            return schedule
    regions = _merged_keeps([r for c in choice for r in c])
    replays = len(_kept(schedule.regions) - _kept(regions))
    if regions == list(schedule.regions):
        return schedule
    saves = sorted(n for c, f, fl in zip(choice, forms, flops) if c == f for n in fl)
    return replace(schedule, regions=regions, meta={**schedule.meta, COMPILED_FORM: {
        "replays_added": replays, "blocks": sum(c != o for c, o in zip(choice, olds)),
        FLOP_SAVES: saves}})


def _flop_saves(graph: CostGraph, nodes: tuple[str, ...], save: frozenset[str],
                cheap: set[str]) -> frozenset[str]:
    """The nodes of ``save`` with FLOPs that may save only their ops with FLOPs: those whose
    inputs inside the region are saved or cheap, so that their other ops are recomputed
    without replaying an op with FLOPs (and, by induction, their outputs are then to hand as
    well)."""
    inside = set(nodes)
    return frozenset(n for n in save if not fused(graph, n) and all(
        p not in inside or p in save or p in cheap for p in graph.node(n).inputs))


def flop_saves(schedule: Schedule) -> frozenset[str]:
    """The save-set nodes of ``schedule`` that under ``torch.compile`` save only their ops
    with FLOPs (`checkpointing.FLOP_OPS`): those its compiled form named; none for another
    schedule.

    Raises:
        ScheduleError: the schedule's ``meta`` names them in another shape than a list of
            node names (a file edited by hand).
    """
    got = schedule.meta.get(COMPILED_FORM, {})
    names = got.get(FLOP_SAVES, []) if isinstance(got, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ScheduleError(f"meta.{COMPILED_FORM}.{FLOP_SAVES}: expected a list of node "
                            f"names, got {names!r:.200}; solve again")
    return frozenset(names)


def flop_saves_meta(names: Iterable[str]) -> dict[str, Any]:
    """The ``schedule.meta`` entry that `flop_saves` reads back as ``names``: for a schedule
    built from a compiled form's pieces (a unit's regions renamed at a call)."""
    return {COMPILED_FORM: {FLOP_SAVES: sorted(names)}}


def _merged_keeps(regions: list[Region]) -> list[Region]:
    """Adjacent kept regions joined again (`_split` cut them)."""
    out: list[Region] = []
    for r in regions:
        if out and not r.recompute and not out[-1].recompute:
            out[-1] = Region(KEEP, out[-1].nodes + r.nodes)
        else:
            out.append(r)
    return out
