"""benchmarks/cuda_check.py: without a CUDA device it skips cleanly (exit 0); its comparison of
memory events finds fake and real CPU profiles identical and names a difference put in."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import benchmark_modules

import scheduler

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "cuda_check.py"
(cuda_check,) = benchmark_modules("cuda_check")


def test_without_a_cuda_device_it_skips_with_exit_0():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no device, even on a machine with one
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, str(SCRIPT), "--models", "gpt"], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "skipped: no CUDA device (torch.cuda.is_available() is False)"


def test_bad_budgets_are_an_error_naming_them(capsys):
    with pytest.raises(SystemExit) as e:
        cuda_check.main(["--budgets", "0.5,2"])
    assert e.value.code == 2
    assert "--budgets must be fractions in (0, 1], got [0.5, 2.0]" in capsys.readouterr().err


def test_memory_events_of_fake_and_real_cpu_profiles_compare_identical():
    from examples.gpt import build

    model, inputs = build(batch=1, block_size=32, n_layer=1, n_head=2, n_embd=16,
                          vocab_size=32)
    real = scheduler.profile(model, inputs, mode="real", repeats=1)
    fake = scheduler.profile(model, inputs, mode="fake", times="roofline", device_spec="cpu")
    assert cuda_check.differences(real, fake) == []

    i, node = next((i, n) for i, n in enumerate(fake.nodes) if n.saved)
    bigger = dataclasses.replace(node, out_bytes=node.out_bytes + 512,
                                 saved=node.saved[:-1])
    fake.nodes[i] = bigger
    lost = node.saved[-1].bytes
    found = cuda_check.differences(real, fake)
    assert found == [
        f"{node.name}: output {node.out_bytes} bytes real, {node.out_bytes + 512} fake",
        (f"{node.name}: saved {node.saved_bytes} bytes in {len(node.saved)} real, "
         f"{node.saved_bytes - lost} in {len(node.saved) - 1} fake")]


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_cuda_device_the_gpt_example_passes():
    assert cuda_check.main(["--models", "gpt"]) == 0
