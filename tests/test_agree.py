"""The API and the CLI agree: one check of ``time_limit_s`` / ``--time-limit``, one meaning of a
bare budget number (an integer is bytes, a decimal in (0, 1] a fraction), the hints for a budget
that looks like a percentage or has an ambiguous unit; and `apply` warns where a schedule without
a fingerprint meets other input shapes than it was solved for."""

from __future__ import annotations

import argparse
import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn as nn
from _chain import chain
from _cli import run

import scheduler
from scheduler import InfeasibleBudgetError, parse_budget, solve_graph
from scheduler.cli.common import time_limit
from scheduler.ir.schedule import Schedule, ScheduleError
from scheduler.solvers.certify import solve_and_certify
from scheduler.workflows.bench import bench

BLOCKS = ["", "h.0", "h.0", "h.1", "h.1", "h.2", "h.2", ""]

BAD_LIMITS = [-1, 0, 0.0, -0.5, math.nan, math.inf, -math.inf, "30", True, [5]]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


# ------------------------------------------------------------------------------ time limits


@pytest.mark.parametrize("limit", BAD_LIMITS, ids=repr)
@pytest.mark.parametrize("solver", ["auto", "dp", "cpsat", "relax", "greedy"])
def test_solve_graph_rejects_a_bad_time_limit_naming_it_and_the_fix(solver, limit):
    # before: -1 made cpsat/relax call this feasible budget infeasible and auto/dp raise a
    # TypeError about complex; inf printed thread tracebacks; 0 and NaN were accepted
    with pytest.raises(ValueError, match=r"bad time limit .*finite number of seconds > 0") as e:
        solve_graph(chain(BLOCKS), "100%", solver=solver, time_limit_s=limit)
    assert repr(limit) in str(e.value)


@pytest.mark.parametrize("limit", [-1, 0, math.nan, math.inf])
def test_the_solvers_entry_rejects_a_bad_time_limit(limit):
    with pytest.raises(ValueError, match=r"bad time limit"):
        solve_and_certify(chain(BLOCKS), 10**9, "dp", time_limit_s=limit)
    with pytest.raises(ValueError, match=r"bad time limit"):
        bench([("chain", chain(BLOCKS))], budgets=["100%"], solvers=["dp"], time_limit_s=limit)


@pytest.mark.parametrize("limit", [None, 5, 0.5])
def test_good_time_limits_still_solve(limit):
    result = solve_graph(chain(BLOCKS), "100%", solver="dp", time_limit_s=limit)
    assert result.fits


@pytest.mark.parametrize("limit", [-1, 0, math.nan, math.inf])
def test_the_workflows_reject_a_bad_time_limit_before_any_work(limit, monkeypatch):
    def no_profiling(*args, **kwargs):
        raise AssertionError("profiled before checking the time limit")

    monkeypatch.setattr(scheduler.units.step, "profile_step", no_profiling)  # (solve's)
    model, inputs = _model(), (torch.randn(4, 8),)
    calls = [
        lambda: scheduler.solve(model, inputs, budget="50%", time_limit_s=limit),
        lambda: scheduler.compare(model, inputs, budgets=["50%"], time_limit_s=limit),
        lambda: scheduler.max_batch(no_profiling, budget="1GiB", time_limit_s=limit),
        lambda: scheduler.advise(model, inputs, device_memory="1GiB", time_limit_s=limit),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"bad time limit"):
            call()


@pytest.mark.parametrize("text", ["-1", "0", "nan", "inf", "abc"])
def test_the_cli_time_limit_is_the_same_check(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"bad time limit .*finite number"):
        time_limit(text)
    assert time_limit("2.5") == 2.5


def test_the_cli_rejects_a_bad_time_limit_in_one_line():
    code, _, err = run(["bench", "no-such-graph.json", "--time-limit", "nan"])
    assert code == 2 and "bad time limit" in err and "Traceback" not in err


# ------------------------------------------------------------------------------ budgets


@pytest.mark.parametrize(("api", "cli", "expected"), [
    (1, "1", 1),  # before: "1" (the CLI's --budget 1) was 100%, the int 1 one byte
    (50, "50", 50),
    (1.0, "1.0", 1000),
    (0.6, "0.6", 600),
    (1.5e9, "1.5e9", 1_500_000_000),
])
def test_a_bare_number_means_the_same_in_the_api_and_on_the_cli(api, cli, expected):
    assert parse_budget(api, 1000) == expected
    assert parse_budget(cli, 1000) == expected


@pytest.mark.parametrize("text", ["6G", "6g", "512M", "2 T"])
def test_a_one_letter_unit_gets_the_ambiguous_unit_hint(text):
    letter = text[-1].upper()
    with pytest.raises(ValueError, match=rf"ambiguous: write '{letter}B' .* '{letter}iB'"):
        parse_budget(text, 1000)


@pytest.mark.parametrize("budget", [50, "50", 1, " 1 "])
def test_a_tiny_integer_budget_asks_did_you_mean_a_percentage(budget):
    n = int(str(budget).strip())
    with pytest.raises(InfeasibleBudgetError, match=rf"did you mean {n}%\?") as e:
        solve_graph(chain(BLOCKS), budget, solver="dp")
    assert f"{n} B" in str(e.value)  # the budget it was read as


@pytest.mark.parametrize("budget", [101, "1KiB", "50B", "0.01"])
def test_no_percentage_hint_where_the_budget_does_not_look_like_one(budget):
    graph = chain(BLOCKS, out_bytes=10**6)
    with pytest.raises(InfeasibleBudgetError) as e:
        solve_graph(graph, budget, solver="dp")
    assert "did you mean" not in str(e.value)


def test_the_cli_budget_50_asks_did_you_mean_50_percent(tmp_path):
    factory = tmp_path / "tiny.py"
    factory.write_text("import torch\n\ndef build():\n"
                       "    return torch.nn.Sequential(torch.nn.Linear(8, 4)), (torch.randn(2, 8),)\n")
    code, _, err = run(["solve", f"{factory}:build", "--budget", "50", "--solver", "greedy",
                        "--mode", "fake", "--repeats", "1", "--quiet",
                        "--out", str(tmp_path / "s.json")])
    assert code == 2, err
    assert "50 B" in err and "did you mean 50%?" in err, err
    assert len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------------------ apply at other shapes


@pytest.fixture(scope="module")
def solved():
    model = _model()
    plan = scheduler.solve(model, (torch.randn(4, 8),), budget="100%", solver="none",
                           repeats=1, mode="real")
    return model, plan.schedule


def test_solve_records_the_input_shapes_and_a_saved_schedule_keeps_them(solved, tmp_path):
    _, schedule = solved
    assert schedule.meta["input_shapes"] == [[4, 8]]
    schedule.save(tmp_path / "s.json")
    assert Schedule.load(tmp_path / "s.json").meta["input_shapes"] == [[4, 8]]


def test_apply_without_a_fingerprint_at_another_batch_warns_naming_both_shapes(solved):
    model, schedule = solved
    bare = dataclasses.replace(schedule, fingerprint="")
    with pytest.warns(UserWarning, match=r"solved for input shapes \(4, 8\), but .* given "
                                         r"\(16, 8\).*solve again"):
        module = scheduler.apply(model, bare, (torch.randn(16, 8),))
    module(torch.randn(16, 8)).sum().backward()  # it still runs


def test_apply_without_a_fingerprint_or_shapes_warns_that_it_cannot_check(solved):
    model, schedule = solved
    meta = {k: v for k, v in schedule.meta.items() if k != "input_shapes"}
    bare = dataclasses.replace(schedule, fingerprint="", meta=meta)
    with pytest.warns(UserWarning, match=r"no fingerprint and records no input shapes.*"
                                         r"\(16, 8\) cannot be checked"):
        scheduler.apply(model, bare, (torch.randn(16, 8),))


def test_apply_at_the_solved_shapes_says_nothing_and_a_fingerprint_still_refuses(solved):
    model, schedule = solved
    bare = dataclasses.replace(schedule, fingerprint="")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler.apply(model, bare, (torch.randn(4, 8),))
        scheduler.apply(model, schedule, (torch.randn(4, 8),))
    with pytest.raises(ScheduleError, match=r"input shapes differ"):
        scheduler.apply(model, schedule, (torch.randn(16, 8),))
