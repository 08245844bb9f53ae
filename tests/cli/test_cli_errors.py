"""Every user error of the command line is one line, ``scheduler: error: ...``, exit code 2,
and no traceback; ``--debug`` (alias ``--traceback``) shows the traceback; a genuine bug shows
its traceback and asks for a report (issue 23, item 2)."""

from __future__ import annotations

import errno
import json
import textwrap
from pathlib import Path

import pytest

import scheduler.files
from scheduler.capture.fake import FakeProfileError, RejectedInputsError
from scheduler.capture.trace import TraceError
from scheduler.cli import common
from tests._cli import run

MODELS = """
import torch
from torch import nn

from examples.mlp import build


def mlp():
    return build(batch=4, dim=8, depth=2)


def mlp_meta():
    model, inputs = build(batch=4, dim=8, depth=2)
    return model.to("meta"), tuple(x.to("meta") for x in inputs)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # a branch on a tensor's value: neither tracer can capture it
            return y * 2
        return y


def branchy():
    return Branchy(), (torch.randn(2, 4),)


def frozen():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    model.requires_grad_(False)
    return model, (torch.randn(2, 4),)


def nested():
    return nn.Sequential(nn.Linear(4, 4)), ([[1.0, 2.0, 3.0, 4.0]],)
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "models.py"
    path.write_text(textwrap.dedent(MODELS))
    return path


@pytest.fixture(scope="module")
def schedule(models, tmp_path_factory) -> Path:
    """A good schedule of ``mlp``, written by ``scheduler solve``."""
    out = tmp_path_factory.mktemp("schedule") / "mlp.schedule.json"
    code, _, err = run(["solve", f"{models}:mlp", "--budget", "1MiB", "--out", str(out),
                        "--quiet"])
    assert code == 0, err
    return out


def one_line_error(code: int, err: str) -> str:
    """The single error line, after checking the shape of a user error."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("scheduler: error: "), err
    return lines[0]


def solve(models: Path, factory: str, *extra: str) -> list[str]:
    return ["solve", f"{models}:{factory}", "--budget", "1MiB", "--quiet", *extra]


# ------------------------------------------------------------------ the model and its inputs


@pytest.mark.parametrize("verb", ["profile", "solve"])
def test_untraceable_model(models, tmp_path, verb):
    argv = ([verb, f"{models}:branchy", "--out", str(tmp_path / "o.json"), "--quiet"]
            + (["--budget", "1MiB"] if verb == "solve" else []))
    line = one_line_error(*run(argv)[::2])
    assert "could not trace Branchy" in line and "torch.where" in line
    assert "models.py:" in line  # the failing line of the model


@pytest.mark.parametrize("mode", ["auto", "real", "fake"])
def test_nothing_requires_grad(models, tmp_path, mode):
    line = one_line_error(*run(solve(models, "frozen", "--mode", mode, "--out",
                                     str(tmp_path / "o.json")))[::2])
    assert "nothing requires grad" in line
    assert "all 4 parameters of Sequential are frozen" in line
    assert "requires_grad_(True)" in line


def test_nested_list_inputs(models, tmp_path):
    line = one_line_error(*run(["profile", f"{models}:nested", "--out",
                                str(tmp_path / "o.json"), "--quiet"])[::2])
    assert "input 0" in line and "nested lists" in line and "torch.tensor" in line


def test_meta_model_solves_fake(models, tmp_path):
    """``solve``'s default mode='auto' profiles a meta model under fake tensors: it works."""
    out = tmp_path / "meta.schedule.json"
    code, _, err = run(solve(models, "mlp_meta", "--out", str(out)))
    assert code == 0, err
    assert json.loads(out.read_text())["regions"] is not None


@pytest.mark.parametrize("verb", ["apply", "compare"])
def test_meta_model_cannot_be_measured(models, schedule, verb):
    argv = (["apply", f"{models}:mlp_meta", str(schedule), "--quiet"] if verb == "apply"
            else ["compare", f"{models}:mlp_meta", "--budget", "1MiB", "--quiet"])
    line = one_line_error(*run(argv)[::2])
    assert "measuring runs real training steps" in line and "meta" in line
    assert "mode='fake'" in line


def test_meta_model_in_a_real_profile(models, tmp_path):
    line = one_line_error(*run(solve(models, "mlp_meta", "--mode", "real", "--out",
                                     str(tmp_path / "o.json")))[::2])
    assert "meta" in line and "mode='fake'" in line


# ------------------------------------------------------------------ where the output goes


def test_out_parent_is_a_file(models, tmp_path):
    (tmp_path / "afile").write_text("x")
    line = one_line_error(*run(solve(models, "mlp", "--out",
                                     str(tmp_path / "afile" / "x.json")))[::2])
    assert "afile" in line and "is a file" in line


def test_out_name_too_long(models, tmp_path):
    path = tmp_path / ("a" * 300 + ".json")
    line = one_line_error(*run(solve(models, "mlp", "--out", str(path)))[::2])
    assert "too long" in line.lower() and "a" * 300 in line


@pytest.mark.parametrize("verb", ["profile", "solve"])
def test_out_is_a_device(models, verb):
    argv = ([verb, f"{models}:mlp", "--out", "/dev/full", "--quiet"]
            + (["--budget", "1MiB"] if verb == "solve" else []))
    line = one_line_error(*run(argv)[::2])
    assert "'/dev/full'" in line and "not a regular file" in line


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs /sys (Linux)")
def test_out_under_sys(models):
    line = one_line_error(*run(solve(models, "mlp", "--out", "/sys/kernel/x.json"))[::2])
    assert "'/sys/kernel/x.json'" in line  # the destination, not a temporary file


def test_disk_full_while_writing(models, tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(scheduler.files.os, "fsync", full)
    out = tmp_path / "o.json"
    line = one_line_error(*run(solve(models, "mlp", "--out", str(out)))[::2])
    assert "No space left on device" in line and str(out) in line
    assert "free some space" in line
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no temporary file left


# ------------------------------------------------------------------ schedule files


def test_schedule_is_a_directory(models, tmp_path):
    line = one_line_error(*run(["apply", f"{models}:mlp", str(tmp_path), "--quiet"])[::2])
    assert str(tmp_path) in line and "directory" in line.lower()


def test_binary_schedule(models, tmp_path):
    path = tmp_path / "binary.json"
    path.write_bytes(bytes(range(256)) * 4)
    one_line_error(*run(["apply", f"{models}:mlp", str(path), "--quiet"])[::2])


def test_binary_schedule_names_the_file(models, tmp_path):
    path = tmp_path / "binary.json"
    path.write_bytes(bytes(range(256)) * 4)
    assert "binary.json" in one_line_error(*run(["apply", f"{models}:mlp", str(path),
                                                 "--quiet"])[::2])


@pytest.mark.parametrize("field,value", [("budget_bytes", "abc"), ("estimate", [1, 2])])
def test_schedule_with_a_bad_field(models, schedule, tmp_path, field, value):
    data = json.loads(schedule.read_text())
    data[field] = value
    path = tmp_path / "bad.schedule.json"
    path.write_text(json.dumps(data))
    line = one_line_error(*run(["apply", f"{models}:mlp", str(path), "--quiet"])[::2])
    assert field in line and "bad.schedule.json" in line


# ------------------------------------------------------------------ budgets and profiles


def test_infeasible_budget(models, tmp_path):
    code, _, err = run(["solve", f"{models}:mlp", "--budget", "1KiB", "--quiet", "--out",
                        str(tmp_path / "o.json")])
    line = one_line_error(code, err)
    assert "infeasible" in line and "or more" in line


@pytest.mark.parametrize("error", [FakeProfileError("the fake profile failed: fix it"),
                                   RejectedInputsError("the model rejected the inputs: fix it"),
                                   TraceError("could not trace: fix it"),
                                   OSError(errno.EACCES, "Permission denied", "/x/y.json")])
def test_library_errors_are_user_errors(models, tmp_path, monkeypatch, error):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(common, "profile_model", fail)
    line = one_line_error(*run(["profile", f"{models}:mlp", "--out", str(tmp_path / "o.json"),
                                "--quiet"])[::2])
    assert "fix it" in line or "'/x/y.json' (check its permissions" in line


# ------------------------------------------------------------------ --debug and genuine bugs


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("flag", ["--debug", "--traceback"])
def test_debug_raises_with_the_traceback(models, tmp_path, flag, where):
    argv = ["profile", f"{models}:frozen", "--out", str(tmp_path / "o.json"), "--quiet"]
    argv = [flag, *argv] if where == "before" else [*argv, flag]
    with pytest.raises(ValueError, match="nothing requires grad"):
        run(argv)


def test_a_bug_shows_its_traceback_and_asks_for_a_report(models, tmp_path, monkeypatch):
    def bug(*args, **kwargs):
        raise KeyError("no-such-node")

    monkeypatch.setattr(common, "profile_model", bug)
    code, _, err = run(["profile", f"{models}:mlp", "--out", str(tmp_path / "o.json"),
                        "--quiet"])
    assert code == 1, err
    assert err.startswith("Traceback (most recent call last):"), err
    assert "KeyError: 'no-such-node'" in err and "in bug" in err
    assert "scheduler: internal error: KeyError" in err
    assert "this is a bug in scheduler " in err and "please report it" in err
    assert "scheduler: error:" not in err


def test_meta_model_compared_by_prediction(models, tmp_path):
    """``compare --no-measure --mode fake`` ranks a model that cannot run: rows predicted,
    none measured."""
    out = tmp_path / "c.json"
    code, _, err = run(["compare", f"{models}:mlp_meta", "--budget", "100%", "--no-measure",
                        "--mode", "fake", "--times", "roofline", "--device-spec", "cpu",
                        "--strategy", "auto,every_block", "--time-limit", "5", "--json",
                        str(out), "--quiet"])
    assert code == 0, err
    rows = json.loads(out.read_text())["rows"]
    assert {r["strategy"] for r in rows} == {"auto", "every_block"}
    assert all(r["measured_peak_bytes"] is None and r["predicted_peak_bytes"] for r in rows)
