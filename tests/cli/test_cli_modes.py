"""``--mode``, ``--times``, ``--device`` and ``--device-spec`` of ``scheduler profile`` and
``scheduler solve``, on the real MLP example: a fake profile's graph equals the real one's in
memory, says what it is, and bad combinations are one-line errors before anything runs."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

import scheduler
import scheduler.capture.profile
from scheduler.capture.scratch import without_scratch
from scheduler.ir.graph import CostGraph
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


def _memory(g: CostGraph) -> tuple:
    return (g.storages, [n.saved for n in g.nodes], [n.out_bytes for n in g.nodes],
            g.fwd_events, [(s.node, s.events) for s in g.bwd_steps],
            (g.param_bytes, g.buffer_bytes, g.input_bytes, g.grad_bytes))


def test_profile_fake_roofline_matches_the_real_memory(factory, tmp_path):
    fake_out, real_out = tmp_path / "fake.json", tmp_path / "real.json"
    code, stdout, err = run(["profile", f"{factory}:small", "--mode", "fake", "--times",
                             "roofline", "--device-spec", "h100", "--out", str(fake_out)])
    assert code == 0, err
    assert "fake tensors" in stdout and "roofline" in stdout and "n/a (not run)" in stdout
    fake_stdout = stdout
    code, stdout, err = run(["profile", f"{factory}:small", "--mode", "real", "--repeats", "1",
                             "--out", str(real_out)])
    assert code == 0, err
    assert "kernels' scratch" in stdout and "kernels' scratch" not in fake_stdout
    fake, real = CostGraph.load(fake_out), CostGraph.load(real_out)
    assert _memory(fake) == _memory(without_scratch(real))  # (a fake profile has no scratch)
    assert fake.meta["profile"]["mode"] == "fake" and fake.meta["times"] == "roofline"
    assert real.meta["profile"]["mode"] == "real"
    assert fake.measured_peak_bytes == 0 < real.measured_peak_bytes
    assert all(n.time_s > 0 for n in fake.nodes if "linear" in n.name)


def test_solve_fake_writes_a_schedule_that_fits_for_real(factory, tmp_path):
    out = tmp_path / "s.json"
    code, stdout, err = run(["solve", f"{factory}:small", "--budget", "70%", "--solver",
                             "greedy", "--mode", "fake", "--times", "roofline",
                             "--device-spec", "cpu", "--out", str(out)])
    assert code == 0, err
    assert "fake, roofline times" in stdout
    schedule = json.loads(out.read_text())
    from examples.mlp import build
    model, inputs = build(batch=256, dim=32, depth=3)
    plan_module = scheduler.apply(model, str(out), inputs)
    m = scheduler.measure(plan_module, inputs, repeats=1)
    assert m.peak_bytes <= schedule["budget_bytes"]


@pytest.mark.parametrize("argv, fragment", [
    (["--mode", "real", "--times", "roofline"], "times='roofline' is for a fake profile"),
    (["--mode", "fake", "--times", "measured"], "times='measured' needs the real step"),
    (["--mode", "fake", "--times", "roofline"], "needs a device spec"),
    (["--mode", "fake", "--times", "roofline", "--device-spec", "tpu9"],
     "unknown device spec 'tpu9'"),
])
def test_bad_combinations_are_one_line_before_profiling(factory, tmp_path, monkeypatch, argv,
                                                        fragment):
    def boom(*args, **kwargs):
        raise AssertionError("the model was traced before the arguments were checked")

    monkeypatch.setattr(scheduler.capture.profile, "trace", boom)
    for verb in (["profile"], ["solve", "--budget", "50%"]):
        code, _, err = run([*verb, f"{factory}:small", *argv, "--out",
                            str(tmp_path / "x.json")])
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, err
        assert fragment in lines[0]


def test_mode_choices_are_checked_by_argparse(factory):
    code, _, err = run(["profile", f"{factory}:small", "--mode", "virtual"])
    assert code == 2 and "invalid choice: 'virtual'" in err
