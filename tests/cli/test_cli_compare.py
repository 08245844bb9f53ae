"""``scheduler compare`` on the real small MLP and ``scheduler bench`` on a recorded graph, end
to end: exit codes, what they print and write, one-line errors with exit code 2."""

from __future__ import annotations

import csv
import json
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import GRAPHS_DIR, benchmark_modules
from test_cli_solve import FACTORY, one_error_line, run

from scheduler.solvers import get_solver
from scheduler.quantities import format_bytes
from scheduler.workflows.bench import BenchRow, _judge, bench, verdict

MLP_GRAPH = GRAPHS_DIR / "mlp.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def factory(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("factory") / "models.py"
    path.write_text(textwrap.dedent(FACTORY))
    return path


@pytest.fixture(scope="module")
def compared(factory, tmp_path_factory) -> tuple[Path, int, str]:
    """One real ``scheduler compare`` with every output: (folder, exit code, stdout)."""
    out = tmp_path_factory.mktemp("compared")
    code, stdout, _ = run(["compare", f"{factory}:small", "--budget", "90%", "--budget", "60%",
                           "--strategy", "auto,none", "--strategy", "greedy", "--repeats", "1",
                           "--time-limit", "5", "--json", str(out / "c.json"),
                           "--csv", str(out / "c.csv"), "--plot", str(out / "png" / "c.png")])
    return out, code, stdout


@pytest.fixture
def no_tracing(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the model was traced before the arguments were checked")

    monkeypatch.setattr(sys.modules["scheduler.workflows.compare"], "profile_units", boom)


# ------------------------------------------------------------------------------ compare


def test_compare_prints_the_table_and_writes_json_csv_png(compared):
    out, code, stdout = compared
    assert code == 0
    data = json.loads((out / "c.json").read_text())
    rows = data["rows"]
    assert [(r["budget"], r["strategy"]) for r in rows] == [
        (b, s) for b in ("90%", "60%") for s in ("auto", "none", "greedy")]
    for r in rows:
        assert r["measured_peak_bytes"] is not None and r["fits_measured"] is not None
        # the table shows the JSON's numbers
        assert format_bytes(r["predicted_peak_bytes"]) in stdout
        assert f"{r['measured_overhead']:+.1%}" in stdout
    for fragment in ("auto (", "none", "greedy", "INFEASIBLE", "wrote ",
                     *(r["status"] for r in rows if r["strategy"] == "auto")):
        assert fragment in stdout
    with open(out / "c.csv", newline="") as f:
        cells = list(csv.DictReader(f))
    assert [int(c["measured_peak_bytes"]) for c in cells] == [r["measured_peak_bytes"]
                                                              for r in rows]
    assert [float(c["predicted_step_s"]) for c in cells] == [r["predicted_step_s"] for r in rows]
    assert (out / "png" / "c.png").read_bytes().startswith(PNG_MAGIC)


def test_compare_quiet_no_measure_prints_nothing(factory, tmp_path):
    code, stdout, err = run(["compare", f"{factory}:small", "--budget", "60%", "--strategy",
                             "greedy", "--no-measure", "--repeats", "1", "--quiet",
                             "--json", str(tmp_path / "c.json")])
    assert (code, stdout, err) == (0, "", "")
    (row,) = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert row["strategy"] == "greedy" and row["measured_peak_bytes"] is None


def test_compare_infeasible_budget_is_one_line_with_the_minimum(factory):
    code, stdout, err = run(["compare", f"{factory}:small", "--budget", "5%", "--strategy",
                             "auto", "--no-measure", "--repeats", "1", "--time-limit", "5"])
    line = one_error_line(err)
    assert code == 2 and stdout == ""
    assert "is infeasible" in line and "smallest feasible budget over" in line


@pytest.mark.parametrize(("spec", "fragment"), [
    ("no_colon_here", "bad model spec"),
    ("missing_file.py:build", "model file not found"),
    ("{factory}:nope", "has no attribute 'nope'; it defines: shallower, small"),
])
def test_compare_bad_spec_is_one_line(factory, no_tracing, spec, fragment):
    code, stdout, err = run(["compare", spec.format(factory=factory), "--budget", "50%"])
    assert code == 2 and stdout == ""
    assert fragment in one_error_line(err)


@pytest.mark.parametrize(("extra", "fragment"), [
    (["--budget", "150%"], "bad budget '150%'"),
    (["--budget", "50%", "--strategy", "auto,greedier"], "unknown solver 'greedier'"),
    (["--budget", "50%", "--strategy", ","], "without a name"),
])
def test_compare_bad_values_fail_before_loading(factory, no_tracing, extra, fragment):
    code, _, err = run(["compare", f"{factory}:small", *extra])
    assert code == 2 and fragment in one_error_line(err)


def test_compare_output_that_is_a_directory(factory, no_tracing, tmp_path):
    code, _, err = run(["compare", f"{factory}:small", "--budget", "50%", "--json",
                        str(tmp_path)])
    assert code == 2 and "--json" in one_error_line(err) and "is a directory" in err


# ------------------------------------------------------------------------------ bench


def test_bench_prints_and_writes_the_solvers_results(tmp_path, recorded_graph):
    """``bench`` writes each solver's result as the solver returns it (dp sizes its table
    by a count, `dp.affordable_cuts`, not a clock: the bench's run and the one here solve
    the same space whatever the machine's load)."""
    path = tmp_path / "b.json"
    code, stdout, _ = run(["bench", str(MLP_GRAPH), "--budget", "70%", "--solver",
                           "dp,none", "--solver", "greedy", "--time-limit", "5", "--json",
                           str(path)])
    assert code == 0
    rows = json.loads(path.read_text())
    assert [r["solver"] for r in rows] == ["dp", "none", "greedy"]
    graph = recorded_graph("mlp")
    for r in rows:
        assert r["graph"] == "mlp" and r["nodes"] == len(graph.compute_nodes)
        expect = get_solver(r["solver"])(graph, r["budget_bytes"], time_limit_s=5)
        assert r["status"] == expect.status
        assert r["peak_bytes"] == expect.estimate.peak_bytes
        assert r["recompute_s"] == expect.estimate.recompute_s
        assert f"{r['recompute_s'] * 1e3:.2f}" in stdout
    dp, none, greedy = rows
    # at 70% on this graph greedy fits with less recompute than dp's space allows
    assert greedy["status"] == "FEASIBLE" and none["status"] == "INFEASIBLE"
    assert dp["ok"] is (dp["recompute_s"] <= greedy["recompute_s"]) is False
    assert none["ok"] is None and greedy["ok"] is None
    assert "exact solvers at or below every fitting baseline: 0/1; not: mlp 70% dp" in stdout


@pytest.mark.parametrize(("argv", "fragment"), [
    (["bench", "no/such/graph.json"], "no/such/graph.json"),
    (["bench", str(MLP_GRAPH), "--budget", "0%"], "bad budget '0%'"),
    (["bench", str(MLP_GRAPH), "--solver", "nope"], "unknown solver 'nope'"),
])
def test_bench_bad_input_is_one_line(argv, fragment):
    code, stdout, err = run(argv)
    assert code == 2 and stdout == "" and fragment in one_error_line(err)


def _row(solver: str, status: str, recompute_s: float | None) -> BenchRow:
    return BenchRow(graph="g", nodes=3, budget="50%", budget_bytes=10, solver=solver,
                    status=status, recompute_s=recompute_s, peak_bytes=None,
                    min_feasible_bytes=None, gap=None, solve_s=0.0, ok=None)


@pytest.mark.parametrize(("rows", "ok"), [
    # (solver, status, recompute_s) rows at one budget -> ok of the exact "dp" row
    ([("dp", "OPTIMAL", 1.0), ("greedy", "FEASIBLE", 2.0)], True),
    ([("dp", "OPTIMAL", 1.0), ("greedy", "FEASIBLE", 1.0)], True),
    ([("dp", "FEASIBLE", 3.0), ("greedy", "FEASIBLE", 2.0)], False),
    ([("dp", "OPTIMAL", 3.0), ("sqrt", "INFEASIBLE", 0.5)], True),  # misses: not compared
    ([("dp", "INFEASIBLE", None), ("greedy", "FEASIBLE", 2.0)], False),
    ([("dp", "INFEASIBLE", None), ("none", "INFEASIBLE", 0.0)], True),  # nothing fits
])
def test_exact_solvers_are_judged_against_fitting_baselines(rows, ok):
    judged = _judge([_row(*r) for r in rows])
    assert judged[0].ok is ok and judged[1].ok is None
    assert verdict(judged) == ("exact solvers at or below every fitting baseline: "
                               + ("1/1" if ok else "0/1; not: g 50% dp"))


def test_benchmark_script_uses_the_library(capsys):
    (script,) = benchmark_modules("solvers")
    assert script.bench is bench
    # (dp, not auto: auto answers a fitting baseline's schedule when it has nothing better, so
    # its verdict could not be "not"; at 70% greedy fits with less recompute than dp's space)
    assert script.main([str(MLP_GRAPH), "--budgets", "0.7", "--solvers", "dp,greedy",
                        "--time-limit", "5"]) == 0
    out = capsys.readouterr().out
    assert "mlp (42)" in out and "0.7 (" in out
    assert "exact solvers at or below every fitting baseline: 0/1; not: mlp 0.7 dp" in out


# ------------------------------------------------------------------------------ help


@pytest.mark.parametrize(("verb", "example"), [
    ("compare", "scheduler compare examples/gpt.py:build --budget 50% --plot gpt.png"),
    ("bench", "scheduler bench graphs/*.json"),
])
def test_help_has_examples(verb, example):
    code, stdout, _ = run([verb, "--help"])
    assert code == 0 and "examples:" in stdout and example in stdout


@pytest.mark.parametrize("argv", [["compare", "x.py:f"], ["bench"],
                                  ["compare", "x.py:f", "--budget", "5%", "--repeats", "0"]])
def test_usage_errors_exit_2(argv):
    code, _, err = run(argv)
    assert code == 2 and "usage: scheduler" in err
