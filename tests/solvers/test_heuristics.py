"""The baselines in `scheduler.solvers.heuristics`, on hand-made chain graphs (torch-free except
``knapsack``, which runs PyTorch's own solver).

Expected regions are written out by hand from ``checkpoint_sequential``'s rule (k-1 segments of
n // k functions recomputed, the rest kept), never copied from the code's output.
"""

from __future__ import annotations

import pytest
from _chain import chain
from conftest import RECORDED_GRAPHS, budget_bytes, unscheduled_peak

from scheduler.cost.simulate import simulate
from scheduler.ir.schedule import KEEP, RECOMPUTE, Schedule
from scheduler.solvers import (
    FEASIBLE,
    INFEASIBLE,
    UnknownSolverError,
    available,
    get_solver,
)

BASELINES = ["none", "every_block", "sqrt", "uniform:1", "uniform:2", "uniform:3", "greedy",
             "knapsack"]

STEM_BLOCKS_HEAD = ["", "h.0", "h.0", "h.1", "h.1", "h.2", "h.2", "h.3", "h.3", ""]
NO_BLOCKS = [""] * 10


def shape(schedule: Schedule) -> list[tuple[str, int]]:
    """``[(policy, number of nodes), ...]``, region by region."""
    return [(r.policy, len(r.nodes)) for r in schedule.regions]


# ------------------------------------------------------------------------------ the contract


@pytest.mark.parametrize("name", BASELINES)
@pytest.mark.parametrize("fraction", [1.0, 0.8, 0.6, 0.3])
@pytest.mark.parametrize("blocks", [STEM_BLOCKS_HEAD, NO_BLOCKS], ids=["blocks", "no-blocks"])
def test_estimate_is_simulate_and_status_follows_peak(name, fraction, blocks):
    graph = chain(blocks, out_bytes=[1000, 3000, 500, 2000, 1000, 4000, 800, 1200, 900, 600])
    budget = budget_bytes(graph, fraction)
    result = get_solver(name)(graph, budget)
    assert result.schedule is not None
    assert result.estimate == simulate(graph, result.schedule)
    assert result.budget_bytes == budget
    fits = result.estimate.peak_bytes <= budget
    assert result.status == (FEASIBLE if fits else INFEASIBLE)
    assert result.fits is fits
    assert result.schedule.solver == name and result.schedule.status == result.status


@pytest.mark.parametrize("name", BASELINES)
def test_infeasible_budget_reports_the_peak_it_misses_by(name):
    graph = chain(STEM_BLOCKS_HEAD)
    result = get_solver(name)(graph, 1000)  # below parameters + inputs alone
    assert result.status == INFEASIBLE
    assert result.schedule is not None and result.estimate is not None
    assert result.estimate.peak_bytes > 1000
    assert result.estimate == simulate(graph, result.schedule)


def test_none_at_the_unscheduled_peak_is_feasible_and_recomputes_nothing():
    graph = chain(STEM_BLOCKS_HEAD)
    result = get_solver("none")(graph, unscheduled_peak(graph))
    assert result.status == FEASIBLE
    assert shape(result.schedule) == [(KEEP, 10)]
    assert result.estimate.recompute_s == 0.0


@pytest.mark.parametrize("graph_name", [name for name, _ in RECORDED_GRAPHS])
def test_recorded_graphs(recorded_graph, graph_name):
    graph = recorded_graph(graph_name)
    peak = unscheduled_peak(graph)
    for fraction in (1.0, 0.6):
        budget = budget_bytes(graph, fraction)
        for name in BASELINES:
            result = get_solver(name)(graph, budget)
            assert result.estimate == simulate(graph, result.schedule), name
            assert (result.status == FEASIBLE) == (result.estimate.peak_bytes <= budget), name
    for region in get_solver("every_block")(graph, peak).schedule.regions:
        blocks = {graph.node(n).block for n in region.nodes}
        assert len(blocks) == 1 and (region.recompute == bool(blocks.pop()))


# ------------------------------------------------------------------------------ every_block


@pytest.mark.parametrize(("blocks", "expected"), [
    (STEM_BLOCKS_HEAD, [(KEEP, 1), (RECOMPUTE, 2), (RECOMPUTE, 2), (RECOMPUTE, 2), (RECOMPUTE, 2),
                        (KEEP, 1)]),
    (["a", "a", "a", "b", "b", "b"], [(RECOMPUTE, 3), (RECOMPUTE, 3)]),
    # a block interrupted by an outside node is two runs
    (["a", "a", "", "a", "b"], [(RECOMPUTE, 2), (KEEP, 1), (RECOMPUTE, 1), (RECOMPUTE, 1)]),
    (["", "", "x", "", ""], [(KEEP, 2), (RECOMPUTE, 1), (KEEP, 2)]),
    (NO_BLOCKS, [(KEEP, 10)]),  # nothing to wrap: the none schedule
])
def test_every_block_regions_follow_node_block(blocks, expected):
    graph = chain(blocks)
    schedule = get_solver("every_block")(graph, 10**9).schedule
    assert shape(schedule) == expected
    for region in schedule.regions:
        assert len({graph.node(n).block for n in region.nodes}) == 1


# ------------------------------------------------------------------------------ uniform and sqrt


@pytest.mark.parametrize(("blocks", "k", "expected"), [
    # 4 blocks, k=2: one segment of 2 blocks (with the stem) recomputed, the rest kept
    (STEM_BLOCKS_HEAD, 2, [(RECOMPUTE, 5), (KEEP, 5)]),
    # k=3: 4 // 3 = 1 block per segment, two recomputed, the last segment takes the rest
    (STEM_BLOCKS_HEAD, 3, [(RECOMPUTE, 3), (RECOMPUTE, 2), (KEEP, 5)]),
    (STEM_BLOCKS_HEAD, 4, [(RECOMPUTE, 3), (RECOMPUTE, 2), (RECOMPUTE, 2), (KEEP, 3)]),
    (STEM_BLOCKS_HEAD, 1, [(KEEP, 10)]),
    (STEM_BLOCKS_HEAD, 9, [(RECOMPUTE, 3), (RECOMPUTE, 2), (RECOMPUTE, 2), (KEEP, 3)]),  # k > n: n
    # no blocks: the compute nodes are the functions; 10 // 3 = 3
    (NO_BLOCKS, 3, [(RECOMPUTE, 3), (RECOMPUTE, 3), (KEEP, 4)]),
    (NO_BLOCKS, 4, [(RECOMPUTE, 2), (RECOMPUTE, 2), (RECOMPUTE, 2), (KEEP, 4)]),
    (NO_BLOCKS, 10, [(RECOMPUTE, 1)] * 9 + [(KEEP, 1)]),
])
def test_uniform_mirrors_checkpoint_sequential(blocks, k, expected):
    graph = chain(blocks)
    result = get_solver(f"uniform:{k}")(graph, 10**9)
    assert shape(result.schedule) == expected
    assert result.solver == f"uniform:{k}"


@pytest.mark.parametrize("k", [2, 3, 4])
def test_uniform_has_k_regions_the_last_kept(k):
    graph = chain(["", *[f"h.{i // 3}" for i in range(12)], ""])  # 4 blocks of 3 nodes
    regions = get_solver(f"uniform:{k}")(graph, 10**9).schedule.regions
    assert len(regions) == k
    assert [r.policy for r in regions] == [RECOMPUTE] * (k - 1) + [KEEP]
    # cuts fall on block boundaries
    for r in regions[1:]:
        first = graph.node(r.nodes[0])
        before = graph.nodes[graph.index(first.name) - 1]
        assert first.block and before.block != first.block


@pytest.mark.parametrize(("blocks", "expected_k"), [
    ([f"h.{i}" for i in range(9)], 3),  # 9 blocks: 3 segments
    ([f"h.{i // 2}" for i in range(32)], 4),  # 16 blocks of 2 nodes: 4 segments
    ([""] * 16, 4),  # no blocks: 16 nodes
    ([""] * 2, 1),  # round(sqrt(2)) = 1: no checkpointing
])
def test_sqrt_uses_about_sqrt_n_segments(blocks, expected_k):
    graph = chain(blocks)
    sqrt = get_solver("sqrt")(graph, 10**9).schedule
    same = get_solver(f"uniform:{expected_k}")(graph, 10**9).schedule
    assert shape(sqrt) == shape(same)
    assert len(sqrt.regions) == expected_k


@pytest.mark.parametrize("bad", ["0", "-1", "x", "2.5", "1e3"])
def test_uniform_bad_k_names_the_value(bad):
    with pytest.raises(UnknownSolverError, match=f"uniform:{bad}'.*integer >= 1"):
        get_solver(f"uniform:{bad}")


def test_unknown_solver_lists_the_valid_ones():
    with pytest.raises(UnknownSolverError) as info:
        get_solver("chekpoint_everything")
    message = str(info.value)
    assert "'chekpoint_everything'" in message
    for name in ["none", "every_block", "sqrt", "uniform:K", "greedy", "knapsack"]:
        assert name in message
        assert name in available()


# ------------------------------------------------------------------------------ greedy


def test_greedy_keeps_everything_when_everything_fits():
    graph = chain(STEM_BLOCKS_HEAD)
    result = get_solver("greedy")(graph, unscheduled_peak(graph))
    assert result.status == FEASIBLE
    assert result.estimate.recompute_s == 0.0


def test_greedy_recompute_grows_as_the_budget_shrinks():
    # same candidates at every budget: a smaller budget can only cost more recompute
    graph = chain(NO_BLOCKS, out_bytes=[1000, 3000, 500, 2000, 1000, 4000, 800, 1200, 900, 600])
    results = [get_solver("greedy")(graph, budget_bytes(graph, f))
               for f in (1.0, 0.9, 0.8, 0.7, 0.6)]
    feasible = [r for r in results if r.status == FEASIBLE]
    assert len(feasible) >= 3
    rc = [r.estimate.recompute_s for r in feasible]
    assert rc == sorted(rc)


def test_greedy_infeasible_returns_its_lowest_peak_which_then_fits():
    graph = chain(NO_BLOCKS, out_bytes=[1000, 3000, 500, 2000, 1000, 4000, 800, 1200, 900, 600])
    low = get_solver("greedy")(graph, 1000)
    assert low.status == INFEASIBLE
    at_its_peak = get_solver("greedy")(graph, low.estimate.peak_bytes)
    assert at_its_peak.status == FEASIBLE
    assert get_solver("greedy")(graph, low.estimate.peak_bytes - 1).status == INFEASIBLE


# ------------------------------------------------------------------------------ knapsack


def saved_by_others(graph) -> dict[str, int]:
    """Bytes of each node's output storages that some node saves (the knapsack's item weight)."""
    out = dict.fromkeys(graph.compute_nodes, 0)
    for st in graph.storages.values():
        if st.savers and st.producer in out:
            out[st.producer] += st.bytes
    return out


def test_knapsack_keeps_everything_when_everything_fits():
    graph = chain(STEM_BLOCKS_HEAD)
    result = get_solver("knapsack")(graph, unscheduled_peak(graph))
    assert shape(result.schedule) == [(KEEP, 10)]
    assert result.status == FEASIBLE


@pytest.mark.parametrize("fraction", [0.9, 0.7, 0.5])
def test_knapsack_respects_its_own_plain_sum_model(fraction):
    # the kept items' bytes fit in what the budget leaves for activations, as a plain sum
    graph = chain(NO_BLOCKS, out_bytes=[1000, 3000, 500, 2000, 1000, 4000, 800, 1200, 900, 600])
    weight = saved_by_others(graph)
    total = sum(weight.values())
    peak = unscheduled_peak(graph)
    budget = budget_bytes(graph, fraction)
    allowed = max(0, budget - (peak - total))
    policy = get_solver("knapsack")(graph, budget).schedule.policy_of()
    kept = sum(w for name, w in weight.items() if policy[name] == KEEP)
    assert kept <= allowed + total * 1e-4  # dp_knapsack quantizes to 1e-4 of the total
    assert any(p == RECOMPUTE for p in policy.values())


def test_knapsack_keeps_the_expensive_node():
    # equal weights, one node 100x slower: it is the one worth keeping
    times = [1e-3] * 10
    times[4] = 0.1
    graph = chain(NO_BLOCKS, out_bytes=1000, time_s=times)
    weight = saved_by_others(graph)
    peak = unscheduled_peak(graph)
    # room for exactly one item under the plain-sum model
    budget = peak - sum(weight.values()) + 1000
    policy = get_solver("knapsack")(graph, budget).schedule.policy_of()
    assert policy["n4"] == KEEP
    assert [n for n, w in weight.items() if w and policy[n] == KEEP] == ["n4"]
