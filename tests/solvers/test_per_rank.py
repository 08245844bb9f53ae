"""Per-rank graphs (`scheduler.parallel`), in one process: what DDP and FSDP2 add is priced by
every solver as `simulate` prices it (brute force over the unit space), written and read back,
and bad configurations are named. The measured per-rank peaks are `test_parallel_ranks`'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch
from _full_space import full_space, small_graph, space_budgets, space_optimum
from test_relax import relax_claims

import scheduler
from scheduler.cost.simulate import simulate
from scheduler.ir.graph import CostGraph
from scheduler.ir.replays import unit_calls
from scheduler.ir.schedule import Schedule
from scheduler.parallel import DDP, FSDP2, Param, ParallelError, parse_parallel, per_rank
from scheduler.solvers import INFEASIBLE, OPTIMAL, get_solver
from scheduler.solvers.floor import floor


def _units_graph(seed: int) -> CostGraph:
    g = small_graph(seed)
    return dataclasses.replace(
        g, units=tuple(sorted({n.module_path for n in g.nodes if n.module_path})))


def _groups(g: CostGraph, grad_itemsize: int = 4) -> dict[str, tuple[Param, ...]]:
    """Parameters for a synthetic graph: each gradient backward leaves is one parameter of
    the unit whose step made it (of the root outside them), ``bytes / grad_itemsize`` rows of
    one float (a gradient in bfloat16 is ``grad_itemsize=2``: the step profiled in it); what
    the graph's parameters hold beyond those is a frozen root parameter."""
    unit_of = {g.compute_nodes[i]: path for path, a, b in unit_calls(g) for i in range(a, b)}
    live: dict[int, tuple[str, int]] = {}
    for st in g.bwd_steps:
        for kind, gid, b in st.events:
            if kind == "a":
                live[gid] = (unit_of.get(st.node, ""), b)
            else:
                live.pop(gid, None)
    groups: dict[str, list[Param]] = {p: [] for p in (*g.units, "")}
    for path, b in live.values():
        groups[path].append(Param(b // grad_itemsize, 1, 4))
    rest = g.param_bytes - sum(b for _, b in live.values())
    if rest > 0:
        groups[""].append(Param(rest // 4, 1, 4, trainable=False))
    return {k: tuple(v) for k, v in groups.items()}


ENGINES = [DDP(), DDP(gradient_as_bucket_view=True), FSDP2(2, "gloo"), FSDP2(3),
           FSDP2(2, "gloo", reshard_after_forward=False), FSDP2(3, reshard_after_forward=False),
           FSDP2(2, "gloo", param_dtype="bfloat16", reduce_dtype="float32"),
           FSDP2(3, param_dtype="bfloat16")]


def _rank(seed: int, engine: object) -> CostGraph:
    g = _units_graph(seed)
    bf16 = getattr(engine, "param_dtype", None) == "bfloat16"  # (profiled in it)
    return per_rank(g, engine, _groups(g, 2 if bf16 else 4))


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.describe())
def test_relax_claims_hold_on_per_rank_graphs(engine: object) -> None:
    """On per-rank graphs (the engine's memory in the forward's held bytes and spikes and in
    backward's events), `relax`'s schedules are simulated as it says, OPTIMAL is the
    enumerated unit space's optimum and its bound lies below it."""
    checked = 0
    for seed in range(8):
        g = _rank(seed, engine)
        checked += len(relax_claims(g, full_space(g), seed))
    assert checked >= 30, checked


@pytest.mark.parametrize("engine", ENGINES[2:], ids=lambda e: e.describe())
def test_cpsat_and_the_floor_agree_with_brute_force_on_per_rank_graphs(engine: object) -> None:
    for seed in range(6):
        g = _rank(seed, engine)
        space = full_space(g)
        least = min(p for p, _ in space)
        f = floor(g, time_limit_s=10)
        assert f.lower_bound_bytes <= least <= f.bytes, (seed, f)
        for budget in space_budgets(space):
            r = get_solver("cpsat")(g, budget, time_limit_s=10)
            opt = space_optimum(space, budget)
            if opt is None:
                assert r.status == INFEASIBLE, (seed, budget)
                continue
            assert r.estimate == simulate(g, r.schedule) and r.estimate.peak_bytes <= budget
            if r.status == OPTIMAL:
                assert r.estimate.recompute_s == pytest.approx(opt, rel=1e-6, abs=1e-15)


def test_fsdp2_shards_what_lives_and_adds_what_runs() -> None:
    """Against hand arithmetic on one graph: the parameters are this rank's padded shards;
    a unit's gathered parameters are held while it runs forward, with its flat gather
    buffer; the step with no recompute peaks higher than the shards but below the graph on
    one device plus every gathered parameter twice."""
    g = _units_graph(4)
    groups = _groups(g)
    r = per_rank(g, FSDP2(2), groups)
    assert r.param_bytes == sum(math.ceil(p.rows / 2) * 4 for ps in groups.values() for p in ps)
    first = {g.compute_nodes[a]: path for path, a, _ in unit_calls(g)}
    for name, path in first.items():
        gathered = 2 * sum(math.ceil(p.rows / 2) * 4 for p in groups[path])
        root = 2 * sum(math.ceil(p.rows / 2) * 4 for p in groups[""])
        assert r.engine_bytes[name][0] == root + 2 * gathered  # root, unit params, flat
    one = simulate(g, Schedule.none(g)).peak_bytes
    everything = sum(2 * 2 * math.ceil(p.rows / 2) * 4 for ps in groups.values() for p in ps)
    assert r.param_bytes < simulate(r, Schedule.none(r)).peak_bytes < one + everything


def test_fsdp2_without_reshard_keeps_every_unit_gathered_until_its_backward() -> None:
    """``reshard_after_forward=False``, against hand arithmetic: while unit k runs forward
    the root and units 0..k are gathered, with k's flat buffer; backward gathers nothing,
    allocating only the reduce-scatters (the resharding's bytes are freed, not allocated)."""
    g = _units_graph(4)
    groups = _groups(g)
    r = per_rank(g, FSDP2(2, reshard_after_forward=False), groups)

    def gathered(path: str) -> int:
        return 2 * sum(math.ceil(p.rows / 2) * 4 for p in groups[path])

    calls = unit_calls(g)
    assert len(calls) >= 2
    for k, (path, a, _) in enumerate(calls):
        before = sum(gathered(p) for p, _, _ in calls[:k])
        held = gathered("") + before + 2 * gathered(path)
        assert r.engine_bytes[g.compute_nodes[a]][0] == held
    last = g.compute_nodes[-1]
    every = sum(gathered(p) for p in groups)
    assert r.engine_bytes[last][0] == every + gathered(calls[-1][0])  # (+ the last flat)
    ours = {gid for st in g.bwd_steps for _, gid, _ in st.events}
    allocs = Counter(b for st in r.bwd_steps for kind, gid, b in st.events
                     if kind == "a" and gid not in ours)
    want = Counter(b for path, ps in groups.items() for b in (
        gathered(path), 2 * sum(math.ceil(p.rows / 2) * 4 for p in ps if p.trainable),
        sum(math.ceil(p.rows / 2) * 4 for p in ps if p.trainable)))
    assert allocs == Counter({b: n for b, n in want.items() if b})


@pytest.mark.parametrize("value", [2, None, "false"])
def test_fsdp2_reshard_after_forward_is_true_or_false(value: object) -> None:
    with pytest.raises(ParallelError, match=f"reshard_after_forward={value!r}.*True or False"):
        FSDP2(4, reshard_after_forward=value)


def _engine_allocs(g: CostGraph, r: CostGraph) -> Counter:
    """The sizes of the backward allocations ``per_rank`` added to ``g`` (ids not in it)."""
    ours = {gid for st in g.bwd_steps for _, gid, _ in st.events}
    return Counter(b for st in r.bwd_steps for kind, gid, b in st.events
                   if kind == "a" and gid not in ours)


@pytest.mark.parametrize("seed", [1, 4])
def test_cpu_only_temporaries_are_gloos_alone(seed: int) -> None:
    """Under NCCL backward allocates, per unit, the flat gather buffer, the gathered
    parameters, the reduce-scatter's input and output (the root: its gathered parameters and
    its reduce-scatter); gloo adds its collectives' scratch (two gather-size buffers per
    gather, a copy of each reduce-scatter input, 8 and 4 bytes of scalars) and CPU
    ``chunk_cat``'s padded copy of each gradient whose rows the world does not divide."""
    g = _units_graph(seed)
    groups = _groups(g)
    world = 3

    def shard(p: Param) -> int:
        return math.ceil(p.rows / world) * p.row_numel * p.itemsize

    want = Counter()
    pads = Counter()
    scratch = Counter()
    for path, ps in groups.items():
        gathered = world * sum(shard(p) for p in ps)
        train = [p for p in ps if p.trainable]
        want.update([gathered] * (2 if path else 1))  # (the root's is gathered in forward)
        want.update([world * sum(shard(p) for p in train), sum(shard(p) for p in train)])
        pads.update(world * shard(p) for p in train if p.rows % world)
        scratch.update([gathered] * (2 if path else 0)
                       + [world * sum(shard(p) for p in train), 8, 4])
    assert pads, "the graph should have rows three does not divide"
    nccl = _engine_allocs(g, per_rank(g, FSDP2(world, "nccl"), groups))
    gloo = _engine_allocs(g, per_rank(g, FSDP2(world, "gloo"), groups))
    def made(c: Counter) -> Counter:
        return Counter({b: n for b, n in c.items() if b})  # (nothing is allocated of 0 bytes)

    assert nccl == made(want)
    assert gloo == made(want + pads + scratch)


@pytest.mark.parametrize("backend,reduce", [("gloo", "float32"), ("nccl", None)])
def test_fsdp2_mixed_precision_moves_what_the_policy_says(backend: str, reduce: object) -> None:
    """``MixedPrecisionPolicy(bfloat16, reduce)`` on float32 parameters, against hand
    arithmetic (docs/distributed.md): shards and sharded gradients in float32; per gather a
    bfloat16 copy-in of the shards, the flat buffer and the parameters in bfloat16; the
    reduce-scatter in ``reduce`` (None: bfloat16, then the output cast to float32); gloo: its
    scratch, the padded copies and (reducing in another dtype) one cast copy per gradient."""
    g = _units_graph(4)
    groups = _groups(g, grad_itemsize=2)  # (the step profiled in bfloat16)
    world, gloo = 3, backend == "gloo"
    r = per_rank(g, FSDP2(world, backend, param_dtype="bfloat16", reduce_dtype=reduce), groups)

    def elems(p: Param) -> int:  # (a rank's padded shard)
        return math.ceil(p.rows / world) * p.row_numel

    rb = 4 if reduce else 2
    want = Counter()
    for path, ps in groups.items():
        train = [p for p in ps if p.trainable]
        half = sum(2 * elems(p) for p in ps)
        reduced = sum(rb * elems(p) for p in train)
        want.update([world * half] + ([half, world * half] if path else []))
        want.update([world * reduced, reduced] + ([] if reduce else [
            sum(4 * elems(p) for p in train)]))
        if gloo:
            want.update([world * half] * (2 if path else 0) + [world * reduced, 8, 4])
            want.update(world * 2 * elems(p) for p in train if p.rows % world)
            want.update(world * 2 * elems(p) for p in train)  # (casts: reduce is float32)
    assert r.param_bytes == sum(4 * elems(p) for ps in groups.values() for p in ps)
    assert r.grad_bytes == sum(4 * elems(p) for ps in groups.values() for p in ps
                               if p.trainable)
    assert _engine_allocs(g, r) == Counter({b: n for b, n in want.items() if b})
    root = world * sum(2 * elems(p) for p in groups[""])
    for path, a, _ in unit_calls(g):
        unit = world * sum(2 * elems(p) for p in groups[path])
        assert r.engine_bytes[g.compute_nodes[a]][0] == root + 2 * unit


def test_ddp_adds_its_buckets_to_every_moment() -> None:
    g = _units_graph(3)
    groups = _groups(g)
    buckets = sum(p.bytes for ps in groups.values() for p in ps if p.trainable)
    some = floor(g, time_limit_s=10).schedule  # (the least peak: it recomputes)
    assert any(r.recompute for r in some.regions)
    for s in (Schedule.none(g), some):
        assert (simulate(per_rank(g, DDP(), groups), s).peak_bytes
                == simulate(g, s).peak_bytes + buckets)
    viewed = simulate(per_rank(g, DDP(True), groups), Schedule.none(g)).peak_bytes
    assert viewed <= simulate(g, Schedule.none(g)).peak_bytes + buckets


def test_a_per_rank_graph_round_trips_through_json(tmp_path) -> None:
    g = per_rank(_units_graph(5), FSDP2(4, "gloo"), _groups(_units_graph(5)))
    assert g.engine_bytes and g.meta["parallel"].startswith("FSDP2 over 4 ranks")
    g.save(tmp_path / "g.json")
    back = CostGraph.load(tmp_path / "g.json")
    assert back == g and back.engine_bytes == g.engine_bytes
    s = Schedule.none(g)
    assert simulate(back, s) == simulate(g, s)


@pytest.mark.parametrize("spec,why", [
    ("fsdp2", "needs the world size"), ("fsdp2:0", "integer >= 1"), ("zero3", "not understood"),
    (FSDP2, "not understood")])
def test_bad_parallel_configurations_are_named(spec: object, why: str) -> None:
    with pytest.raises(ParallelError, match=why):
        parse_parallel(spec)


def test_parallel_configurations_from_what_users_write() -> None:
    assert parse_parallel("ddp") == DDP()
    assert parse_parallel("FSDP2:8") == FSDP2(8)
    assert parse_parallel("fsdp2", 4, "gloo") == FSDP2(4, "gloo")
    assert parse_parallel(None) is None
    with pytest.raises(ParallelError, match="world=0"):
        FSDP2(0)


def test_fsdp2_refuses_gradients_it_cannot_place() -> None:
    g = _units_graph(4)
    groups = dict(_groups(g))
    path = g.units[0]
    groups[path] = (*groups[path], Param(8, 1, 4))  # a parameter whose gradient is not there
    with pytest.raises(ParallelError, match=f"unit {path!r}"):
        per_rank(g, FSDP2(2), groups)


def test_solve_plans_one_rank_of_fsdp2(build_example) -> None:
    """`solve(parallel=...)` plans the per-rank step: units by default, the budget and the
    estimate per rank (below the one-device plan's at the same fraction)."""
    model, inputs = build_example("gpt", batch=4, block_size=32, n_layer=3, dropout=0.0)
    one = scheduler.solve(model, inputs, budget="100%", solver="none", repeats=1)
    plan = scheduler.solve(model, inputs, budget="100%", solver="none", repeats=1,
                           parallel="fsdp2:4")
    assert plan.units.paths and not one.units.paths
    assert plan.graph.meta["parallel"] == "FSDP2 over 4 ranks (nccl)"
    assert plan.estimate.peak_bytes < one.estimate.peak_bytes
    assert plan.graph.param_bytes < one.graph.param_bytes / 3
    torch.manual_seed(0)
    plan.module(*inputs).backward()  # (one process: the plan runs unwrapped as well)


def test_solve_for_a_mixed_precision_policy_profiles_a_copy_in_its_dtype(build_example) -> None:
    """``param_dtype``: the step is profiled on a bfloat16 copy (per_rank checks that its
    unsharded gradients are bfloat16's), the shards stay float32, the model is unchanged;
    a whole-graph plan is refused by name."""
    model, inputs = build_example("gpt", batch=4, block_size=32, n_layer=3, dropout=0.0)
    engine = FSDP2(4, param_dtype=torch.bfloat16, reduce_dtype="float32")
    assert engine.param_dtype == "bfloat16" and "param_dtype=bfloat16" in engine.describe()
    plain = scheduler.solve(model, inputs, budget="100%", solver="none", repeats=1,
                            parallel="fsdp2:4")
    plan = scheduler.solve(model, inputs, budget="100%", solver="none", repeats=1,
                           parallel=engine)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert plan.graph.param_bytes == plain.graph.param_bytes  # (float32 shards)
    assert plan.graph.meta["parallel"] == engine.describe()

    # (per_rank refuses a profile whose gradients are not param_dtype's: solving proves it)
    assert plan.estimate.peak_bytes < plain.estimate.peak_bytes
    with pytest.raises(ParallelError, match="units"):
        scheduler.solve(model, inputs, budget="100%", solver="none", repeats=1, units=None,
                        parallel=engine)


@pytest.mark.parametrize("value", ["int8", torch.int32, "fp8"])
def test_fsdp2_dtypes_are_floating_and_named(value: object) -> None:
    with pytest.raises(ParallelError, match=f"param_dtype={value!r}"):
        FSDP2(2, param_dtype=value)


@pytest.mark.parametrize("engine,world", [(DDP(optimizer="adamw"), 1),
                                          (FSDP2(3, optimizer="adamw"), 3)])
def test_optimizer_state_is_what_adamw_keeps(build_example, engine: object, world: int) -> None:
    """``optimizer="adamw"`` holds, through the step, the bytes of the state
    ``torch.optim.AdamW`` keeps after a step (of this rank's padded shards under FSDP2)."""
    from scheduler.distributed import param_groups

    model, inputs = build_example("gpt", n_layer=2)
    model.transformer.wpe.weight.requires_grad_(False)  # (a frozen one has no state)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    model(*inputs).backward()
    opt.step()
    if world == 1:
        want = sum(t.untyped_storage().nbytes() for st in opt.state.values()
                   for t in st.values())
    else:  # each state tensor as the rank's padded shard of its parameter
        want = sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) * 4 * 2 + 4
                   for p in opt.state)
    g = small_graph(3)  # (no units: every parameter is the root's)
    groups = param_groups(model, ())
    plain = dataclasses.replace(engine, optimizer=None)
    assert per_rank(g, engine, {"": groups[""]}).param_bytes - per_rank(
        g, plain, {"": groups[""]}).param_bytes == want
