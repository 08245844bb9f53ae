"""``scheduler solve`` and ``scheduler apply`` on the real MLP example (small sizes, the greedy
baseline, one profile repeat): exit codes, what they print and write, one-line errors."""

from __future__ import annotations

import contextlib
import io
import json
import textwrap
from pathlib import Path

import pytest

import scheduler
import scheduler.capture.profile
from scheduler import cli
from scheduler.ir.schedule import Schedule
from scheduler.quantities import format_bytes

FACTORY = """
from examples.mlp import build as _build

def small():
    return _build(batch=256, dim=32, depth=3)

def shallower():
    return _build(batch=256, dim=32, depth=2)
"""


@pytest.fixture(scope="module")
def factory(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("factory") / "models.py"
    path.write_text(textwrap.dedent(FACTORY))
    return path


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def solved(factory, tmp_path_factory) -> tuple[Path, int, str]:
    """One real ``scheduler solve ... --budget 70% --solver greedy``: (schedule path, exit
    code, stdout)."""
    out = tmp_path_factory.mktemp("solved") / "sub" / "schedule.json"
    code, stdout, _ = run(["solve", f"{factory}:small", "--budget", "70%", "--solver", "greedy",
                           "--repeats", "1", "--out", str(out)])
    return out, code, stdout


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("scheduler: error: ")
    return lines[0]


@pytest.fixture
def no_profiling(monkeypatch):
    """Fail the test if anything gets as far as tracing the model."""
    def boom(*args, **kwargs):
        raise AssertionError("the model was traced before the arguments were checked")

    monkeypatch.setattr(scheduler.capture.profile, "trace", boom)


# ------------------------------------------------------------------------------ solve


def test_solve_for_compiled_execution_says_so_and_writes_it(factory, tmp_path):
    out = tmp_path / "compiled.schedule.json"
    code, stdout, _ = run(["solve", f"{factory}:small", "--budget", "70%", "--execution",
                           "compiled", "--no-measure-compiled", "--time-limit", "5",
                           "--repeats", "1", "--out", str(out)])
    assert code == 0
    schedule = Schedule.load(out)
    assert schedule.meta["execution"] == "compiled"
    assert schedule.estimate["peak_bytes"] <= schedule.budget_bytes
    assert "time model" in stdout and "torch.compile" in stdout
    assert "compiled peak" in stdout and "not measured" in stdout
    assert "predicted step" not in stdout  # (no step of the eager base and compiled replays)



def test_solve_writes_the_schedule_and_prints_the_estimate(solved):
    path, code, stdout = solved
    assert code == 0
    schedule = Schedule.load(path)
    assert schedule.solver == "greedy" and schedule.status == "FEASIBLE"
    assert schedule.recompute_regions
    peak = schedule.estimate["peak_bytes"]
    assert peak <= schedule.budget_bytes
    for fragment in ("FEASIBLE", "predicted peak", format_bytes(peak), "budget",
                     format_bytes(schedule.budget_bytes), "recompute time", "overhead",
                     "solve time", "gap", f"wrote {path}"):
        assert fragment in stdout, fragment


def test_solve_infeasible_budget_is_one_line_with_the_minimum(factory, tmp_path):
    out = tmp_path / "s.json"
    code, stdout, err = run(["solve", f"{factory}:small", "--budget", "5%", "--solver", "greedy",
                             "--repeats", "1", "--out", str(out), "--quiet"])
    assert code == 2
    assert stdout == ""
    line = one_error_line(err)
    assert "is infeasible" in line and "use budget=" in line
    assert not out.exists()


@pytest.mark.parametrize(("budget", "fragment"), [
    ("150%", "bad budget '150%'"),
    ("abc", "bad budget 'abc'"),
    ("0", "bad budget '0'"),
    ("-1GiB", "bad budget '-1GiB'"),
])
def test_solve_bad_budget_fails_before_profiling(factory, tmp_path, no_profiling, budget, fragment):
    code, stdout, err = run(["solve", f"{factory}:small", f"--budget={budget}",
                             "--out", str(tmp_path / "s.json")])
    assert code == 2 and stdout == ""
    assert fragment in one_error_line(err)


def test_solve_unknown_solver_lists_the_valid_ones(factory, tmp_path, no_profiling):
    code, _, err = run(["solve", f"{factory}:small", "--budget", "50%", "--solver", "magic",
                        "--out", str(tmp_path / "s.json")])
    assert code == 2
    line = one_error_line(err)
    assert "'magic'" in line and "greedy" in line and "uniform:K" in line


def test_solve_bad_headroom(factory, tmp_path, no_profiling):
    code, _, err = run(["solve", f"{factory}:small", "--budget", "50%", "--headroom", "1.5",
                        "--solver", "greedy", "--out", str(tmp_path / "s.json")])
    assert code == 2 and "--headroom" in one_error_line(err)


@pytest.mark.parametrize("argv", [
    ["solve", "x.py:f"],  # --budget is required
    ["solve", "x.py:f", "--budget", "50%", "--time-limit", "0"],
    ["apply", "x.py:f"],  # SCHEDULE is required
])
def test_solve_and_apply_usage_errors_exit_2(argv):
    code, _, err = run(argv)
    assert code == 2 and "usage: scheduler" in err


@pytest.mark.parametrize(("verb", "example"), [
    ("solve", "scheduler solve examples/gpt.py:build --budget 60%"),
    ("apply", "scheduler apply examples/gpt.py:build"),
])
def test_help_has_an_example(verb, example):
    code, stdout, _ = run([verb, "--help"])
    assert code == 0 and example in stdout


# ------------------------------------------------------------------------------ apply


def test_apply_prints_predicted_and_measured(solved, factory):
    path, code, _ = solved
    assert code == 0
    code, stdout, _ = run(["apply", f"{factory}:small", str(path), "--repeats", "1"])
    assert code == 0
    schedule = Schedule.load(path)
    # the measured peak is deterministic on CPU: measure it independently
    from examples.mlp import build

    model, inputs = build(batch=256, dim=32, depth=3)
    measured = scheduler.measure(scheduler.apply(model, schedule, inputs), inputs, repeats=1)
    for fragment in ("peak memory", "step time", "predicted", "measured",
                     format_bytes(schedule.estimate["peak_bytes"]),
                     format_bytes(measured.peak_bytes), format_bytes(schedule.budget_bytes)):
        assert fragment in stdout, fragment
    assert ("fits" if measured.peak_bytes <= schedule.budget_bytes else "EXCEEDS") in stdout


def test_apply_quiet_prints_nothing(solved, factory):
    path, _, _ = solved
    assert run(["apply", f"{factory}:small", str(path), "--repeats", "1", "--quiet"]) == (0, "", "")


def test_apply_to_a_different_model_is_one_line(solved, factory):
    path, _, _ = solved
    code, stdout, err = run(["apply", f"{factory}:shallower", str(path), "--quiet"])
    assert code == 2 and stdout == ""
    assert "fingerprint" in one_error_line(err)


def test_apply_missing_or_bad_schedule_is_one_line(factory, tmp_path):
    code, _, err = run(["apply", f"{factory}:small", str(tmp_path / "nope.json")])
    assert code == 2 and "nope.json" in one_error_line(err)
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "something else"}')
    code, _, err = run(["apply", f"{factory}:small", str(bad)])
    assert code == 2 and "schema" in one_error_line(err)


@pytest.mark.parametrize("status,space_optimal,gap,shown,hidden", [
    ("FEASIBLE", False, 1.0, ["searched", "every position", "100.00% (no lower bound proven)"],
     ["optimal over", "full schedule space"]),
    ("FEASIBLE", False, None, ["searched", "n/a (no lower bound)"],
     ["optimal over", "no lower bound proven"]),
    ("FEASIBLE", False, 0.25, ["searched", "25.00% (to the full space's lower bound)"],
     ["no lower bound proven", "optimal over"]),
    ("FEASIBLE", True, 0.25, ["optimal over", "every position", "25.00%"],
     ["searched", "full schedule space"]),
    ("OPTIMAL", True, 0.0, ["OPTIMAL (over the full schedule space)", "searched",
                            "every position", "0.00%"],
     ["no lower bound proven", "optimal over"]),
])
def test_solve_table_names_the_space_and_an_unproven_bound(capsys, status, space_optimal, gap,
                                                           shown, hidden):
    """The printed plan names the space searched (optimal over it, when proven there but not
    over the full space), the gap as one to the full space's bound, and says when no lower
    bound was proven (gap 100%) instead of a bare 100%, or none was solved in time (None)."""
    from types import SimpleNamespace

    from scheduler.cli.solve import print_plan
    from scheduler.cost.simulate import simulate
    from scheduler.testing.synthetic import random_graph

    g = random_graph(12, seed=1)
    sched = Schedule.from_regions(g, [(0, 6, "recompute"), (6, 12, "keep")],
                                  meta={"space": "every position (cpsat_fine)",
                                        "space_optimal": space_optimal})
    est = simulate(g, sched)
    plan = SimpleNamespace(estimate=est, result=SimpleNamespace(solver="cpsat_fine"),
                           status=status, schedule=sched, gap=gap, solve_s=1.0,
                           budget_bytes=est.peak_bytes, unconstrained_peak_bytes=est.peak_bytes)
    print_plan(plan, Path("x.json"))
    out = capsys.readouterr().out
    for fragment in shown:
        assert fragment in out, fragment
    for fragment in hidden:
        assert fragment not in out, fragment


def test_solve_with_units_then_apply_runs_inside_the_models_forward(factory, tmp_path):
    """``solve --units auto`` records the units in the schedule; ``apply`` builds the units
    plan from it (the model's own forward, its blocks planned) and measures it within the
    budget; ``--floor --units auto`` names the units plan's floor, which solves."""
    out = tmp_path / "units.schedule.json"
    code, stdout, _ = run(["solve", f"{factory}:small", "--budget", "75%", "--solver", "greedy",
                           "--repeats", "1", "--units", "auto", "--out", str(out)])
    assert code == 0 and "inside the model's own forward" in stdout
    schedule = Schedule.load(out)
    assert schedule.meta["units"]["paths"] == ["blocks.0", "blocks.1", "blocks.2"]
    from examples.mlp import build

    model, inputs = build(batch=256, dim=32, depth=3)
    module = scheduler.apply(model, schedule, inputs)
    units = scheduler.units.units_plan(module)
    measured = scheduler.measure(module, inputs, repeats=1)
    assert units.planned_calls > 0 and units.fallback_calls == 0
    code, stdout, _ = run(["apply", f"{factory}:small", str(out), "--repeats", "1"])
    assert code == 0 and format_bytes(measured.peak_bytes) in stdout
    assert measured.peak_bytes <= schedule.budget_bytes and "fits" in stdout
    code, stdout, _ = run(["solve", f"{factory}:small", "--floor", "--json", "--units", "auto",
                           "--repeats", "1", "--time-limit", "5"])
    assert code == 0
    least = json.loads(stdout)["bytes"]
    code, _, _ = run(["solve", f"{factory}:small", "--budget", str(least), "--units", "auto",
                      "--repeats", "1", "--time-limit", "5", "--out", str(out), "--quiet"])
    assert code == 0 and Schedule.load(out).estimate["peak_bytes"] <= least


def test_solve_a_saved_profile_at_three_budgets_without_the_model(factory, tmp_path,
                                                                  monkeypatch):
    """``profile --units auto --out g.json`` once, then ``solve g.json`` at three budgets and
    ``--floor``, with every way to reach the model's code broken: each schedule fits its
    budget on the saved graph, records the graph's units, and ``apply`` runs it on the model
    (its units planned, measured within the budget)."""
    from scheduler.cli import solve as solve_verb
    from scheduler.cost.simulate import simulate
    from scheduler.ir.graph import CostGraph

    graph_path = tmp_path / "g.json"
    code, _, err = run(["profile", f"{factory}:small", "--units", "auto", "--repeats", "1",
                        "--out", str(graph_path), "--quiet"])
    assert code == 0, err
    graph = CostGraph.load(graph_path)
    assert graph.units == ("blocks.0", "blocks.1", "blocks.2")

    def no_model(*args, **kwargs):
        raise AssertionError("solving a saved graph loaded the model")

    with monkeypatch.context() as m:
        m.setattr(solve_verb, "load_factory", no_model)
        m.setattr(scheduler.capture.profile, "profile_step", no_model)
        schedules = []
        for budget in ("90%", "75%", "60%"):
            out = tmp_path / f"s{budget[:2]}.json"
            code, stdout, err = run(["solve", str(graph_path), "--budget", budget,
                                     "--time-limit", "5", "--out", str(out)])
            assert code == 0, err
            assert "inside the model's own forward" in stdout
            schedules.append(Schedule.load(out))
        code, stdout, err = run(["solve", str(graph_path), "--floor", "--json",
                                 "--time-limit", "5"])
        assert code == 0, err
    unscheduled = simulate(graph, Schedule.none(graph)).peak_bytes
    for fraction, schedule in zip((0.9, 0.75, 0.6), schedules):
        assert schedule.meta["units"]["paths"] == list(graph.units)
        assert simulate(graph, schedule).peak_bytes <= int(fraction * unscheduled)
    assert json.loads(stdout)["bytes"] <= simulate(graph, schedules[-1]).peak_bytes
    api = scheduler.solve_graph(str(graph_path), "75%", solver="greedy").schedule
    assert api.meta["units"]["paths"] == list(graph.units)
    from examples.mlp import build

    model, inputs = build(batch=256, dim=32, depth=3)
    module = scheduler.apply(model, schedules[-1], inputs)
    measured = scheduler.measure(module, inputs, repeats=1)
    assert scheduler.units.units_plan(module).fallback_calls == 0
    assert measured.peak_bytes <= schedules[-1].budget_bytes


def test_a_saved_profile_refuses_the_options_that_profile(tmp_path):
    from examples.mlp import build

    model, inputs = build(batch=64, dim=16, depth=2)
    path = tmp_path / "g.json"
    scheduler.profile(model, inputs, mode="fake", times="roofline", device_spec="cpu").save(path)
    code, _, err = run(["solve", str(path), "--budget", "80%", "--mode", "fake",
                        "--units", "auto"])
    line = one_error_line(err)
    assert code == 2 and "--mode, --units" in line and "scheduler profile" in line
    code, _, err = run(["solve", str(tmp_path / "missing.json"), "--budget", "80%"])
    assert code == 2 and "missing.json" in one_error_line(err)


def test_a_per_rank_profile_plans_one_rank_and_says_so(factory, tmp_path):
    """``profile --parallel fsdp2:4 --out g.json``, then ``solve g.json``: the graph is one
    rank's (a quarter of the parameters, padded), the plan's table says per rank of what,
    and it fits its budget on that graph. A bad --parallel is one line naming it, before
    profiling; a saved graph refuses --parallel (it is profiled already)."""
    from scheduler.cost.simulate import simulate
    from scheduler.ir.graph import CostGraph

    one, ranked = tmp_path / "one.json", tmp_path / "rank.json"
    for path, extra in ((one, []), (ranked, ["--parallel", "fsdp2:4"])):
        code, _, err = run(["profile", f"{factory}:small", "--units", "auto", "--repeats", "1",
                            "--out", str(path), "--quiet", *extra])
        assert code == 0, err
    g1, g4 = CostGraph.load(one), CostGraph.load(ranked)
    assert g4.meta["parallel"] == "FSDP2 over 4 ranks (nccl)"
    assert g1.param_bytes / 4 <= g4.param_bytes < g1.param_bytes / 3
    out = tmp_path / "s.json"
    code, stdout, err = run(["solve", str(ranked), "--budget", "80%", "--out", str(out),
                             "--time-limit", "5"])
    assert code == 0, err
    assert "per rank of" in stdout and "FSDP2 over 4 ranks" in stdout
    assert simulate(g4, Schedule.load(out)).peak_bytes <= 0.8 * simulate(
        g4, Schedule.none(g4)).peak_bytes
    code, _, err = run(["solve", f"{factory}:small", "--budget", "80%", "--parallel", "zero3"])
    assert code == 2 and "parallel='zero3' is not understood" in one_error_line(err)
    code, _, err = run(["solve", str(ranked), "--budget", "80%", "--parallel", "ddp"])
    assert code == 2 and "--parallel" in one_error_line(err)
