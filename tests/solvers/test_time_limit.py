"""Solvers keep to ``time_limit_s``: what runs after a search (the full-space bound a result
is certified against, the simulations of its schedules) comes out of the limit, not after it.

These check what each search is given, not wall times (which the benchmark prints:
``benchmarks/solvers.py`` reports the longest solve against the limit).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import pytest
from _optima import OPTIMA, REL
from conftest import budget_bytes

from scheduler.cost.simulate import simulate
from scheduler.ir.graph import CostGraph
from scheduler.solvers import FEASIBLE, INFEASIBLE, SolverConfig, get_solver
from scheduler.solvers import auto as auto_module
from scheduler.solvers import cpsat as cpsat_module
from scheduler.solvers.base import finish
from scheduler.solvers.bound import full_space_bound
from scheduler.solvers.certify import certify
from scheduler.solvers.relax import relax_and_round
from scheduler.solvers.relaxation import Relaxation


@pytest.fixture
def graph_and_budget(recorded_graph) -> Callable[[str, float], tuple[CostGraph, int]]:
    """``graph_and_budget(name, fraction)``: a fresh recorded graph and that fraction of its
    unscheduled peak."""

    def get(name: str, fraction: float) -> tuple[CostGraph, int]:
        g = recorded_graph(name)
        return g, budget_bytes(g, fraction)

    return get


def test_certify_solves_no_bound_without_time_and_remembers_none(graph_and_budget) -> None:
    """Given no time, `certify` solves no bound; given time, it does; given none again after
    that, it has none: nothing is remembered between calls."""
    g, budget = graph_and_budget("gpt", 0.7)
    sched = get_solver("every_block")(g, budget).schedule
    t = simulate(g, sched).recompute_s
    found = finish(g, budget, sched, solver="x", started=time.perf_counter(), status=FEASIBLE)
    assert found.lower_bound_s is None and found.certifiable and not found.certified
    late = certify(g, found, time_limit_s=0.0)
    assert late.status == FEASIBLE and late.lower_bound_s is None and late.gap is None
    timely = certify(g, found, config=SolverConfig(bound_s=30.0))  # (time enough, even on
    # a loaded machine, to build the relaxation)
    assert 0.0 < timely.lower_bound_s < t and timely.gap == pytest.approx(
        (t - timely.lower_bound_s) / t) == timely.schedule.gap
    again = certify(g, found, time_limit_s=0.0)
    assert again.lower_bound_s is None and again.gap is None and again.status == FEASIBLE


@pytest.mark.parametrize("name", ["cpsat", "cpsat_fine"])
def test_cpsat_ends_its_search_in_time_to_certify(name: str, graph_and_budget,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The search stops ``cpsat_bound_share`` of the limit (at most ``SolverConfig.bound_s``)
    before it, so that certifying the answer fits within it; the same on a second solve of the
    same graph (no state kept between solves). (`cpsat_fine` is given a schedule to start
    from, so that it runs no `cpsat` first.)"""
    searches: list[tuple[float, float | None]] = []
    real = cpsat_module.solve_lazy

    def spy(graph, points, budget, deadline, *rest, **kw):
        searches.append((time.perf_counter(), deadline))
        return real(graph, points, budget, deadline, *rest, **kw)

    monkeypatch.setattr(cpsat_module, "solve_lazy", spy)
    g, budget = graph_and_budget("unet", 0.7)
    kw = {"warm": get_solver("every_block")(g, budget).schedule} if name == "cpsat_fine" else {}
    limit = 3.0
    for config in (SolverConfig(), SolverConfig(), SolverConfig(bound_s=0.1)):
        reserve = min(config.bound_s, config.cpsat_bound_share * limit)
        searches.clear()
        before = time.perf_counter()
        r = get_solver(name)(g, budget, time_limit_s=limit, config=config, **kw)
        (at, until), = searches
        assert r.status != INFEASIBLE
        # (the solver started between ``before`` and the search, ``at``)
        assert before + limit - reserve < until < at + limit - reserve


def test_relax_solves_leave_time_for_their_schedules(graph_and_budget,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of `relax_and_round`'s solves ends before the limit: what follows it (simulating
    the schedules it found, `repair`, the baselines relax compares with) gets the rest."""
    solves: list[tuple[float, float]] = []
    real = Relaxation.solve

    def spy(self, limit, **kw):
        solves.append((time.perf_counter(), limit))
        return real(self, limit, **kw)

    monkeypatch.setattr(Relaxation, "solve", spy)
    g, budget = graph_and_budget("gpt", 0.5)
    limit = 2.0
    started = time.perf_counter()
    relax_and_round(g, budget, limit)
    assert solves
    for at, given in solves:
        assert 0.0 < given and at + given < started + limit


def test_auto_starts_no_cpsat_with_too_little_time_left(graph_and_budget,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """When relax leaves less than `min_solve_s` of the limit and a schedule fits, auto
    answers without starting cpsat or cpsat_fine; with nothing that fits, cpsat still starts
    (with what is left of the limit)."""
    g, budget = graph_and_budget("gpt", 0.7)
    limit = 2.0
    calls: list[str] = []
    real = auto_module.get_solver
    fails = False
    known: dict[str, object] = {}  # solvers' answers found before the clock starts

    def spy(name: str):
        calls.append(name)
        fn = real(name)
        if name in known:
            return lambda *a, **kw: known[name]
        if name != "relax":
            return fn

        def slow_relax(graph, budget_bytes, *, time_limit_s=None, **kw):
            r = fn(graph, budget_bytes, time_limit_s=time_limit_s, **kw)
            # as if it had taken all but a little of the limit, without proving its schedule
            # (or, with ``fails``, finding one)
            time.sleep(max(0.0, started + limit - min_solve_s / 2 - time.perf_counter()))
            return finish(graph, budget_bytes, None if fails else r.schedule, solver="relax",
                          started=started, status=INFEASIBLE if fails else FEASIBLE,
                          lower_bound_s=0.0, full_space=True)
        return slow_relax

    min_solve_s = SolverConfig().min_solve_s
    monkeypatch.setattr(auto_module, "get_solver", spy)
    started = time.perf_counter()
    r = auto_module.auto(g, budget, time_limit_s=limit)
    assert "relax" in calls and "cpsat" not in calls and "cpsat_fine" not in calls
    assert r.status != INFEASIBLE and r.estimate.peak_bytes <= budget
    # at 50% of the U-Net's peak, neither a baseline nor dp fits (nor, here, the floor's
    # offers): with relax answering nothing, cpsat still starts, with what is left of the
    # limit (no more: the limit is one deadline)
    g, budget = graph_and_budget("unet", 0.5)
    assert all(real(b)(g, budget).status == INFEASIBLE for b in (*auto_module.BASELINES, "dp"))
    # blocks and blocks_nested answer nothing here either, in about 2 s on this machine: their
    # answers are found before the clock starts, so that relax starts within the limit on a
    # loaded machine too (their time is not what this test is about)
    known.update({name: real(name)(g, budget, config=SolverConfig())
                  for name in ("blocks", "blocks_nested")})
    assert all(r.status == INFEASIBLE for r in known.values())
    least = auto_module.offered(g, time_limit_s=limit)
    monkeypatch.setattr(auto_module, "offered", lambda *a, **kw: replace(least, bytes=budget + 1))
    fails = True
    calls.clear()
    started = time.perf_counter()
    try:
        r = auto_module.auto(g, budget, time_limit_s=limit)
    finally:
        took = time.perf_counter() - started
    assert calls.index("cpsat") > calls.index("relax") and "cpsat_fine" not in calls
    assert r.status == INFEASIBLE or r.estimate.peak_bytes <= budget
    assert took < limit + SLACK_S


def test_a_bound_remembers_nothing(graph_and_budget) -> None:
    """`full_space_bound` with no time to build the relaxation finds no bound, before and
    after one solved with time enough, and relax's own bound leaves it as it was."""
    g, budget = graph_and_budget("gpt", 0.7)
    assert full_space_bound(g, budget, time_limit_s=0.01) == 0.0  # (no time to build it)
    timely = full_space_bound(g, budget)
    assert 0.0 < timely <= get_solver("relax")(g, budget).estimate.recompute_s
    assert full_space_bound(g, budget, time_limit_s=0.01) == 0.0


def test_cpsat_fine_alone_starts_from_cpsat_within_its_limit(graph_and_budget,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """Without a schedule to start from, `cpsat_fine` runs `cpsat` for
    ``cpsat_fine_warm_share`` of its limit, then searches its finer space for the rest of
    it, less what certifying the answer takes; its solve time counts both, and its answer
    does not beat the recorded optimum. Given a schedule to start from (as `auto` does), it
    runs no `cpsat` first."""
    firsts: list[tuple[float | None, object, float]] = []
    searches: list[tuple[float, float | None]] = []
    real_cpsat, real_search = cpsat_module.cpsat, cpsat_module.solve_lazy

    def cpsat_spy(graph, budget, *, time_limit_s=None, config=None):
        r = real_cpsat(graph, budget, time_limit_s=time_limit_s, config=config)
        firsts.append((time_limit_s, r, time.perf_counter()))
        return r

    def search_spy(graph, points, budget, deadline, *rest, **kw):
        searches.append((time.perf_counter(), deadline))
        return real_search(graph, points, budget, deadline, *rest, **kw)

    monkeypatch.setattr(cpsat_module, "cpsat", cpsat_spy)
    monkeypatch.setattr(cpsat_module, "solve_lazy", search_spy)
    g, budget = graph_and_budget("gpt", 0.7)
    limit = 2.0
    config = SolverConfig(cpsat_fine_warm_share=0.4)
    before = time.perf_counter()
    r = cpsat_module.cpsat_fine(g, budget, time_limit_s=limit, config=config)
    (given, first, first_done), = firsts
    assert given == pytest.approx(0.4 * limit)
    (first_at, _), (fine_at, fine_until) = searches  # (cpsat's search, then the fine one)
    # the fine search ends the certify reserve before the limit counted from the call: the
    # reserve is that share of the time left then, at most `bound_s`
    most = min(config.bound_s, config.cpsat_bound_share * limit)
    least = min(config.bound_s, config.cpsat_bound_share * (limit - (fine_at - before)))
    assert before + limit - most <= fine_until
    assert fine_until <= first_at + limit - least + (fine_at - first_done)
    assert r.status != INFEASIBLE and r.estimate.peak_bytes <= budget
    assert r.estimate == simulate(g, r.schedule)
    assert r.estimate.recompute_s >= OPTIMA["gpt", 0.7] * (1 - REL)  # (proven least)
    assert r.solve_s >= first.solve_s
    firsts.clear()
    cpsat_module.cpsat_fine(g, budget, time_limit_s=limit, warm=first.schedule)
    assert not firsts


def test_the_relaxation_stops_building_at_its_deadline(graph_and_budget,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A relaxation past its deadline stops building between its parts (on the 2,000-node DAG
    the build alone took half a second, so that a bound asked for with less overran the
    limit): `relax_and_round` then answers no bound and no schedule, and builds no more."""
    g, budget = graph_and_budget("gpt", 0.7)
    with pytest.raises(TimeoutError, match="out of time"):
        Relaxation(g, budget, deadline=time.perf_counter())
    built: list[str] = []
    real_regions, real_forward = Relaxation._regions, Relaxation._forward

    def slow_regions(self) -> None:  # (a build part that takes longer than the limit)
        built.append("regions")
        real_regions(self)
        time.sleep(0.2)

    def forward(self) -> None:
        built.append("forward")
        real_forward(self)

    monkeypatch.setattr(Relaxation, "_regions", slow_regions)
    monkeypatch.setattr(Relaxation, "_forward", forward)
    got = relax_and_round(g, budget, 0.1)
    assert (got.bound, got.proven, got.schedule) == (0.0, False, None)
    assert built == ["regions"]
    got = relax_and_round(g, budget, 30.0)  # (time enough: it builds, and bounds)
    assert built == ["regions", "regions", "forward"] and got.bound > 0.0


# -- the limit holds end to end (issue 34, item 9) ------------------------------------------

#: what a solve may take past its limit: after the shared deadline it finishes the simulation
#: or CP-SAT call under way (CP-SAT stops at it too), runs the baselines' least-peak offer if
#: the floor has not yet (under a second on 600 nodes), and simulates and stamps what it
#: answers; doubled and more for a loaded 2-core machine (where the same solves took 6 to
#: 16 s at a 2 s limit before the deadline was shared)
SLACK_S = 2.0


@pytest.mark.parametrize("name, budget", [("hf_gpt2_12l", 1), ("hf_gpt2_12l", 0.5),
                                          ("unet", 1), ("gpt", 0.3)])
def test_a_solve_keeps_to_its_time_limit(recorded_graph, name: str, budget) -> None:
    """`solve_graph` with a 2 s limit answers (a plan or the infeasible-budget error) within
    the limit and `SLACK_S`, on a fresh graph (no tables cached): the block tables (13,000
    simulations on a 380-node U-Net), the floor's offers and probes all stop at one deadline."""
    from scheduler.budget import InfeasibleBudgetError
    from scheduler.plan import solve_graph

    g = recorded_graph(name)
    limit = 2.0
    started = time.perf_counter()
    try:
        got = solve_graph(g, budget, time_limit_s=limit)
    except InfeasibleBudgetError as e:
        assert e.min_feasible_bytes > 0
    else:
        assert got.estimate.peak_bytes <= got.budget_bytes
    took = time.perf_counter() - started
    assert took < limit + SLACK_S, f"{name} at {budget}: {took:.1f} s at a {limit} s limit"


def test_a_table_under_way_stops_at_the_deadline(recorded_graph) -> None:
    """The block DP on a graph whose tables are not built yet, inside a deadline that has
    passed: no table is built or kept, and it answers nothing (no schedule, no floor claimed);
    with time, it answers."""
    from scheduler.solvers.blockdp import block_dp
    from scheduler.solvers.deadline import within

    g = recorded_graph("gpt")
    with within(1e-9):
        time.sleep(0.01)
        r = block_dp(g, budget_bytes(g, 0.5))
    assert r.status == INFEASIBLE and r.schedule is None and r.min_feasible_bytes is None
    assert block_dp(g, budget_bytes(g, 0.5)).status != INFEASIBLE


def test_the_rng_stash_solves_share_one_deadline(recorded_graph, monkeypatch) -> None:
    """Where the first solve (with room held back for the RNG state checkpoints stash) finds
    nothing and nothing is proven not to fit, `solve_with_rng_stash` solves once more without
    the room: that solve gets what the first left of the limit, not the whole limit again
    (T5 with labels at 50%, a 20 s limit, took 45 s). A stand-in solver that keeps to the
    shared deadline (`deadline.clamp`) records what it is given."""
    from scheduler.budget import InfeasibleBudgetError
    from scheduler.plan import solve_graph
    from scheduler.solvers import stash as stash_module
    from scheduler.solvers.deadline import clamp

    given: list[float] = []

    def stand_in(graph, budget, solver, *, time_limit_s):
        given.append(clamp(time_limit_s))
        time.sleep(0.3)  # (the first solve's work)
        return finish(graph, budget, None, solver="stand-in", started=time.perf_counter(),
                      status=INFEASIBLE)

    monkeypatch.setattr(stash_module, "solve_and_certify", stand_in)
    monkeypatch.setattr(stash_module, "rng_stash_guess", lambda graph: 4096)
    g = recorded_graph("gpt")
    limit = 5.0
    with pytest.raises(InfeasibleBudgetError):
        solve_graph(g, 0.5, time_limit_s=limit)
    assert len(given) == 2  # (with the room, then without it)
    assert given[0] <= limit and given[1] <= limit - 0.3


def test_t5_with_labels_solves_within_its_time_limit(monkeypatch) -> None:
    """The issue's case, small: a Hugging Face T5 with labels (dropout: checkpoints stash RNG
    state) at 55% of its peak, where the solve with room for the stash finds nothing and the
    one without it follows. Every solve of the call, timed apart from the plan, ends within
    the limit and a fixed slack (it took twice the limit when the second solve got the whole
    limit again); ``plan.phases_s`` reports that phase. Profiling is not counted (fake, here,
    to be quick)."""
    tf = pytest.importorskip("transformers")
    import torch

    import scheduler
    from scheduler import plan as plan_module

    spans: list[tuple[float, float]] = []
    real = plan_module.solve_graph

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spans.append((started, time.perf_counter()))

    monkeypatch.setattr(plan_module, "solve_graph", timed)
    torch.manual_seed(0)
    cfg = tf.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                      num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                      pad_token_id=0)
    batch = {"input_ids": torch.randint(1, 128, (2, 64)),
             "labels": torch.randint(1, 128, (2, 16))}
    limit = 4.0
    try:
        plan = scheduler.solve(tf.T5ForConditionalGeneration(cfg), batch, budget="55%",
                               time_limit_s=limit, mode="fake", times="roofline",
                               device_spec="cpu")
    except scheduler.InfeasibleBudgetError:
        plan = None
    took = spans[-1][1] - spans[0][0]
    assert took < limit + 3.0, f"solving took {took:.1f} s at a {limit} s limit"
    if plan is not None:
        assert plan.solve_s == plan.phases_s["solve"] >= took
        assert plan.estimate.peak_bytes <= plan.budget_bytes
