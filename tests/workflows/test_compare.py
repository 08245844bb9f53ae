"""``scheduler.compare`` and its report on the small MLP example: every number checked against
an independent source (`simulate`, `measure` of the applied schedule, `parse_budget`, brute
force), the exports against the rows, the plots' series and PNG bytes; ``Plan.plot_timeline``."""

from __future__ import annotations

import csv
import io
import json
import sys
import warnings

import pytest
from conftest import unscheduled_peak

import scheduler
from scheduler import report
from scheduler.budget import parse_budget
from scheduler.cost.simulate import simulate
from scheduler.solvers import INFEASIBLE
from scheduler.solvers.brute import brute_force
from scheduler.solvers.dp import chain_cuts
from scheduler.quantities import format_bytes
from scheduler.workflows.compare import FIELDS, STRATEGIES, Comparison, compare

BUDGETS = ["90%", "60%"]
MIB = 2 ** 20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SIZE = dict(batch=256, dim=32, depth=3)  # 3 blocks: sqrt picks uniform:2, the same schedule


@pytest.fixture(scope="module")
def mlp():
    from examples.mlp import build

    return build(**SIZE)


@pytest.fixture(scope="module")
def compared(mlp, model_state) -> tuple[Comparison, object]:
    model, inputs = mlp
    before = model_state(model)
    c = compare(model, inputs, budgets=BUDGETS, repeats=1, time_limit_s=5, progress=False)
    return c, before


def test_one_row_per_budget_and_strategy_with_the_parsed_budget(compared):
    c, _ = compared
    assert [(r.budget, r.strategy) for r in c.rows] == [(b, s) for b in BUDGETS
                                                        for s in STRATEGIES]
    unconstrained = unscheduled_peak(c.graph)
    assert c.unconstrained_peak_bytes == unconstrained
    for r in c.rows:
        assert r.budget_bytes == parse_budget(r.budget, unconstrained)


def test_predictions_are_the_simulators(compared):
    c, _ = compared
    for r in c.rows:
        assert r.schedule is not None, r  # auto fits both budgets; baselines always have one
        e = simulate(c.graph, r.schedule)
        assert (r.predicted_peak_bytes, r.predicted_step_s, r.predicted_overhead) == (
            e.peak_bytes, e.step_s, e.overhead), r.strategy
        assert r.fits_predicted == (e.peak_bytes <= r.budget_bytes)
        assert r.fits_predicted == (r.status != INFEASIBLE)
        assert r.recomputed_regions == len(r.schedule.recompute_regions)
    none = c.row("none", "90%")
    assert none.predicted_overhead == 0.0 and not none.fits_predicted


def test_auto_is_at_or_below_brute_force_over_the_chain_cuts(compared):
    """auto's schedule recomputes no more than the best of every keep/recompute schedule with
    boundaries at the MLP's chain cuts (brute force, 4,181 schedules: a reference that does not
    run auto's solvers), which beats every fitting baseline at some budget (so the check is
    not the baselines' again)."""
    c, _ = compared
    g = c.graph
    points = sorted({0, *chain_cuts(g), len(g.compute_nodes)})
    beaten = []
    for budget in BUDGETS:
        auto = c.row("auto", budget)
        assert auto.fits_predicted and auto.solver in ("dp", "cpsat", "cpsat_fine", "relax")
        # an exact solver's result carries its gap against the full space's bound: OPTIMAL
        # exactly when there is none left
        assert auto.status in ("OPTIMAL", "FEASIBLE") and auto.gap is not None, auto
        assert (auto.status == "OPTIMAL") == (auto.gap == 0.0) and 0.0 <= auto.gap <= 1.0
        ref = brute_force(g, auto.budget_bytes, points=points)
        assert ref.status != INFEASIBLE, budget
        got = simulate(g, auto.schedule).recompute_s
        assert got <= ref.estimate.recompute_s * (1 + 1e-12), (budget, got, ref.estimate)
        fitting = [r.predicted_step_s for r in c.rows
                   if r.budget == budget and r.strategy != "auto" and r.fits_predicted]
        beaten.append(bool(fitting) and ref.estimate.step_s < min(fitting))
    assert any(beaten), beaten
    # the baselines miss the tighter budget in different ways: rows, not errors
    assert not c.row("sqrt", "60%").fits_predicted and c.row("sqrt", "90%").fits_predicted


def test_measured_peaks_are_what_measure_gives_the_applied_schedule(compared, mlp):
    c, _ = compared
    model, inputs = mlp
    for strategy, budget in (("auto", "60%"), ("every_block", "90%"), ("none", "60%")):
        r = c.row(strategy, budget)
        module = scheduler.apply(model, r.schedule, inputs)
        m = scheduler.measure(module, inputs, repeats=1)
        assert r.measured_peak_bytes == m.peak_bytes, strategy  # CPU storage bytes: exact
        assert r.fits_measured == (m.peak_bytes <= r.budget_bytes)
    assert c.reference.peak_bytes == c.row("none", "90%").measured_peak_bytes


def test_measured_overheads_refer_to_the_none_step_of_the_same_run(compared):
    c, _ = compared
    ref = c.reference
    assert ref is not None and c.device == "cpu"
    for r in c.rows:
        assert r.measured_overhead == pytest.approx(r.measured_step_s / ref.step_s - 1)
    assert c.row("none", "60%").measured_step_s == ref.step_s
    assert c.row("none", "60%").measured_overhead == 0.0


def test_each_distinct_schedule_is_measured_once(compared):
    c, _ = compared
    sqrt, uniform2 = c.row("sqrt", "90%"), c.row("uniform:2", "60%")
    assert sqrt.schedule.regions == uniform2.schedule.regions
    assert sqrt.measured_step_s == uniform2.measured_step_s
    eb90, eb60 = c.row("every_block", "90%"), c.row("every_block", "60%")
    assert (eb90.measured_step_s, eb90.measured_peak_bytes) == (eb60.measured_step_s,
                                                                eb60.measured_peak_bytes)


def test_the_model_is_not_modified(compared, mlp):
    c, before = compared
    before.assert_unchanged(mlp[0])


def test_json_and_csv_hold_the_rows_numbers(compared, tmp_path):
    c, _ = compared
    data = json.loads(c.to_json(tmp_path / "c.json"))
    assert json.loads((tmp_path / "c.json").read_text()) == data
    assert data["rows"] == [r.to_dict() for r in c.rows]
    assert data["reference"] == {"measured_peak_bytes": c.reference.peak_bytes,
                                 "measured_step_s": c.reference.step_s}
    assert data["unconstrained_peak_bytes"] == c.unconstrained_peak_bytes

    text = c.to_csv(tmp_path / "c.csv")
    assert (tmp_path / "c.csv").read_text() == text
    parsed = list(csv.DictReader(io.StringIO(text)))
    assert list(parsed[0]) == list(FIELDS) and len(parsed) == len(c.rows)
    for cells, row in zip(parsed, data["rows"]):
        for key, value in row.items():
            if value is None:
                assert cells[key] == "", key
            elif isinstance(value, bool):
                assert cells[key] == str(value), key
            elif isinstance(value, (int, float)):
                assert float(cells[key]) == value, key
            else:
                assert cells[key] == value, key


def test_table_and_markdown_show_the_rows(compared):
    c, _ = compared
    text = str(c)
    auto = c.row("auto", "60%")
    for fragment in (*STRATEGIES, f"auto ({auto.solver})", auto.status, "INFEASIBLE",
                     format_bytes(auto.predicted_peak_bytes),
                     format_bytes(auto.measured_peak_bytes),
                     f"{auto.predicted_overhead:+.1%}", f"{auto.measured_overhead:+.1%}"):
        assert fragment in text, fragment
    md = c.to_markdown().splitlines()
    assert len(md) == 2 + len(c.rows)
    assert md[2].startswith(f"| auto ({c.rows[0].solver}) | 90% (")
    assert all(line.count("|") == md[0].count("|") for line in md)


def _labels(ax) -> list[str]:
    return [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]


def test_plot_has_a_series_per_strategy_and_the_budget_lines(compared, tmp_path):
    c, _ = compared
    path = tmp_path / "sub" / "compare.png"
    fig = c.plot(path)
    assert path.read_bytes().startswith(PNG_MAGIC)
    assert len(fig.axes) == 2  # predicted, measured
    for ax, kind in zip(fig.axes, ("predicted", "measured")):
        assert sorted(_labels(ax)) == sorted([*STRATEGIES, "budget 90%", "budget 60%"])
        auto = next(line for line in ax.get_lines() if line.get_label() == "auto")
        rows = [r for r in c.rows if r.strategy == "auto"]
        expect = sorted(getattr(r, f"{kind}_peak_bytes") / MIB for r in rows)
        assert list(auto.get_xdata()) == pytest.approx(expect)
        budget = next(line for line in ax.get_lines() if line.get_label() == "budget 60%")
        assert budget.get_xdata()[0] == pytest.approx(c.row("auto", "60%").budget_bytes / MIB)


def test_plot_draws_hollow_exactly_the_points_that_miss_every_budget(compared):
    c, _ = compared
    fig = c.plot()
    for ax, kind in zip(fig.axes, ("predicted", "measured")):
        hollow = sorted((round(x, 9), round(y, 9)) for line in ax.get_lines()
                        if line.get_label().startswith("_")
                        and line.get_markerfacecolor() == "white"
                        for x, y in zip(line.get_xdata(), line.get_ydata()))
        points: dict[tuple[str, float, float], bool] = {}
        for r in c.rows:
            key = (r.strategy, round(getattr(r, f"{kind}_peak_bytes") / MIB, 9),
                   round(100 * getattr(r, f"{kind}_overhead"), 9))
            points[key] = points.get(key, False) or getattr(r, f"fits_{kind}")
        expect = sorted((x, y) for (_, x, y), fits in points.items() if not fits)
        assert hollow == expect and expect  # none misses both budgets
        # sqrt fits 90% and misses 60% with one schedule: one point, filled
        (sqrt,) = [k[1:] for k in points if k[0] == "sqrt"]
        assert sqrt not in hollow


def test_predictions_only(mlp):
    model, inputs = mlp
    c = compare(model, inputs, budgets="60%", strategies=["auto", "greedy"], measure=False,
                repeats=1, time_limit_s=5, progress=False)
    assert [r.strategy for r in c.rows] == ["auto", "greedy"]
    assert c.reference is None
    for r in c.rows:
        assert r.measured_peak_bytes is None and r.fits_measured is None
        assert r.measured_step_s is None and r.measured_overhead is None
    assert "not measured" in str(c)
    fig = c.plot()
    assert len(fig.axes) == 1 and sorted(_labels(fig.axes[0])) == ["auto", "budget 60%",
                                                                   "greedy"]


def test_a_budget_nothing_fits_is_an_error_naming_the_minimum(mlp):
    model, inputs = mlp
    with pytest.raises(scheduler.InfeasibleBudgetError, match="smallest feasible") as info:
        compare(model, inputs, budgets=["90%", "5%"], strategies=["none", "greedy"],
                measure=False, repeats=1, time_limit_s=5, progress=False)
    assert info.value.min_feasible_bytes > info.value.budget_bytes


def test_bad_budget_and_strategy_fail_before_tracing(mlp, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("traced before the arguments were checked")

    # scheduler.compare is the function; the module is in sys.modules
    monkeypatch.setattr(sys.modules["scheduler.workflows.compare"], "profile_units", boom)
    model, inputs = mlp
    with pytest.raises(ValueError, match="bad budget '150%'"):
        compare(model, inputs, budgets=["50%", "150%"], progress=False)
    with pytest.raises(ValueError, match="valid solvers: .*greedy"):
        compare(model, inputs, budgets="50%", strategies=["auto", "greedier"], progress=False)
    with pytest.raises(ValueError, match="at least one budget"):
        compare(model, inputs, budgets=[], progress=False)
    with pytest.raises(KeyError, match="strategies"):
        Comparison(rows=[], model="m", device="cpu", unconstrained_peak_bytes=1,
                   reference=None, graph=None).row("auto", "50%")


# ---------------------------------------------------------------------------- timeline


def test_plan_plot_timeline_shows_budget_and_recompute_bursts(mlp, tmp_path):
    model, inputs = mlp
    plan = scheduler.solve(model, inputs, budget="60%", solver="every_block", repeats=1)
    path = tmp_path / "timeline.png"
    fig = plan.plot_timeline(path)
    assert path.read_bytes().startswith(PNG_MAGIC)
    ax = fig.axes[0]
    labels = _labels(ax)
    assert labels[:4] == ["forward", "backward", "recompute", "budget"]
    assert labels[4] == f"predicted peak {format_bytes(plan.estimate.peak_bytes)}"
    lines = {line.get_label(): line for line in ax.get_lines()}
    timeline = plan.estimate.timeline
    bursts = [i for i, (label, _) in enumerate(timeline) if label.startswith("recompute ")]
    assert len(bursts) == len(plan.schedule.recompute_regions) == 3
    assert list(lines["recompute"].get_xdata()) == bursts
    assert lines["budget"].get_ydata()[0] == pytest.approx(plan.budget_bytes / MIB)
    n_fwd = len(plan.graph.nodes)
    assert list(lines["forward"].get_ydata()) == pytest.approx(
        [b / MIB for _, b in timeline[:n_fwd]])
    assert len(lines["forward"].get_xdata()) + len(lines["backward"].get_xdata()) == \
        len(timeline) + 1  # backward starts at the last forward point


def test_plan_plot_timeline_with_inputs_draws_the_measured_step(mlp):
    """With inputs, one real step of the plan's module is tracked: the measured line's highest
    point is the measured peak (`scheduler.measure`), and the prediction is within 3% of it."""
    model, inputs = mlp
    plan = scheduler.solve(model, inputs, budget="60%", solver="every_block", repeats=1)
    fig = plan.plot_timeline(None, inputs=inputs)
    lines = {line.get_label().split(" (")[0]: line for line in fig.axes[0].get_lines()}
    ys = list(lines["measured"].get_ydata())
    measured_peak = scheduler.measure(plan.module, inputs, repeats=1).peak_bytes
    assert max(ys) == pytest.approx(measured_peak / MIB, rel=1e-12)
    assert abs(plan.estimate.peak_bytes - measured_peak) <= 0.03 * measured_peak
    # drawn across the prediction's width
    xs = list(lines["measured"].get_xdata())
    assert xs[0] == 0 and xs[-1] == pytest.approx(len(plan.estimate.timeline) - 1)


def test_plot_timeline_needs_a_timeline():
    from scheduler.cost.simulate import Estimate

    with pytest.raises(ValueError, match="no timeline"):
        report.plot_timeline(Estimate(peak_bytes=1, step_s=1.0, recompute_s=0.0, overhead=0.0,
                                      forward_peak_bytes=1))


def test_round_robin_measurement_keeps_every_rounds_time_and_the_peak():
    import statistics

    import torch

    from scheduler.measurement.step import measure_in_turns

    torch.manual_seed(0)
    modules = {"small": torch.nn.Linear(8, 8), "wide": torch.nn.Linear(8, 64)}
    x = torch.randn(16, 8)
    calls = []
    out = measure_in_turns({k: (m, (x,)) for k, m in modules.items()}, repeats=3,
                           step=lambda *a, **k: calls.append(k.get("advance", 0)))
    assert sum(calls) == 3 * len(modules)
    for key, module in modules.items():
        m = out[key]
        assert len(m.step_s_all) == 3 and m.step_s == statistics.median(m.step_s_all)
        assert m.peak_bytes == scheduler.measure(module, (x,), repeats=1).peak_bytes
    assert out["wide"].peak_bytes > out["small"].peak_bytes


def tiny_llama(device: str = "cpu") -> tuple[object, dict]:
    transformers = pytest.importorskip("transformers")
    import torch
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, attn_implementation="sdpa")
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    return model, {"input_ids": ids, "labels": ids}


def test_a_hugging_face_model_is_compared_in_its_layers() -> None:
    """By default a Hugging Face model's strategies are solved and run inside its layers (as
    `solve` plans it): every region lies in one layer, ``none`` is the user's own eager step
    (its measured peak is the unmodified model's), and every row predicted to fit measures
    within its budget."""
    import torch
    from scheduler.measurement.step import measure

    model, batch = tiny_llama()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        c = compare(model, batch, budgets=["80%"], strategies=["auto", "every_block", "none"],
                    repeats=1, time_limit_s=5, progress=False)
    assert not [w for w in said if issubclass(w.category, scheduler.OverBudgetWarning)]
    assert c.graph.units == tuple(f"model.layers.{i}" for i in range(3))
    assert any(row.schedule and row.schedule.recompute_regions for row in c.rows)
    for row in c.rows:
        for r in row.schedule.recompute_regions if row.schedule else ():
            paths = {c.graph.node(n).module_path for n in r.nodes}
            assert all(p.startswith("model.layers.") for p in paths), paths
            assert len({p.split(".")[2] for p in paths}) == 1, paths
        if row.fits_predicted:
            assert row.fits_measured, row
    own = measure(model, batch, repeats=1, allocator=False).peak_bytes
    none = next(r for r in c.rows if r.strategy == "none")
    assert abs(none.measured_peak_bytes - own) <= 0.005 * own
    assert torch.is_grad_enabled()


def test_a_model_that_cannot_run_is_ranked_by_prediction() -> None:
    """A model built on the meta device: compared without measuring from a fake profile
    (every strategy's predicted row); asked to measure, one line says why not, before any
    profiling."""
    model, batch = tiny_llama("meta")
    c = compare(model, batch, budgets=["70%"], strategies=["auto", "every_block"],
                measure=False, mode="fake", times="roofline", device_spec="cpu",
                time_limit_s=5, progress=False)
    assert c.graph.meta["profile"]["mode"] == "fake" and c.graph.units
    auto = next(r for r in c.rows if r.strategy == "auto")
    assert auto.fits_predicted and auto.measured_peak_bytes is None
    assert auto.predicted_peak_bytes == simulate(c.graph, auto.schedule).peak_bytes
    with pytest.raises(ValueError, match="measuring runs real training steps.*meta"):
        compare(model, batch, budgets=["70%"], progress=False)


def test_compare_ranks_one_rank_by_prediction(build_example, monkeypatch) -> None:
    """``parallel=`` ranks the strategies for one rank of FSDP2 (its rows are the per-rank
    graph's simulations); measuring, which cannot run a rank's wrapped step here, is refused
    before anything is profiled."""
    import scheduler.capture.profile as profile_module

    model, inputs = build_example("gpt", batch=2, block_size=32, n_layer=3)
    with monkeypatch.context() as m:
        m.setattr(profile_module, "profile_step", lambda *a, **k: pytest.fail("profiled"))
        with pytest.raises(ValueError, match="pass measure=False"):
            scheduler.compare(model, inputs, budgets="80%", parallel="ddp", progress=False)
    c = scheduler.compare(model, inputs, budgets=["80%"], parallel="fsdp2:2", measure=False,
                          progress=False, time_limit_s=5, strategies=["auto", "none"])
    one = scheduler.compare(model, inputs, budgets=["80%"], measure=False, progress=False,
                            time_limit_s=5, strategies=["none"])
    rank_none = next(r for r in c.rows if r.strategy == "none")
    # (a rank's step is not the one device's: here more, the root's gathered embedding
    # weighs more than the halved shards save)
    assert rank_none.predicted_peak_bytes != one.rows[0].predicted_peak_bytes
    assert rank_none.budget_bytes == int(0.8 * rank_none.predicted_peak_bytes)
    auto = next(r for r in c.rows if r.strategy.startswith("auto"))
    assert auto.fits_predicted and auto.predicted_peak_bytes <= auto.budget_bytes
