"""FSDP2's memory on one rank (`fsdp2_rank`), in the order measured on torch 2.13 (gloo, CPU;
docs/distributed.md has it in words). Torch-free."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..ir.graph import CostGraph
from ..ir.replays import unit_calls
from .engines import DTYPE_BYTES, FSDP2, Param, ParallelError, optimizer_bytes

__all__ = ["fsdp2_rank", "persistent_grads"]


def persistent_grads(graph: CostGraph) -> dict[int, tuple[int, int]]:
    """The gradients alive when backward ends (of parameters, or of inputs): id -> (the step
    that allocated it, bytes)."""
    live: dict[int, tuple[int, int]] = {}
    for i, step in enumerate(graph.bwd_steps):
        for kind, gid, b in step.events:
            if kind == "a":
                live[gid] = (i, b)
            else:
                live.pop(gid, None)
    return live


@dataclass(frozen=True)
class _Group:
    """What FSDP2 moves for one ``fully_shard`` module (bytes, on one rank)."""

    gathered: int  # the all-gather's output, and the unsharded parameters copied out of it
    sharded: int  # this rank's padded shards
    copy_in: int  # the all-gather's input cast to param_dtype (none without a policy)
    reduce_in: int  # the reduce-scatter's input: every trainable parameter's padded gradient
    reduce_out: int  # its output, which becomes the sharded gradients
    grads: int  # the sharded gradients (reduce_out cast to the parameters' dtype, if not in it)
    #: CPU (gloo) only: ``chunk_cat``'s padded copy of each trainable parameter's gradient
    #: whose rows the world does not divide, then (reducing in another dtype) its cast copies
    pads: tuple[int, ...]
    casts: tuple[int, ...]
    grad_bytes: int  # the unsharded gradients (in param_dtype)
    last_grad: int  # the last trainable parameter's gradient (kept until the reduce returns)


def _group(params: Sequence[Param], world: int, cfg: FSDP2) -> _Group:
    train = [p for p in params if p.trainable]
    gloo = cfg.backend == "gloo"
    c = DTYPE_BYTES[cfg.param_dtype] if cfg.param_dtype else 0

    def gathered(p: Param) -> int:  # (bytes per element in param_dtype)
        return p.shard_bytes(world) // p.itemsize * (c or p.itemsize)

    def reduced(p: Param) -> int:  # (a reduce_dtype equal to param_dtype is none, as FSDP2's)
        if cfg.reduce_dtype and cfg.reduce_dtype != cfg.param_dtype:
            return p.shard_bytes(world) // p.itemsize * DTYPE_BYTES[cfg.reduce_dtype]
        return gathered(p)

    cast = c and any(c != p.itemsize for p in params)
    reduce_out = sum(reduced(p) for p in train)
    grads = sum(p.shard_bytes(world) for p in train)
    return _Group(
        gathered=world * sum(gathered(p) for p in params),
        sharded=sum(p.shard_bytes(world) for p in params),
        copy_in=sum(gathered(p) for p in params) if cast else 0,
        reduce_in=world * reduce_out, reduce_out=reduce_out,
        grads=grads if any(reduced(p) != p.shard_bytes(world) for p in train) else 0,
        pads=tuple(world * gathered(p) for p in train if p.rows % world) if gloo else (),
        casts=tuple(world * gathered(p) for p in train if reduced(p) != gathered(p))
        if gloo else (),
        grad_bytes=sum(p.bytes // p.itemsize * (c or p.itemsize) for p in train),
        last_grad=train[-1].bytes // train[-1].itemsize * (c or train[-1].itemsize)
        if train else 0)


class _Events:
    """Synthetic engine events, with gradient ids of their own."""

    def __init__(self, first_id: int):
        self.next = first_id
        self.out: list[tuple[str, int, int]] = []
        self.empty: set[int] = set()  # ids of nothing (0 bytes): never written

    def alloc(self, b: int) -> int:
        gid, self.next = self.next, self.next + 1
        if b:
            self.out.append(("a", gid, b))
        else:
            self.empty.add(gid)
        return gid

    def free(self, gid: int) -> None:
        if gid not in self.empty:
            self.out.append(("f", gid, 0))

    def scratch(self, b: int) -> None:
        if b:
            self.free(self.alloc(b))

    def take(self) -> list[tuple[str, int, int]]:
        out, self.out = self.out, []
        return out


def fsdp2_rank(graph: CostGraph, cfg: FSDP2, groups: Mapping[str, Sequence[Param]]
               ) -> CostGraph:
    """FSDP2's memory on one rank, in the order measured on torch 2.13 (docs/distributed.md
    has it in words): shards always; in forward the root's gathered parameters throughout, a
    unit's while it runs (``reshard_after_forward=False``: from then on), and each gather's
    flat buffer until the next copy-out; in backward the gather of each unit again, with the
    prefetch of the unit before (False: none), and at a unit's end its reshard, then the
    reduce-scatter of its gradients (the previous one's input freed, its own kept until the
    next)."""
    world, gloo, reshard = cfg.world, cfg.backend == "gloo", cfg.reshard_after_forward
    calls = unit_calls(graph)
    paths = [p for p, _, _ in calls]
    if len(set(paths)) != len(paths) or set(paths) != set(groups) - {""}:
        raise ParallelError(
            f"FSDP2 per unit needs each unit called once in the step and its parameters: "
            f"units {sorted(set(paths))}, parameter groups {sorted(set(groups) - {''})}")
    g = {path: _group(ps, world, cfg) for path, ps in groups.items()}
    root = g[""]
    names = graph.compute_nodes
    unit_of = {names[i]: path for path, a, b in calls for i in range(a, b)}
    first = {names[a]: path for path, a, _ in calls}
    after = {names[b]: path for path, _, b in calls if b < len(names)}

    # forward: each node's engine bytes, held and spike (`CostGraph.engine_bytes`)
    engine: dict[str, tuple[int, int]] = {}
    level = top = 0

    def add(b: int) -> None:
        nonlocal level, top
        level += b
        top = max(top, level)

    deferred = 0  # the flat buffer of the last gather, kept until the next copy-out

    def gather(grp: _Group) -> None:
        nonlocal deferred
        add(grp.copy_in)
        add(grp.gathered)  # the flat output
        if gloo:
            add(grp.gathered)
            add(-grp.gathered)
        add(-grp.copy_in)
        add(grp.gathered)  # the parameters copied out
        add(-deferred)
        deferred = grp.gathered

    for i, n in enumerate(graph.nodes):
        top = level
        if i == 0:
            gather(root)
        if n.name in after and reshard:
            add(-g[after[n.name]].gathered)  # the unit before resharded after its forward
        if n.name in first:
            gather(g[first[n.name]])
        engine[n.name] = (level, top - level)

    # backward: events appended to the steps (`CostGraph.bwd_steps`)
    steps = list(graph.bwd_steps)
    mine: dict[str, list[int]] = {p: [] for p in paths}
    for i, st in enumerate(steps):
        if st.node in unit_of:
            mine[unit_of[st.node]].append(i)
    grads = persistent_grads(graph)
    unit_grads: dict[str, list[tuple[int, int]]] = {p: [] for p in (*paths, "")}
    for gid, (i, b) in grads.items():
        unit_grads[unit_of.get(steps[i].node, "")].append((gid, b))
    for path in paths:
        want = g[path].grad_bytes
        got = sum(b for _, b in unit_grads[path])
        if got != want or not mine[path]:
            raise ParallelError(
                f"unit {path!r}: the profiled backward leaves {got} bytes of gradients in its "
                f"steps, its trainable parameters have {want}: FSDP2's memory cannot be "
                "placed (a parameter used outside its unit?); plan for one device, or name "
                "other units (units=...)")
    ev = _Events(1 + max((gid for st in steps for _, gid, _ in st.events), default=0))
    held: dict[str, int] = {}  # module -> its unsharded parameters' id
    prefetched: dict[str, int] = {}  # module -> its pending flat buffer's id
    pending_reduce: list[int] = []

    def all_gather(path: str) -> int:
        copy_in = ev.alloc(g[path].copy_in)
        flat = ev.alloc(g[path].gathered)
        if gloo:
            ev.scratch(g[path].gathered)
            ev.scratch(g[path].gathered)
        ev.free(copy_in)
        return flat

    def unshard(path: str) -> None:
        flat = prefetched.pop(path, None)
        if flat is None:
            flat = all_gather(path)
        held[path] = ev.alloc(g[path].gathered)
        ev.free(flat)

    def post_backward(path: str) -> None:
        grp = g[path]
        ev.free(held.pop(path))
        for rid in pending_reduce:
            ev.free(rid)
        pending_reduce[:] = [ev.alloc(grp.reduce_in)]
        pads = [ev.alloc(b) for b in grp.pads]
        for b in grp.casts:
            ev.scratch(b)
        for pid in pads:
            ev.free(pid)
        ours = sorted(unit_grads[path], key=lambda t: t[1] != grp.last_grad)
        for gid, _ in ours[1:]:
            ev.free(gid)
        out = ev.alloc(grp.reduce_out)
        if gloo:  # (a copy of the input, then the average's scalars)
            ev.scratch(grp.reduce_in)
            scalars = [ev.alloc(8), ev.alloc(4)]
            for sid in scalars:
                ev.free(sid)
        if grp.grads:  # (cast to the parameters' dtype)
            ev.alloc(grp.grads)
            ev.free(out)
        if ours:
            ev.free(ours[0][0])

    def append(i: int, events: list[tuple[str, int, int]], *, front: bool = False) -> None:
        old = steps[i].events
        steps[i] = dataclasses.replace(steps[i], events=(
            (*events, *old) if front else (*old, *events)))

    # (forward's last node dropped the engine's bytes: what is gathered when backward starts)
    for path in ("", *([] if reshard else paths)):
        held[path] = ev.alloc(g[path].gathered)
    if paths and reshard:
        prefetched[paths[-1]] = all_gather(paths[-1])
    append(0, ev.take(), front=True)
    for k in range(len(paths) - 1, -1, -1):
        path = paths[k]
        if reshard:
            unshard(path)
            if k:
                prefetched[paths[k - 1]] = all_gather(paths[k - 1])
            append(mine[path][0] - 1, ev.take())
        post_backward(path)
        append(mine[path][-1], ev.take())
    post_backward("")
    for rid in pending_reduce:
        ev.free(rid)
    append(len(steps) - 1, ev.take())
    sharded = sum(grp.sharded for grp in g.values())
    sharded += optimizer_bytes(cfg.optimizer, groups, lambda p: p.shard_bytes(world))
    return dataclasses.replace(
        graph, param_bytes=sharded, engine_bytes=engine, bwd_steps=steps,
        grad_bytes=sum(grp.grads or grp.reduce_out for grp in g.values()))
