"""What a plan's checkpoints keep of the RNG state, from a profiled `CostGraph` alone.

A recompute region that draws random numbers stashes the RNG state at its forward (and again
after each of its save-set nodes) so that its replay draws the same numbers; which nodes may
draw is judged when the step is profiled (`capture.randomness.may_draw_random`) and recorded
in ``graph.meta[RNG_META]`` together with the size of one state on the profiled device. Here,
torch-free, that record is read back: `random_nodes` and the stash a schedule keeps
(`rng_stash_bytes`), which `solvers.stash` holds back from the budget.
"""

from __future__ import annotations

from ..ir.graph import CostGraph
from ..ir.schedule import RECOMPUTE, Region, Schedule

__all__ = ["RNG_META", "random_nodes", "rng_stash_bytes", "rng_stash_guess"]

#: ``graph.meta`` key: ``{"state_bytes": int, "nodes": [names that may draw]}``
RNG_META = "rng"


def random_nodes(graph: CostGraph) -> frozenset[str]:
    """The nodes the profile judged to may draw random numbers (none recorded: none)."""
    return frozenset(graph.meta.get(RNG_META, {}).get("nodes", ()))


def rng_stash_bytes(graph: CostGraph, schedule: Schedule) -> int:
    """An upper bound of the bytes of RNG state ``schedule``'s checkpoints keep at once: one
    state for each recompute region that holds a node that may draw random numbers, and one
    for each of its save-set nodes, all counted as alive together; an inner (nested) region's
    twice, since its parent's replay stashes again. 0 for a graph without ``meta["rng"]``."""
    size, rand = int(graph.meta.get(RNG_META, {}).get("state_bytes", 0)), random_nodes(graph)
    if not size or not rand:
        return 0

    def count(region: Region, times: int) -> int:
        if region.policy != RECOMPUTE or not rand.intersection(region.nodes):
            return 0
        return times * (1 + len(region.save)) + sum(count(r, 2 * times) for r in region.inner)

    return size * sum(count(r, 1) for r in schedule.regions)


def rng_stash_guess(graph: CostGraph) -> int:
    """A first guess of the stash a plan keeps, before there is a plan: one RNG state for each
    repeated block that holds a node that may draw random numbers, and one for each such node
    outside blocks (a plan's recompute regions mostly span blocks, as `every_block`'s do). Not
    a bound: save sets and nesting stash more, and regions that keep their random nodes
    none. 0 for a graph without ``meta["rng"]``."""
    size, rand = int(graph.meta.get(RNG_META, {}).get("state_bytes", 0)), random_nodes(graph)
    if not size or not rand:
        return 0
    blocks = {(n.block, "") if n.block else ("", n.name) for n in graph.nodes if n.name in rand}
    return size * len(blocks)
