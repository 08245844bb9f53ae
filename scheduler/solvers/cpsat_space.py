"""The schedule space `cpsat` searches, as data: its unit points, each compute node's unit, what
each unit costs when recomputed, and schedules read from (or snapped to) unit policies.

Region boundaries lie at `unit_points` (block boundaries, chain cuts and, on graphs with few
blocks, cuts inside blocks as cheap as a block boundary; merged so that every unit has a node
that saves tensors for backward), each region ``keep`` or ``recompute``, no save sets.
`fine_points` (``cpsat_fine``) also puts a boundary after any node that saves tensors.
"""

from __future__ import annotations

from ..cost.static import Static
from ..ir.graph import CostGraph
from ..ir.schedule import KEEP, RECOMPUTE, Schedule
from .config import SolverConfig
from .dp import chain_cuts, crossing_counts

__all__ = ["NS", "fine_points", "region_schedule", "replay_steps", "snap", "unit_costs_ns",
           "unit_points", "units"]

#: the objective's unit: nanoseconds in a second
NS = 1e9


def unit_points(graph: CostGraph, *, config: SolverConfig | None = None) -> list[int]:
    """The region boundaries of the cpsat space: ``[0, ..., n]`` over ``graph.compute_nodes``,
    at most ``config.cpsat_max_units`` units.

    Block boundaries and chain cuts; where that leaves fewer than ``config.cpsat_extra_units``
    units, also positions inside blocks that no more storages cross than some block boundary
    does (`crossing_counts`: cuts as cheap as a block's, such as before a transformer block's
    MLP), evenly thinned to that many units. Units merge until each has a node that saves
    tensors for backward.

    Raises:
        ValueError: ``cpsat_max_units`` below 1.
    """
    config = SolverConfig() if config is None else config
    max_units = config.cpsat_max_units
    if max_units < 1:
        raise ValueError(f"cpsat_max_units={max_units}: the space needs at least 1 unit; "
                         "pass SolverConfig(cpsat_max_units=1) or more")
    names = graph.compute_nodes
    n = len(names)
    blocks = [graph.node(x).block for x in names]
    has_saver = [bool(graph.node(x).saved) for x in names]
    bounds = {c for c in range(1, n) if blocks[c] != blocks[c - 1]}
    cuts = sorted(bounds | set(chain_cuts(graph)))
    room = min(max_units, config.cpsat_extra_units) - 1 - len(cuts)
    if bounds and room > 0:
        counts = crossing_counts(graph)
        cheap = max(counts[c] for c in bounds)
        extra = set(_with_savers([0, *sorted({*cuts, *(
            c for c in range(1, n) if counts[c] <= cheap)}), n], has_saver)) - {*cuts, 0, n}
        extra = sorted(extra)
        if len(extra) > room:
            extra = sorted({extra[int(i * len(extra) / room)] for i in range(room)})
        cuts = sorted({*cuts, *extra})
    if len(cuts) + 1 > max_units:
        cuts = [c for c in cuts if blocks[c] != blocks[c - 1]]
    if len(cuts) + 1 > max_units:
        step = len(cuts) / max(1, max_units - 1)
        cuts = sorted({cuts[int(i * step)] for i in range(max_units - 1)})
    return _with_savers([0, *cuts, n], has_saver)


def _with_savers(points: list[int], has_saver: list[bool]) -> list[int]:
    """``points`` (first 0, last n) merged so that each unit has a node that saves tensors:
    a unit ends at the first point after such a node; the last unit, if it has none, joins
    the one before."""
    n = points[-1]
    merged = [0]
    for b in points[1:]:
        if any(has_saver[merged[-1]:b]) or b == n:
            merged.append(b)
    if len(merged) > 2 and not any(has_saver[merged[-2]:n]):
        merged.pop(-2)
    return merged


def fine_points(graph: CostGraph, *, config: SolverConfig | None = None) -> list[int]:
    """`unit_points` with each unit split after every node that saves tensors but its last
    (so every unit still has one): a boundary may fall after any saver. Beyond
    ``config.cpsat_fine_units`` units, the extra points are evenly thinned. Always a superset
    of `unit_points`."""
    config = SolverConfig() if config is None else config
    base = unit_points(graph, config=config)
    names = graph.compute_nodes
    extra = [i + 1 for a, b in zip(base, base[1:])
             for i in [j for j in range(a, b) if graph.node(names[j]).saved][:-1]]
    room = max(0, config.cpsat_fine_units + 1 - len(base))
    if len(extra) > room:
        extra = [extra[int(i * len(extra) / room)] for i in range(room)]
    return sorted({*base, *extra})


def units(graph: CostGraph, points: list[int]) -> tuple[dict[str, int], list[int]]:
    """The unit of each compute node, and each unit's last backward step of a node that saves
    tensors (-1: none)."""
    names, done = graph.compute_nodes, Static.of(graph).done
    unit = {}
    for u, (a, b) in enumerate(zip(points, points[1:])):
        for x in names[a:b]:
            unit[x] = u
    unit_done = [-1] * (len(points) - 1)
    for x in names:
        if graph.node(x).saved:
            unit_done[unit[x]] = max(unit_done[unit[x]], done[x])
    return unit, unit_done


def replay_steps(graph: CostGraph, unit: dict[str, int]) -> set[int]:
    """The backward steps a replay can happen at: a region replays at the first backward step
    of its savers, so at some unit's first one."""
    first_of: dict[int, int] = {}
    for k, st in enumerate(graph.bwd_steps):
        if st.node in unit and graph.node(st.node).saved:
            first_of.setdefault(unit[st.node], k)
    return set(first_of.values())


def unit_costs_ns(graph: CostGraph, points: list[int]) -> list[tuple[int, int]]:
    """For each unit, in integer ns: (what recomputing it costs: its forward time and the
    checkpoint's hooks for each tensor its nodes save, what is saved when its region ends
    there: the time after its last node that saves something, which the replay stops
    before). Each is rounded to within half a ns, so that a schedule's sum is within 2 ns a
    unit of the simulator's."""
    names = graph.compute_nodes
    costs = []
    for a, b in zip(points, points[1:]):
        full = sum(graph.node(x).time_s for x in names[a:b])
        savers = [x for x in names[a:b] if graph.node(x).saved]
        last = savers[-1] if savers else None
        pref = 0.0
        if last is not None:
            upto = names[a:names.index(last) + 1]
            pref = sum(graph.node(x).time_s for x in upto)
            if graph.replay_mark(last) == 0:  # the replay stops before it runs
                pref -= graph.node(last).time_s
        hooks = graph.checkpoint_saved_s * sum(len(graph.node(x).saved) for x in names[a:b])
        full_ns, pref_ns = round(full * NS), round(pref * NS)
        costs.append((full_ns + round(hooks * NS), full_ns - pref_ns))
    return costs


def region_schedule(graph: CostGraph, points: list[int], ends: list[bool],
                    recompute: list[bool]) -> Schedule:
    """The schedule whose regions end after each unit ``u`` with ``ends[u]`` (the last unit
    always ends one), recomputed when that unit's ``recompute[u]`` is."""
    spans, start = [], 0
    for u in range(len(points) - 1):
        if u == len(points) - 2 or ends[u]:
            spans.append((points[start], points[u + 1], RECOMPUTE if recompute[u] else KEEP))
            start = u + 1
    return Schedule.from_regions(graph, spans, meta={"space": "cpsat unit points"})


def snap(schedule: Schedule, points: list[int]) -> tuple[list[bool], list[bool], bool]:
    """``schedule`` moved onto ``points``: each region boundary to the nearest point. Returns
    (each unit's policy, recompute: True; whether each point but the last is a boundary;
    whether none had to move). A nested schedule (`Schedule.nested`) is refused."""
    if schedule.nested:
        raise ValueError(f"cpsat's space is flat: a nested schedule (depth {schedule.depth}) "
                         "cannot be snapped onto its points; hint it with a flat schedule")
    bounds, i = [0], 0
    policy = []
    for r in schedule.regions:
        i += len(r.nodes)
        bounds.append(i)
        policy.append(r.recompute)
    snapped = [min(points, key=lambda p: (abs(p - b), p)) for b in bounds]
    region = 0
    unit_policy, is_bound = [], []
    for p in points[:-1]:
        while region + 1 < len(snapped) - 1 and snapped[region + 1] <= p:
            region += 1
        unit_policy.append(policy[region])
        is_bound.append(p in snapped)
    return unit_policy, is_bound, snapped == bounds
