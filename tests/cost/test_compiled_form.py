"""The compiled form of a schedule (`cost.compiled_form`): under ``torch.compile`` a plan
replays every op without FLOPs whose replay needs no FLOP replay.

References: every schedule of small chains, with and without save sets (`brute.schedules`),
priced twice by the simulator: once with only FLOP work as time (the form must replay no
FLOP op the schedule did not) and once with only fused work (the form replays at least as
much of it); the form's saved set at the end of forward, which must not grow; the budget,
which its prediction must keep to; and hand-made cases where a rule must hold back (a fused
node reading a FLOP node that is replayed, a region the rewriter refuses, autocast).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations

import pytest
from _chain import chain

import scheduler
from scheduler.cost.compiled import compiled_costs
from scheduler.cost.compiled_form import (COMPILED_FORM, compiled_form, flop_saves,
                                          flop_saves_meta)
from scheduler.cost.simulate import simulate
from scheduler.ir.graph import CostGraph, WrittenRead
from scheduler.ir.schedule import KEEP, RECOMPUTE, Region, Schedule, ScheduleError
from scheduler.solvers.brute import schedules


def shared(g: CostGraph, flops: set[str]) -> CostGraph:
    """``g`` with the nodes in ``flops`` all FLOP work (share 1) and the rest none."""
    return replace(g, nodes=[replace(n, flop_share=1.0 if n.name in flops else 0.0)
                             for n in g.nodes])


def priced(g: CostGraph, keep_flops: bool) -> CostGraph:
    """``g`` with only its FLOP work as time (``keep_flops``) or only its fused work."""
    return replace(g, nodes=[replace(n, time_s=n.time_s * (n.flop_share if keep_flops
                                                           else 1 - n.flop_share))
                             for n in g.nodes], checkpoint_call_s=0.0, checkpoint_saved_s=0.0)


#: seven nodes: n1 and n4 "matmuls", the rest pointwise
FLOPS = {"n1", "n4"}


def graph() -> CostGraph:
    return shared(chain([""] * 7, out_bytes=[4000, 8000, 4000, 4000, 8000, 4000, 2000],
                        time_s=[1e-3, 2e-3, 1e-3, 1e-3, 2e-3, 1e-3, 1e-3]), FLOPS)


def every_schedule(g: CostGraph) -> list[Schedule]:
    """Every schedule of ``g``'s chain with every save set a recompute region may have."""
    def saves(graph: CostGraph, a: int, b: int) -> list[frozenset[str]]:
        names = graph.compute_nodes[a:b]
        return [frozenset(c) for k in range(len(names) + 1) for c in combinations(names, k)]

    names = g.compute_nodes
    return [Schedule([Region(p, tuple(names[a:b]), frozenset(rest[0]) if rest else frozenset())
                      for a, b, p, *rest in spans], fingerprint=g.fingerprint)
            for spans in schedules(g, list(range(len(names) + 1)), save_options=saves)]


@pytest.mark.slow
def test_the_form_replays_no_more_flops_and_at_least_the_fused_work_of_every_schedule() -> None:
    g = graph()
    flops, fused = priced(g, True), priced(g, False)
    changed = 0
    for s in every_schedule(g):
        form = compiled_form(g, s)
        form.validate(g)
        assert simulate(flops, form).recompute_s == pytest.approx(
            simulate(flops, s).recompute_s, abs=1e-15), s.describe()
        assert simulate(fused, form).recompute_s >= simulate(fused, s).recompute_s - 1e-15
        # what is saved beyond what the schedule saved or kept: only outputs that a node
        # outside their region saves for backward (kept eagerly either way)
        kept = {n for r in s.regions for n in r.nodes if not r.recompute or n in r.save}
        region_of = {n: i for i, r in enumerate(s.regions) for n in r.nodes}
        for n in {n for r in form.regions for n in r.nodes
                  if not r.recompute or n in r.save} - kept:
            assert any(x not in region_of or region_of[x] != region_of[n]
                       for st in g.storages.values() if st.producer == n for x in st.savers)
        # and no node with FLOPs leaves what is saved
        assert FLOPS & kept <= {n for r in form.regions for n in r.nodes
                                if not r.recompute or n in r.save}
        changed += form is not s
    assert changed > 100


def test_with_no_checkpointing_it_saves_the_flop_nodes_and_replays_the_rest() -> None:
    g = graph()
    form = compiled_form(g, Schedule.none(g))
    # the chain is one block (no `Node.block`): one region saving the two matmuls, which
    # save only their FLOP ops under compile (what they read is replayed from kept values)
    assert form.regions == [Region(RECOMPUTE, tuple(g.compute_nodes), frozenset(FLOPS))]
    assert form.meta[COMPILED_FORM] == {"replays_added": 5, "blocks": 1,
                                        "flop_saves": ["n1", "n4"]}
    # n0, n2, n3 and n5 replayed (n6's output is the loss's input, which the loss keeps)
    assert simulate(priced(g, False), form).recompute_s == pytest.approx(4e-3)
    assert simulate(priced(g, True), form).recompute_s == 0


def test_a_fused_node_reading_a_replayed_flop_node_stays_saved() -> None:
    # (n1 is replayed: replaying n2 or n3 instead of saving them would need n1's matmul)
    g = graph()
    s = Schedule([Region(RECOMPUTE, ("n0", "n1", "n2", "n3"), frozenset({"n2", "n3"})),
                  Region(KEEP, ("n4", "n5", "n6"))], fingerprint=g.fingerprint)
    form = compiled_form(g, s)
    assert form.regions == [Region(RECOMPUTE, tuple(g.compute_nodes),
                                   frozenset({"n2", "n3", "n4"}))]
    # n2 and n3 save every op (they have no FLOP op to keep); n4 only its matmul, as it
    # reads n3, which is saved
    assert flop_saves(form) == {"n4"}
    s2 = replace(s, regions=[Region(RECOMPUTE, ("n0", "n1", "n2", "n3"),
                                    frozenset({"n1", "n2", "n3"})), s.regions[1]])
    form2 = compiled_form(g, s2)
    assert form2.regions[0].save == frozenset({"n1", "n4"})
    assert flop_saves(form2) == {"n1", "n4"}


@pytest.mark.slow
def test_a_node_saving_only_its_flop_ops_needs_no_flop_replay_for_the_rest() -> None:
    """Under compile a `flop_saves` node recomputes its ops without FLOPs from its inputs:
    priced as a node whose replay costs nothing (its FLOP op stays saved) and dropped from
    the save set, the form must replay no more FLOP work than it does with it saved."""
    g = graph()
    flops = priced(g, True)
    marked_somewhere = unmarked_somewhere = False
    for s in every_schedule(g):
        form = compiled_form(g, s)
        marked = flop_saves(form)
        saved = {n for r in form.regions for n in r.save}
        assert marked <= saved and marked <= FLOPS
        marked_somewhere |= bool(marked)
        unmarked_somewhere |= bool(saved & FLOPS - marked)
        free = replace(flops, nodes=[replace(n, time_s=0.0) if n.name in marked else n
                                     for n in flops.nodes])
        unsaved = replace(form, regions=[replace(r, save=r.save - marked)
                                         for r in form.regions])
        assert simulate(free, unsaved).recompute_s == pytest.approx(
            simulate(flops, form).recompute_s, abs=1e-15), s.describe()
    assert marked_somewhere and unmarked_somewhere


def test_a_schedule_not_in_its_form_saves_every_op() -> None:
    g = graph()
    assert flop_saves(Schedule.none(g)) == frozenset()
    bad = replace(Schedule.none(g), meta={COMPILED_FORM: {"flop_saves": "n1"}})
    with pytest.raises(ScheduleError, match="flop_saves"):
        flop_saves(bad)


def test_the_meta_a_unit_builds_reads_back_as_the_names_it_was_given() -> None:
    g = graph()
    names = ["n3", "n1"]
    assert flop_saves(replace(Schedule.none(g), meta=flop_saves_meta(names))) == {"n1", "n3"}
    assert flop_saves(replace(Schedule.none(g), meta=flop_saves_meta([]))) == frozenset()


def test_the_prediction_keeps_to_the_budget() -> None:
    g = graph()
    for s in every_schedule(g)[::7]:
        peak = simulate(g, s).peak_bytes
        for budget in (peak, peak + 3000):
            form = compiled_form(g, replace(s, budget_bytes=budget))
            assert simulate(g, form).peak_bytes <= budget


def test_autocast_and_nested_regions_and_refused_regions_stay_as_they_are() -> None:
    g = graph()
    auto = replace(g, meta={**g.meta, "autocast": "cpu:bfloat16"})
    assert compiled_form(auto, Schedule.none(auto)).regions == Schedule.none(auto).regions
    nested = Schedule([Region(RECOMPUTE, tuple(g.compute_nodes), inner=(
        Region(KEEP, ("n0", "n1", "n2")), Region(RECOMPUTE, ("n3", "n4", "n5", "n6"))))],
        fingerprint=g.fingerprint)
    assert compiled_form(g, nested) is nested
    # a value written in place after n2 read it: no recompute region holds n2 without it
    refused = replace(g, written_reads=(WrittenRead(reader="n2", value="n1", writer="n3"),))
    form = compiled_form(refused, Schedule.none(refused))
    form.validate(refused, rewritable=True)
    assert all(not r.recompute or "n2" not in r.nodes or "n1" in r.nodes for r in form.regions)


def test_compiled_plans_are_solved_in_their_form() -> None:
    g = graph()
    budget = simulate(g, Schedule.none(g)).peak_bytes
    res = scheduler.solve_graph(g, budget, execution="compiled", time_limit_s=10)
    assert COMPILED_FORM in res.schedule.meta
    assert res.estimate == simulate(compiled_costs(g), res.schedule)
    assert res.estimate.peak_bytes <= budget
    # no FLOP replay; every fused node replayed (brute force: the most fused work there is)
    assert simulate(priced(g, True), res.schedule).recompute_s == 0
    most = max(simulate(priced(g, False), s).recompute_s for s in every_schedule(g)
               if simulate(g, s).peak_bytes <= budget
               and simulate(priced(g, True), s).recompute_s == 0)
    assert simulate(priced(g, False), res.schedule).recompute_s == pytest.approx(most)
    eager = scheduler.solve_graph(g, budget, time_limit_s=10)
    assert COMPILED_FORM not in eager.schedule.meta


def test_below_the_forms_prediction_it_is_taken_only_where_the_peak_is_measured() -> None:
    g = graph()
    budget = simulate(g, Schedule.none(g)).peak_bytes - 1  # (the one block's form: above)
    res = scheduler.solve_graph(g, budget, execution="compiled", time_limit_s=10)
    assert COMPILED_FORM not in res.schedule.meta and res.estimate.peak_bytes <= budget
    measured = scheduler.solve_graph(g, budget, execution="compiled", time_limit_s=10,
                                     measured=True)
    assert measured.schedule.meta[COMPILED_FORM]["blocks"] == 1
    assert simulate(priced(g, True), measured.schedule).recompute_s == pytest.approx(
        simulate(priced(g, True), res.schedule).recompute_s)
    with pytest.raises(ValueError, match="measured must be True or False"):
        scheduler.solve_graph(g, budget, execution="compiled", measured="yes")
