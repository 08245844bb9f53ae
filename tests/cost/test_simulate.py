"""The model matches reality: the simulator's predicted peak against the peak measured on CPU
(`scheduler.measure`, live-storage tracking of real training steps) for every example, with
fixed schedules (none, every block, equal segments) and random ones, random save sets included.

Acceptance bound: |predicted - measured| / measured <= 3%. The worst case is printed.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from conftest import RECORDED_GRAPHS, budget_bytes, peak_error, unscheduled_peak
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scheduler
from scheduler.capture.scratch import without_scratch
from scheduler.capture.trace import trace
from scheduler.cost.simulate import region_costs, simulate
from scheduler.ir.schedule import KEEP, RECOMPUTE, Schedule
from scheduler.rewrite import rewrite
from scheduler.solvers import get_solver

TOLERANCE = 0.03
WORST: dict[str, tuple[float, str]] = {}


class Profiled:
    def __init__(self, name: str, model: Any, inputs: tuple[Any, ...]):
        self.name, self.model, self.inputs = name, model, inputs
        self.graph = scheduler.profile(model, inputs, repeats=1, units=None)
        self.gm = trace(model, inputs)

    def error(self, schedule: Schedule) -> tuple[float, int, int]:
        err, predicted, measured = peak_error(self.graph, schedule,
                                              rewrite(self.gm, schedule, self.model), self.inputs)
        if err >= WORST.get(self.name, (-1.0, ""))[0]:
            WORST[self.name] = (err, schedule.describe().replace("\n", " | ")[:200])
        return err, predicted, measured


#: The U-Net here is 32x32 with 8 base channels (the other tests' 16x16 one is so small that
#: a few KiB of rounding are 1-3% of its peak; still far smaller than its default 64x64, 16).
SIZES: dict[str, dict[str, Any]] = {"unet": dict(size=32, base=8)}


@pytest.fixture(scope="module")
def profiled(build_example: Any) -> Any:
    cache: dict[str, Profiled] = {}

    def get(name: str) -> Profiled:
        if name not in cache:
            model, inputs = build_example(name, **SIZES.get(name, {}))
            cache[name] = Profiled(name, model, inputs)
        return cache[name]

    yield get
    for name, (err, desc) in sorted(WORST.items()):
        print(f"\nworst peak error on {name}: {err:.3%} ({desc})")


EXAMPLES = ["mlp", "gpt", "unet", "hf_gpt2"]
FIXED = ["none", "every_block", "uniform:2", "uniform:4", "sqrt", "greedy"]


@pytest.mark.parametrize("solver", FIXED)
@pytest.mark.parametrize("name", EXAMPLES)
def test_fixed_schedules_predicted_peak_matches_measured(name: str, solver: str,
                                                         profiled: Any) -> None:
    p = profiled(name)
    schedule = get_solver(solver)(p.graph, budget_bytes(p.graph, 0.6)).schedule
    err, predicted, measured = p.error(schedule)
    assert err <= TOLERANCE, f"{name}/{solver}: predicted {predicted}, measured {measured}"


def _random_schedule(g: Any, rnd: random.Random, *, saves: bool = True) -> Schedule:
    names = g.compute_nodes
    n = len(names)
    k = rnd.randint(0, min(6, n - 1))
    cuts = sorted(rnd.sample(range(1, n), k))
    bounds = [0, *cuts, n]
    spans = []
    for a, b in zip(bounds, bounds[1:]):
        policy = rnd.choice((KEEP, RECOMPUTE))
        save: list[str] = []
        if saves and policy == RECOMPUTE and rnd.random() < 0.6:
            candidates = [x for x in names[a:b] if g.allocates(x)]
            save = rnd.sample(candidates, min(len(candidates), rnd.randint(0, 3)))
        spans.append((a, b, policy, save))
    return Schedule.from_regions(g, spans)


def _check_random_schedule(p: Profiled, seed: int, *, saves: bool = False) -> None:
    schedule = _random_schedule(p.graph, random.Random(seed), saves=saves)
    err, predicted, measured = p.error(schedule)
    assert err <= TOLERANCE, (f"{p.name}: predicted {predicted}, measured {measured}\n"
                              f"{schedule.describe()}")


@pytest.mark.parametrize("name", ["mlp", "gpt", "unet"])
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1))
def test_random_schedules_predicted_peak_matches_measured(name: str, seed: int,
                                                          profiled: Any) -> None:
    _check_random_schedule(profiled(name), seed)


@pytest.mark.parametrize("name", ["mlp", "gpt", "unet"])
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1))
def test_random_save_set_schedules_predicted_peak_matches_measured(name: str, seed: int,
                                                       profiled: Any) -> None:
    _check_random_schedule(profiled(name), seed, saves=True)


@pytest.mark.slow
@pytest.mark.parametrize("saves", [False, True])
@pytest.mark.parametrize("name", EXAMPLES)
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1))
def test_many_random_schedules_predicted_peak_matches_measured(name: str, saves: bool,
                                                               seed: int,
                                                               profiled: Any) -> None:
    _check_random_schedule(profiled(name), seed, saves=saves)


def _spans(schedule: Schedule) -> list[list[Any]]:
    out, i = [], 0
    for r in schedule.regions:
        out.append([i, i + len(r.nodes), r.policy, sorted(r.save)])
        i += len(r.nodes)
    return out


def test_cached_value_a_later_region_held_dies_at_its_replay(profiled: Any) -> None:
    """A save-set node's output that a later recompute region takes as input: that region's
    backward lets go of it before this region replays, so the replay pops the cache and the
    value dies there. (Found by hypothesis, seed 69711084: predicted +4.3% when the simulator
    kept it to the end.)"""
    p = profiled("unet")
    g = p.graph
    schedule = _random_schedule(g, random.Random(69711084))
    spans = _spans(schedule)
    bn = "model_up_2_conv_net_4"  # the last node of its region, read by the next region
    (k,) = [i for i, sp in enumerate(spans) if bn in sp[3]]
    assert spans[k][1] < len(g.compute_nodes) and spans[k + 1][2] == RECOMPUTE
    for save in ([bn], []):
        spans[k][3] = save
        err, predicted, measured = p.error(Schedule.from_regions(g, [tuple(x) for x in spans]))
        assert err <= TOLERANCE, (save, predicted, measured)


def test_replay_stops_inside_the_last_saver(profiled: Any) -> None:
    """Dropout saves its mask as the input of its final multiply, which autograd packs before
    the multiply runs: a replay that stops there never runs the multiply, so a cached output
    of it is never popped and stays until the region's backward ends. Recorded as the node's
    `pack_mark`; the prediction is exact."""
    p = profiled("gpt")
    g = p.graph
    drop = "model_transformer_h_1_mlp_dropout"
    events = g.fwd_events[drop]
    assert 0 < g.node(drop).pack_mark < len(events), (g.node(drop).pack_mark, events)
    names = g.compute_nodes
    i = names.index(drop)
    # recompute [c_proj, dropout, add]: dropout is the region's last saver
    for save in ([], [drop], [names[i - 1], drop]):
        spans = [(0, i - 1, KEEP), (i - 1, i + 2, RECOMPUTE, save), (i + 2, len(names), KEEP)]
        s = Schedule.from_regions(g, spans)
        err, predicted, measured = p.error(s)
        assert predicted == measured, (save, predicted, measured)


def test_unscheduled_prediction_is_the_recorded_peak(profiled: Any) -> None:
    """With no checkpointing the simulator replays what profiling recorded (the tensors: the
    kernels' scratch, which the recording's tracker does not see, left out): exactly on the
    chain-like models; on the U-Net at most 1% over, because a node's saved tensors are freed
    at the end of its backward step, where PyTorch frees them after each autograd function
    (a conservative rounding: never under)."""
    for name, slack in (("mlp", 0.0), ("gpt", 0.0), ("unet", 0.01)):
        g = without_scratch(profiled(name).graph)
        predicted = unscheduled_peak(g)
        recorded = g.meta["recorded_peak_bytes"]
        assert recorded <= predicted <= recorded * (1 + slack), (name, predicted, recorded)


def test_region_costs_compose_to_the_peak_on_chains(profiled: Any) -> None:
    """On the MLP (a chain) the per-region split is exact: peak = max_j(held before j +
    local_j), for random region schedules."""
    g = profiled("mlp").graph
    rnd = random.Random(0)
    from scheduler.solvers.dp import chain_cuts

    cuts = chain_cuts(g)
    for _ in range(20):
        chosen = sorted(rnd.sample(cuts, rnd.randint(0, min(4, len(cuts)))))
        bounds = [0, *chosen, len(g.compute_nodes)]
        s = Schedule.from_regions(g, [(a, b, rnd.choice((KEEP, RECOMPUTE)))
                                      for a, b in zip(bounds, bounds[1:])])
        est, costs = region_costs(g, s)
        assert all(c.separable for c in costs)
        held, composed = 0, 0
        for c in costs:
            composed = max(composed, held + c.local_peak_bytes)
            held += c.held_bytes
        assert composed == est.peak_bytes


def test_save_set_regions_pay_the_policy_dispatch_cost(profiled: Any) -> None:
    """A recompute region with a save set pays `Node.sac_s` for each of its nodes in forward
    and for each node its replay runs; the same region without a save set pays none. Checked
    against a hand count on GPT's first block: recompute times with and without sac_s."""
    import dataclasses

    g = profiled("gpt").graph
    assert any(n.sac_s for n in g.nodes)
    names = g.compute_nodes
    lo = next(i for i, x in enumerate(names) if g.node(x).block == "transformer.h.0")
    hi = max(i for i, x in enumerate(names) if g.node(x).block == "transformer.h.0") + 1
    saved = max((x for x in names[lo:hi] if g.allocates(x)), key=lambda x: g.node(x).time_s)
    spans = [(0, lo, KEEP), (lo, hi, RECOMPUTE, {saved}), (hi, len(names), KEEP)]
    plain = dataclasses.replace(g, nodes=[dataclasses.replace(n, sac_s=None) for n in g.nodes])
    with_sac = simulate(g, Schedule.from_regions(g, spans)).recompute_s
    without = simulate(plain, Schedule.from_regions(plain, spans)).recompute_s
    # the replay runs up to the region's last saver; the forward runs every node
    savers = [x for x in names[lo:hi] if g.node(x).saved]
    replayed = names[lo:names.index(savers[-1]) + 1]
    expected = sum(g.node(x).sac_s or 0.0 for x in names[lo:hi]) + sum(
        g.node(x).sac_s or 0.0 for x in replayed)
    mark = g.replay_mark(savers[-1])
    if mark == 0:  # the replay stops before the last saver runs
        expected -= g.node(savers[-1]).sac_s or 0.0
    assert with_sac - without == pytest.approx(expected, rel=1e-9)
    assert expected > 0
    no_save = [(0, lo, KEEP), (lo, hi, RECOMPUTE), (hi, len(names), KEEP)]
    assert simulate(g, Schedule.from_regions(g, no_save)).recompute_s == pytest.approx(
        simulate(plain, Schedule.from_regions(plain, no_save)).recompute_s, rel=1e-12)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(-5000, 5000),
                          st.one_of(st.none(), st.integers(0, 3))), max_size=40),
       st.booleans())
def test_mem_add_many_is_add_in_turn(ops: list[tuple[int, int, int | None]],
                                     track: bool) -> None:
    """`LiveBytes.add_many` (batched events) leaves every total, peak, local peak and held range
    exactly as `LiveBytes.add` called on each event in turn, across phase changes."""
    from scheduler.cost.memory import LiveBytes

    one, many = LiveBytes(4, track=track), LiveBytes(4, track=track)
    batch: list[tuple[int, int | None]] = []
    for phase, b, owner in ops:
        if phase != one.phase:
            many.add_many(batch)
            batch = []
            many.set_phase(phase)
            one.set_phase(phase)
        one.add(b, owner)
        batch.append((b, owner))
    many.add_many(batch)
    fields = ("cur", "peak") + (("own", "local", "held_lo", "held_hi") if track else ())
    assert [getattr(many, f) for f in fields] == [getattr(one, f) for f in fields]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(-5000, 5000),
                          st.one_of(st.none(), st.integers(0, 6))), max_size=60))
def test_mem_is_its_definition(ops: list[tuple[int, int, int | None]]) -> None:
    """`LiveBytes` with owners against its definition, computed naively: after every event,
    ``cur - sum(own[:phase])`` into the phase's local peak and each ``own[k]``, k < phase,
    into k's held range (it records only what changed since, from a heap of owners)."""
    from scheduler.cost.memory import LiveBytes

    n = 7
    mem = LiveBytes(n, track=True)
    cur, peak, own, local = 0, 0, [0] * n, [0] * n
    seen: dict[int, list[int]] = {}
    for phase, b, owner in ops:
        mem.set_phase(phase)
        mem.add(b, owner)
        cur += b
        peak = max(peak, cur)
        if owner is not None:
            own[owner] += b
        local[phase] = max(local[phase], cur - sum(own[:phase]))
        for k in range(phase):
            seen.setdefault(k, []).append(own[k])
    assert (mem.cur, mem.peak, mem.own, mem.local) == (cur, peak, own, local)
    assert mem.held_lo == [min(seen[k]) if k in seen else 0 for k in range(n)]
    assert mem.held_hi == [max(seen[k]) if k in seen else 0 for k in range(n)]


def test_remembered_replays_change_nothing(monkeypatch: Any, recorded_graph: Any) -> None:
    """Replays are remembered per graph (`Static.replays`); with the memory emptied at every
    new replay, random schedules with save sets simulate to the same estimates and region costs
    on recorded and synthetic graphs."""
    import importlib

    from scheduler.testing.synthetic import random_graph

    graphs = [recorded_graph(name) for name, _ in RECORDED_GRAPHS[:3]]
    graphs += [random_graph(60, kind="dag", seed=s) for s in range(3)]
    sim = importlib.import_module("scheduler.cost.static")
    rnd = random.Random(7)
    cases = []
    for g in graphs:
        for _ in range(40):
            s = _random_schedule(g, rnd)
            # and the same regions with every policy after the first save set flipped: the
            # same replay, its cached values held by later regions' frames or not
            spans, pos, flip = [], 0, False
            for r in s.regions:
                policy = r.policy
                if flip and not r.save:
                    policy = KEEP if r.recompute else RECOMPUTE
                spans.append((pos, pos + len(r.nodes), policy, r.save))
                pos += len(r.nodes)
                flip = flip or bool(r.save)
            cases += [(g, s), (g, Schedule.from_regions(g, spans))]
    remembered = [region_costs(g, s) for g, s in cases]
    again = [region_costs(g, s) for g, s in cases]  # from the memory now
    monkeypatch.setattr(sim, "REPLAY_MEMO", 0)
    for g in graphs:
        sim.Static.of(g).replays.clear()
    fresh = [region_costs(g, s) for g, s in cases]
    assert remembered == again == fresh
    assert sum(bool(s.regions[i].save) for _, s in cases
               for i in range(len(s.regions))) > 20  # save sets were exercised


def test_recompute_regions_pay_the_checkpoint_costs(profiled: Any) -> None:
    """Each recompute region pays `CostGraph.checkpoint_call_s` once and
    `checkpoint_saved_s` for each tensor its nodes save; keep regions pay neither. Checked
    against a hand count on the GPT example with every block recomputed."""
    import dataclasses

    g = profiled("gpt").graph
    assert g.checkpoint_call_s > 0 and g.checkpoint_saved_s > 0
    free = dataclasses.replace(g, checkpoint_call_s=0.0, checkpoint_saved_s=0.0)
    s = get_solver("every_block")(g, 1 << 62).schedule
    regions = [r for r in s.regions if r.recompute]
    assert len(regions) >= 2
    saved = sum(len(g.node(n).saved) for r in regions for n in r.nodes)
    paid = simulate(g, s).recompute_s - simulate(free, Schedule.from_dict(s.to_dict())).recompute_s
    assert paid == pytest.approx(len(regions) * g.checkpoint_call_s
                                 + saved * g.checkpoint_saved_s, rel=1e-9)
    assert simulate(g, Schedule.none(g)).recompute_s == 0.0


def test_simulate_without_the_timeline_gives_the_same_estimate() -> None:
    """``timeline=False`` (what `greedy` uses for its candidates) changes nothing but the
    timeline, on random schedules with save sets of random graphs."""
    from scheduler.testing.synthetic import random_graph

    rng = random.Random(7)
    for seed in range(6):
        g = random_graph(30, kind="dag", seed=seed)
        names = g.compute_nodes
        for _ in range(5):
            cuts = sorted(rng.sample(range(1, len(names)), 4))
            spans, start = [], 0
            for stop in [*cuts, len(names)]:
                policy = rng.choice((KEEP, RECOMPUTE))
                save = [x for x in names[start:stop] if policy == RECOMPUTE and
                        g.allocates(x) and rng.random() < 0.3]
                spans.append((start, stop, policy, save))
                start = stop
            s = Schedule.from_regions(g, spans)
            full, lean = simulate(g, s), simulate(g, s, timeline=False)
            assert full.timeline and lean.timeline == ()
            assert lean == full  # (every field but the timeline)
