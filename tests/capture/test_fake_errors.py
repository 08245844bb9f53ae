"""Bad input to a fake profile (issue 21's "Bad input"): shapes the model rejects, a device
that is not there, ops fake tensors cannot run. Each is a one-line error naming the value, the
line of the model and the way out; ``mode="auto"`` falls back to the real profile where fake
tensors cannot run the step, and says why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from _fake_cases import FAKE, TINY, example
from conftest import ROOT

import scheduler
from scheduler.capture.fake import FakeProfileError, RejectedInputsError


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert msg and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("mode", ["fake", "auto", "real"])
def test_shapes_the_model_rejects(mode: str, capfd: Any) -> None:
    model, _ = example("mlp", batch=8, dim=16, depth=2)()
    opts = FAKE | {"mode": mode} if mode != "real" else {"mode": "real", "repeats": 1}
    with pytest.raises(RejectedInputsError) as e:
        scheduler.profile(model, (torch.randn(8, 17),), **opts)
    msg = _one_line(e.value)
    assert msg.startswith("ResidualMLP rejects the example inputs float32[8, 17]: RuntimeError: "
                          "Given normalized_shape=[16]"), msg
    assert "examples/mlp.py:" in msg and "self.norm(x)" in msg
    assert "give inputs of the shapes and dtypes ResidualMLP.forward takes" in msg
    assert isinstance(e.value, ValueError)
    with pytest.raises(RejectedInputsError) as e:  # a dtype, given as a spec
        scheduler.profile(model, (((8, 16), torch.long),), **FAKE)
    msg = _one_line(e.value)
    assert "int64[8, 16]" in msg and "mean(): could not infer output dtype" in msg
    assert "failed while attempting to run meta" not in capfd.readouterr().err


def test_device_not_available_is_named_without_crashing() -> None:
    """Autograd on fake CUDA tensors aborts a process whose PyTorch has no CUDA: run in one."""
    script = textwrap.dedent("""
        import torch, scheduler
        from examples.mlp import build
        model, inputs = build(batch=8, dim=16, depth=2)
        calls = [("fake", dict(mode="fake", times="roofline", device_spec="cpu")),
                 ("auto", dict(times="roofline", device_spec="cpu")),
                 ("real", dict(mode="real"))]
        for label, opts in calls:
            try:
                scheduler.profile(model, inputs, device="cuda", **opts)
                print(label, "no error")
            except Exception as e:
                print(label, type(e).__name__, str(e).replace(chr(10), "|"))
        try:
            scheduler.solve(model, inputs, budget=0.7, device="cuda", times="roofline",
                            device_spec="cpu")
        except Exception as e:
            print("solve", type(e).__name__, str(e).replace(chr(10), "|"))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    if torch.version.cuda is None and torch.version.hip is None:
        for label in ("fake", "auto", "solve"):
            assert lines[label].startswith(
                "FakeProfileError cannot plan for device cuda here: this PyTorch build"), lines
            assert "has no CUDA support" in lines[label] and "device='cpu'" in lines[label]
    assert lines["real"] == (
        "ValueError mode='real' runs the step where the model and inputs are (cpu), not on "
        "device='cuda'; move them there first, or plan for cuda without running on it with "
        "mode='fake'")


def test_device_that_is_no_device() -> None:
    model, inputs = example("mlp", batch=8, dim=16, depth=2)()
    for mode in ("fake", "real"):
        with pytest.raises(ValueError, match=r"^device='tpu' is not a device \(.*\); give e\.g\. "
                                             r"'cpu', 'cuda' or 'cuda:1'$"):
            scheduler.profile(model, inputs, mode=mode, device="tpu",
                              **({} if mode == "real" else {"times": "roofline",
                                                            "device_spec": "cpu"}))


@pytest.mark.parametrize("name", ["gpt", "llama"])  # the fx path; the export path
def test_meta_is_no_device_to_plan_for(name: str) -> None:
    """Meta tensors have no storage: a step "on meta" counted the parameters only (GPT:
    112,640 B of a 335,368 B step) or crashed in torch.export (Llama)."""
    model, inputs = TINY[name]()
    for mode in ("fake", "auto", "real"):
        opts = {"mode": mode, "repeats": 1} | ({} if mode == "real" else
                                               {"times": "roofline", "device_spec": "cpu"})
        with pytest.raises(FakeProfileError) as e:
            scheduler.profile(model, inputs, device="meta", **opts)
        msg = _one_line(e.value)
        assert msg.startswith("device='meta' is not a device to plan for: meta tensors have no "
                              "storage"), msg
        assert "device='cpu' or 'cuda'" in msg and "mode='fake'" in msg
    with pytest.raises(FakeProfileError, match=r"^device='meta' is not a device to plan for"):
        scheduler.solve(model, inputs, budget=0.9, device=torch.device("meta"), **FAKE)


class _Net(nn.Module):
    """A Linear, then ``op`` on its output, then a scalar."""

    def __init__(self, op: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(self.fc(x)).float().sum()


@torch.library.custom_op("scheduler_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    """A custom op with a backward and no fake kernel (no ``register_fake``)."""
    return x * 2


twice.register_autograd(lambda ctx, grad: grad * 2)

DATA_DEPENDENT = {
    # name: (op, what the message names)
    "nonzero": (lambda y: y[torch.nonzero(y > 0, as_tuple=True)],
                "torch.nonzero (also indexing with a boolean mask) [aten.nonzero.default]"),
    "boolean_mask": (lambda y: y[y > 0],
                     "torch.nonzero (also indexing with a boolean mask) [aten.nonzero.default]"),
    "masked_select": (lambda y: torch.masked_select(y, y > 0),
                      "torch.masked_select (also indexing with a boolean mask)"),
    "unique": (lambda y: y * torch.unique(y.detach().round()).sum(),
               "torch.unique [aten._unique2.default]"),
    "item": (lambda y: y * y.max().item(), "Tensor.item() (also .tolist(), int(t), float(t)"),
    "custom_op": (twice, "no fake impl registered for <CustomOpDef(scheduler_test::twice)>"),
}


@pytest.mark.parametrize("name", list(DATA_DEPENDENT))
def test_ops_fake_tensors_cannot_run(name: str) -> None:
    op, named = DATA_DEPENDENT[name]
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    model = _Net(op)
    with pytest.raises(FakeProfileError) as e:
        scheduler.profile(model, (x,), **FAKE)
    msg = _one_line(e.value)
    assert named in msg and "mode='real'" in msg and "test_fake_errors.py:" in msg, msg
    g = scheduler.profile(model, (x,), times="roofline", device_spec="cpu", repeats=1)
    assert g.meta["profile"]["mode"] == "real"
    assert g.meta["profile"]["why"].startswith("fake tensors failed: ")
    assert named in g.meta["profile"]["why"]
    real = scheduler.profile(model, (x,), mode="real", repeats=1)
    assert [n.name for n in g.nodes] == [n.name for n in real.nodes]
    assert g.saved_bytes() == real.saved_bytes()


def test_item_in_control_flow() -> None:
    """``if t.item() > 0:`` stops fake tensors (FakeProfileError), and the real step too: no
    tracer follows it (TraceError naming the line), so ``mode="auto"`` raises that."""
    class Branch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            if y.sum().item() > 0:
                return y.relu().sum()
            return y.sum()

    x = torch.randn(8, 16)
    with pytest.raises(FakeProfileError) as e:
        scheduler.profile(Branch(), (x,), **FAKE)
    msg = _one_line(e.value)
    assert "Tensor.item()" in msg and "if y.sum().item() > 0:" in msg and "mode='real'" in msg
    with pytest.raises(scheduler.TraceError, match=r"if y\.sum\(\)\.item\(\) > 0:"):
        scheduler.profile(Branch(), (x,), times="roofline", device_spec="cpu", repeats=1)
