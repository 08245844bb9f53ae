"""``scheduler solve MODEL --floor``: the floor, its bound, status and space, as a table or
JSON, without a budget; and the budget it names solves."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from scheduler.ir.schedule import Schedule
from tests._cli import run

FACTORY = """
from examples.mlp import build as _build

def small():
    return _build(batch=256, dim=32, depth=3)
"""


@pytest.fixture(scope="module")
def factory(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("factory") / "models.py"
    path.write_text(textwrap.dedent(FACTORY))
    return path


def test_floor_json_names_a_budget_that_solves(factory, tmp_path):
    code, out, err = run(["solve", f"{factory}:small", "--floor", "--json", "--repeats", "1",
                          "--time-limit", "2", "--mode", "fake", "--device-spec", "cpu"])
    assert code == 0, err
    got = json.loads(out)
    assert set(got) >= {"bytes", "lower_bound_bytes", "universal_bytes", "status", "space"}
    assert got["universal_bytes"] <= got["lower_bound_bytes"] <= got["bytes"]
    assert got["status"] in ("OPTIMAL", "FEASIBLE")
    assert (got["status"] == "OPTIMAL") == (got["bytes"] == got["lower_bound_bytes"])
    path = tmp_path / "s.json"
    code, _, err = run(["solve", f"{factory}:small", "--budget", str(got["bytes"]), "--quiet",
                        "--repeats", "1", "--time-limit", "2", "--mode", "fake",
                        "--device-spec", "cpu", "--out", str(path)])
    assert code == 0, err
    assert Schedule.load(path).estimate["peak_bytes"] <= got["bytes"]


def test_floor_table(factory):
    code, out, err = run(["solve", f"{factory}:small", "--floor", "--repeats", "1",
                          "--time-limit", "2", "--mode", "fake", "--device-spec", "cpu"])
    assert code == 0, err
    for word in ("floor", "proven bound", "any schedule", "status"):
        assert word in out, out


def test_solve_without_budget_or_floor_says_which(factory):
    code, _, err = run(["solve", f"{factory}:small"])
    assert code == 2 and "--budget" in err and "--floor" in err


def test_floor_with_a_budget_is_refused(factory):
    code, _, err = run(["solve", f"{factory}:small", "--floor", "--budget", "50%"])
    assert code == 2 and "not allowed with" in err
