"""benchmarks/sweep.py: a row per model and budget whose numbers are the plan's and the unmodified
model's own, written into its section; a failure is a failing row (and exit status 1), never a
crash or a missing row."""

from __future__ import annotations

import torch
import torch.nn as nn
from conftest import benchmark_modules

import scheduler

_models, sweep = benchmark_modules("_models", "sweep")


def test_sweep_rows_of_a_tiny_model_are_its_own_and_land_in_the_section(tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "bench.md"
    out.write_text("# Benchmarks\n\n<!-- begin sweep -->\nold\n<!-- end sweep -->\ntail\n")
    rc = sweep.main(["--models", "mlp", "--budgets", "90%,1", "--time-limit", "2",
                     "--out", str(out)])
    assert rc == 0
    text = out.read_text()
    assert "old" not in text and text.endswith("<!-- end sweep -->\ntail\n")
    assert "python benchmarks/sweep.py --models mlp" in text
    rows = [line for line in text.splitlines() if line.startswith("| mlp |")]
    assert len(rows) == 2, rows
    fits, below = ([c.strip() for c in r.strip("|").split("|")] for r in rows)
    # 90%: traced by fx, fits by both counts, the unmodified model's gradients bit for bit
    assert fits[1] == "fx" and fits[2] == "90%" and fits[3] in ("OPTIMAL", "FEASIBLE")
    model, inputs = _models.EXAMPLES["mlp"]()
    graph = scheduler.profile(model, inputs, repeats=1)
    budget = int(0.9 * scheduler.simulate(graph, scheduler.Schedule.none(graph)).peak_bytes)
    for cell in (fits[5], fits[6]):
        measured, of = (int(x.replace(",", "")) for x in cell.split(" (")[0].split(" / "))
        assert of == budget and 0.5 * budget < measured <= budget, (cell, budget)
    assert fits[7] == "0" and fits[8] == "ok"
    # one byte: below the floor, which is named and is not a failure
    assert below[3] == "INFEASIBLE" and below[8].startswith("below floor: the smallest budget")
    assert "1 ok, 0 failing, 1 below the floor" in text


class _Unplannable(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)  # no parameter: the unmodified step cannot backward


def test_a_model_that_fails_is_a_failing_row_not_a_crash(monkeypatch, capsys):
    def broken():
        raise RuntimeError("no such weights")

    monkeypatch.setitem(_models.ALL, "broken", broken)
    monkeypatch.setitem(_models.ALL, "unplannable", lambda: (_Unplannable(), (torch.randn(4),)))
    assert sweep.main(["--models", "broken,unplannable", "--budgets", "90%"]) == 1
    out = capsys.readouterr().out
    assert "| broken | - | - |" in out and "FAIL: building it raised RuntimeError: no such" in out
    assert "| unplannable |" in out and "2 failing" in out
