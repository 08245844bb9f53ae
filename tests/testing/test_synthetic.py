"""`scheduler.testing.synthetic`: random cost graphs are valid, realistic and deterministic.

Their "measured" peak is the simulator's; here it is checked against a replay of the graph's
own records written out below (`unscheduled_peak_by_hand`), not against `simulate` again.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from scheduler.cost.simulate import simulate
from scheduler.ir.graph import CostGraph
from scheduler.ir.schedule import KEEP, RECOMPUTE, Schedule
from scheduler.solvers.dp import chain_cuts
from scheduler.testing.synthetic import large_dag, random_graph

CASES = [(kind, n, seed) for kind in ("chain", "dag") for n in (1, 2, 5, 12, 40)
         for seed in range(3)]


def _round_trip(g: CostGraph) -> CostGraph:
    return CostGraph.from_dict(json.loads(json.dumps(g.to_dict())))


def unscheduled_peak_by_hand(g: CostGraph) -> int:
    """The peak of the unscheduled step, replayed event by event from the records (the
    synthetic graphs have no views and no recorded loss node): forward runs each node's
    events, then frees what it read last unless a node saved it, which then lives until the
    last backward step of its savers; backward runs each step's gradient events."""
    last_step = {step.node: i for i, step in enumerate(g.bwd_steps) if step.node}
    end = len(g.bwd_steps) - 1
    dies_after: dict[int, int] = defaultdict(int)  # backward step -> saved bytes freed after it
    live = peak = 0
    for node in g.nodes:
        for kind, sid in g.fwd_events[node.name]:
            live += g.storages[sid].bytes if kind == "a" else -g.storages[sid].bytes
            peak = max(peak, live)
        for st in g.storages.values():
            if st.last_use == node.name and not st.inner_free:
                if st.savers:
                    dies_after[max(last_step.get(m, end) for m in st.savers)] += st.bytes
                else:
                    live -= st.bytes
    grads: dict[int, int] = {}
    for i, step in enumerate(g.bwd_steps):
        for kind, gid, b in step.events:
            if kind == "a":
                grads[gid] = b
                live += b
            else:
                live -= grads.pop(gid)
            peak = max(peak, live)
        live -= dies_after.pop(i, 0)
    assert live == g.grad_bytes and not dies_after  # what is left: the parameters' gradients
    return g.base_bytes + peak


@pytest.mark.parametrize("kind,n,seed", CASES)
def test_graph_is_valid_and_round_trips(kind: str, n: int, seed: int, tmp_path) -> None:
    g = random_graph(n, kind=kind, seed=seed)
    assert _round_trip(g) == g
    g.save(tmp_path / "g.json")
    assert CostGraph.load(tmp_path / "g.json") == g
    assert len(g.compute_nodes) == n
    assert [x.name for x in g.nodes] == [f"n{i}" for i in range(n)] + ["loss"]
    assert g.nodes[-1].is_loss and g.nodes[-1].inputs == (f"n{n - 1}",)


@pytest.mark.parametrize("kind,n,seed", CASES)
def test_records_are_consistent(kind: str, n: int, seed: int) -> None:
    g = random_graph(n, kind=kind, seed=seed, block_size=3)
    pos = {x.name: i for i, x in enumerate(g.nodes)}
    users: dict[str, list[str]] = {x.name: [] for x in g.nodes}
    for x in g.nodes:
        for u in x.inputs:
            users[u].append(x.name)
    for i, x in enumerate(g.nodes[:-1]):
        assert x.block == x.module_path == f"blocks.{i // 3}"
        assert x.op == "call_function" and x.target and x.shape
        if kind == "chain":
            assert x.inputs == ((f"n{i - 1}",) if i else ())
        else:
            assert x.inputs[-1:] == ((f"n{i - 1}",) if i else ())
            assert len(x.inputs) <= 2
    for sid, st in g.storages.items():
        assert st.bytes > 0 and st.bytes % 4 == 0 and st.views == ()
        savers = tuple(x.name for x in g.nodes if any(s.storage == sid for s in x.saved))
        assert sorted(st.savers) == sorted(savers)
        readers = users[st.producer] if st.output else []
        assert st.last_use == max(readers, key=pos.__getitem__, default=st.producer)
        if st.inner_free:
            assert not st.output and not st.savers
    for x in g.nodes:
        events = g.fwd_events[x.name]
        outs = [sid for k, sid in events if k == "a" and g.storages[sid].output]
        assert len(outs) == 1 and x.out_bytes == g.storages[outs[0]].bytes
        for k, sid in events:  # every free follows its allocation inside the same node
            if k == "f":
                assert ("a", sid) in events[:events.index(("f", sid))]
                assert g.storages[sid].inner_free
        for s in x.saved:
            if s.storage is not None:
                assert s.bytes == g.storages[s.storage].bytes
                assert s.source == g.storages[s.storage].producer
    # backward: the seed first, then the nodes in reverse; every free of an earlier allocation
    steps = g.bwd_steps
    assert steps[0].node == "" and steps[0].events == (("a", 0, 4),)
    order = [s.node for s in steps[1:]]
    assert order == sorted(order, key=pos.__getitem__, reverse=True) and order[0] == "loss"
    alive: set[int] = set()
    for s in steps:
        for k, gid, b in s.events:
            if k == "a":
                assert gid not in alive and b > 0
                alive.add(gid)
            else:
                assert gid in alive and b == 0
                alive.remove(gid)
    param_grads = sum(b for s in steps for k, gid, b in s.events if k == "a" and gid in alive)
    assert param_grads == g.grad_bytes
    assert g.measured_step_s == pytest.approx(
        sum(x.time_s for x in g.nodes) + sum(s.time_s for s in steps))
    assert g.measured_peak_bytes == unscheduled_peak_by_hand(g) > g.base_bytes


@pytest.mark.parametrize("kind", ["chain", "dag"])
def test_deterministic_for_a_seed(kind: str) -> None:
    a = random_graph(30, kind=kind, seed=7)
    assert random_graph(30, kind=kind, seed=7) == a
    assert random_graph(30, kind=kind, seed=8) != a


@pytest.mark.parametrize("seed", range(5))
def test_chain_cuts(seed: int) -> None:
    n = 30
    chain = random_graph(n, kind="chain", seed=seed)
    assert len(chain_cuts(chain)) >= n // 2
    dag = random_graph(n, kind="dag", seed=seed)
    assert len(chain_cuts(dag)) < len(chain_cuts(chain))
    assert any(len(x.inputs) == 2 for x in dag.nodes)


@pytest.mark.parametrize("kind,seed", [(k, s) for k in ("chain", "dag") for s in range(5)])
def test_recompute_costs_time(kind: str, seed: int) -> None:
    g = random_graph(10, kind=kind, seed=seed)
    none = simulate(g, Schedule.none(g))
    assert none.recompute_s == 0 and none.peak_bytes == unscheduled_peak_by_hand(g)
    every = simulate(g, Schedule.from_cuts(g, [], [RECOMPUTE]))
    assert every.recompute_s > 0
    # one region per node, alternating: replays at most what recompute-all does (a region
    # whose one node saves only its inputs replays nothing: autograd packs them before the op)
    cuts = list(range(1, 10))
    alt = simulate(g, Schedule.from_cuts(g, cuts, [RECOMPUTE if i % 2 else KEEP
                                                   for i in range(10)]))
    assert 0 <= alt.recompute_s <= every.recompute_s


def test_large_dag() -> None:
    g = large_dag(500, seed=1)
    assert len(g.compute_nodes) == 500
    assert g == random_graph(500, kind="dag", seed=1)
    assert _round_trip(g) == g


@pytest.mark.parametrize("kwargs", [dict(n_nodes=0), dict(n_nodes=3, kind="tree"),
                                    dict(n_nodes=3, block_size=0),
                                    dict(n_nodes=3, skip_prob=1.5)])
def test_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        random_graph(**kwargs)
