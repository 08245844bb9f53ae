"""The runnable scripts in ``examples/``, each run once at its ``--small`` size, with what they
print checked against what it claims (losses equal step for step, the saved schedule applied
and checked here against the unmodified model, the comparison's rows)."""

from __future__ import annotations

import importlib
import json
import re

import pytest
import torch

import scheduler
from scheduler.ir.schedule import Schedule
from scheduler.quantities import format_bytes


def run_script(name: str, argv: list[str], capsys) -> str:
    module = importlib.import_module(f"examples.{name}")
    assert module.main(argv) == 0
    return capsys.readouterr().out


def test_train_gpt_checkpointed_losses_equal_the_plain_models(capsys):
    out = run_script("train_gpt", ["--small", "--steps", "3"], capsys)
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", out, flags=re.M)
    assert [int(r[0]) for r in rows] == [0, 1, 2]
    assert all(r[1] == r[2] for r in rows), out  # drop-in: same maths, dropout replayed
    assert float(rows[-1][1]) < float(rows[0][1])  # the shared parameters were trained
    assert "recomputed)" in out and "measured peak of one checkpointed step" in out


def test_reapply_applies_the_saved_schedule(capsys, tmp_path):
    path = tmp_path / "mlp.schedule.json"
    out = run_script("reapply", ["--small", "--out", str(path)], capsys)
    schedule = Schedule.load(path)
    assert schedule.recompute_regions  # (60% takes checkpointing)
    assert f"re-applied: {len(schedule.recompute_regions)} recompute regions" in out
    assert "same loss as the plan's module: True" in out
    # what the script claims, checked here: the saved schedule applied to a fresh model of its
    # size gives the unmodified model's loss and gradients, and the measured peak it printed
    from examples.mlp import build
    from examples.reapply import SMALL

    model, inputs = build(**SMALL)
    ref, _ = build(**SMALL)
    module = scheduler.apply(model, path, inputs)
    loss, want = module(*inputs).mean(), ref(*inputs).mean()
    assert torch.equal(loss, want)
    for a, b in zip(torch.autograd.grad(loss, list(module.parameters())),
                    torch.autograd.grad(want, list(ref.parameters()))):
        assert torch.equal(a, b)
    measured = scheduler.measure(module, inputs, repeats=1).peak_bytes
    assert f"measured peak {format_bytes(measured)} " in out, out


def test_compare_unet_writes_the_rows_it_prints(capsys, tmp_path):
    path = tmp_path / "unet.json"
    out = run_script("compare_unet", ["--small", "--no-measure", "--budget", "70%",
                                      "--time-limit", "5", "--json", str(path)], capsys)
    rows = json.loads(path.read_text())["rows"]
    assert {r["budget"] for r in rows} == {"70%"}
    auto = next(r for r in rows if r["strategy"] == "auto")
    assert auto["fits_predicted"] and f"auto ({auto['solver']})" in out
    assert all(r["measured_peak_bytes"] is None for r in rows)


@pytest.mark.parametrize("name", ["train_gpt", "compare_unet", "reapply"])
def test_scripts_have_help(name, capsys):
    module = importlib.import_module(f"examples.{name}")
    with pytest.raises(SystemExit) as info:
        module.main(["--help"])
    assert info.value.code == 0 and "python examples/" in capsys.readouterr().out
