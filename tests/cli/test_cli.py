"""The command line and MODEL_SPEC resolution, with a fake profiler: no real profiling runs."""

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from scheduler import cli
from scheduler.cli import common
from scheduler.cli.spec import SpecError, load_factory

GOOD_FACTORY = """
import torch
from torch import nn

def build():
    return nn.Linear(4, 2), torch.randn(3, 4)

def build_with_loss():
    return nn.Linear(4, 2), (torch.randn(3, 4),), lambda out: out.sum()

def build_list_inputs():
    return nn.Linear(4, 2), [torch.randn(3, 4)]

def helper_one():
    pass

class Thing:
    pass

not_callable = 3
"""


def write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


# ---------------------------------------------------------------------------- load_factory


def test_load_factory_single_tensor_is_wrapped(tmp_path):
    path = write(tmp_path, "models.py", GOOD_FACTORY)
    model, inputs, loss_fn = load_factory(f"{path}:build")
    assert isinstance(model, torch.nn.Linear)
    assert isinstance(inputs, tuple) and len(inputs) == 1
    assert inputs[0].shape == (3, 4)
    assert loss_fn is None


def test_load_factory_with_loss_and_list_inputs(tmp_path):
    path = write(tmp_path, "models.py", GOOD_FACTORY)
    model, inputs, loss_fn = load_factory(f"{path}:build_with_loss")
    assert callable(loss_fn)
    assert float(loss_fn(torch.ones(2))) == 2.0
    _, inputs, _ = load_factory(f"{path}:build_list_inputs")
    assert isinstance(inputs, tuple) and len(inputs) == 1


def test_load_factory_sibling_import(tmp_path):
    write(tmp_path, "blocks_for_spec_test.py", "from torch import nn\nclass Block(nn.Linear):\n    pass\n")
    path = write(
        tmp_path,
        "main_model.py",
        """
        import torch
        from blocks_for_spec_test import Block

        def build():
            return Block(2, 2), torch.zeros(1, 2)
        """,
    )
    model, _, _ = load_factory(f"{path}:build")
    assert type(model).__name__ == "Block"
    assert str(tmp_path) not in __import__("sys").path  # the path change was temporary


def test_load_factory_module_spec_from_current_directory(tmp_path, monkeypatch):
    package = tmp_path / "spec_test_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write(package, "models.py", GOOD_FACTORY)
    monkeypatch.chdir(tmp_path)
    model, inputs, loss_fn = load_factory("spec_test_pkg.models:build")
    assert isinstance(model, torch.nn.Linear)
    assert len(inputs) == 1 and loss_fn is None


KEYWORD_FACTORY = """
import torch
import torch.nn as nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, mask=None, scale=2.0, target=None):
        return self.lin(x) * scale

def build():
    return Net(), {"x": torch.ones(2, 3), "target": torch.zeros(2, 3)}

def unbindable():
    return Net(), {"y": torch.ones(2, 3)}
"""


def test_load_factory_binds_keyword_inputs_to_the_signature(tmp_path):
    path = write(tmp_path, "kw.py", KEYWORD_FACTORY)
    model, inputs, _ = load_factory(f"{path}:build")
    assert len(inputs) == 4 and inputs[1] is None and inputs[2] == 2.0  # defaults filled in
    assert torch.equal(inputs[0], torch.ones(2, 3)) and torch.equal(inputs[3], torch.zeros(2, 3))
    with pytest.raises(SpecError, match=r"keyword inputs that do not bind: .*\['y'\]"):
        load_factory(f"{path}:unbindable")


def test_load_factory_module_spec_wrong_shape():
    with pytest.raises(SpecError, match=r"'torch.nn:Identity' returned a Identity; expected"):
        load_factory("torch.nn:Identity")  # a class with no required arguments: callable, wrong result


@pytest.mark.parametrize(
    ("spec_suffix", "fragments"),
    [
        ("", ["bad model spec", "path/to/file.py:factory"]),  # no colon
        (":", ["bad model spec"]),
        (":missing", ["has no attribute 'missing'", "build", "helper_one", "Thing"]),
        (":not_callable", ["not a callable factory"]),
    ],
)
def test_load_factory_bad_specs(tmp_path, spec_suffix, fragments):
    path = write(tmp_path, "models.py", GOOD_FACTORY)
    with pytest.raises(SpecError) as info:
        load_factory(f"{path}{spec_suffix}")
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_load_factory_missing_attribute_lists_only_own_callables(tmp_path):
    path = write(tmp_path, "models.py", GOOD_FACTORY)
    with pytest.raises(SpecError) as info:
        load_factory(f"{path}:missing")
    assert "it defines: build, build_list_inputs, build_with_loss, helper_one, Thing" in str(info.value)


def test_load_factory_missing_file(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(SpecError, match=r"model file not found: .*nope\.py"):
        load_factory(f"{missing}:build")


def test_load_factory_import_failure_keeps_original_message(tmp_path):
    path = write(tmp_path, "broken.py", "import definitely_not_a_module_xyz\n")
    with pytest.raises(SpecError, match=r"importing .*broken\.py.* failed: ModuleNotFoundError: .*definitely_not_a_module_xyz"):
        load_factory(f"{path}:build")


def test_load_factory_module_import_failure():
    with pytest.raises(SpecError, match=r"importing module 'no_such_pkg_xyz\.models' failed: ModuleNotFoundError"):
        load_factory("no_such_pkg_xyz.models:build")


GARBAGE = """
import torch
from torch import nn

def returns_none():
    return None

def returns_one():
    return (nn.Linear(1, 1),)

def returns_four():
    return nn.Linear(1, 1), torch.ones(1), None, None

def model_not_module():
    return "model", torch.ones(1)

def inputs_not_tensor():
    return nn.Linear(1, 1), 3

def loss_not_callable():
    return nn.Linear(1, 1), torch.ones(1), 5

def raises():
    raise RuntimeError("boom\\nsecond line")

def needs_args(size):
    return nn.Linear(size, size), torch.ones(size)
"""


@pytest.mark.parametrize(
    ("factory", "fragments"),
    [
        ("returns_none", ["returned a NoneType", "expected (model, inputs) or (model, inputs, loss_fn)"]),
        ("returns_one", ["returned a tuple of 1 (Linear)", "expected (model, inputs)"]),
        ("returns_four", ["returned a tuple of 4", "expected (model, inputs)"]),
        ("model_not_module", ["returned a str as the model", "nn.Module"]),
        ("inputs_not_tensor", ["returned a int as the inputs", "expected a tensor, a tuple"]),
        ("loss_not_callable", ["returned a int as loss_fn", "expected a callable or None"]),
        ("raises", ["raised RuntimeError: boom second line"]),
        ("needs_args", ["requires arguments (size)"]),
    ],
)
def test_load_factory_wrong_results(tmp_path, factory, fragments):
    path = write(tmp_path, "garbage.py", GARBAGE)
    with pytest.raises(SpecError) as info:
        load_factory(f"{path}:{factory}")
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


# ---------------------------------------------------------------------------- main(["profile", ...])


@dataclass
class FakeNode:
    name: str
    time_s: float
    out_bytes: int


@dataclass
class FakeCostGraph:
    nodes: list = field(
        default_factory=lambda: [FakeNode("linear", 0.002, 24), FakeNode("relu", 0.001, 24)]
    )
    param_bytes: int = 40
    input_bytes: int = 48
    measured_peak_bytes: int = 3 * 1024**2
    measured_step_s: float = 0.0125

    def saved_bytes(self) -> int:
        return 48

    def save(self, path) -> None:
        Path(path).write_text(json.dumps({"nodes": [n.name for n in self.nodes]}))


@pytest.fixture
def fake_profile(monkeypatch):
    calls = []

    def fake(model, inputs, *, loss_fn, repeats, **options):
        calls.append({"model": model, "inputs": inputs, "loss_fn": loss_fn, "repeats": repeats,
                      **options})
        return FakeCostGraph()

    monkeypatch.setattr(common, "profile_model", fake)
    return calls


def test_profile_writes_graph_and_prints_summary(tmp_path, fake_profile, capsys):
    path = write(tmp_path, "models.py", GOOD_FACTORY)
    out = tmp_path / "graphs" / "m.json"  # the parent folder does not exist yet
    code = cli.main(["profile", f"{path}:build_with_loss", "--out", str(out), "--repeats", "4"])
    assert code == 0
    assert json.loads(out.read_text()) == {"nodes": ["linear", "relu"]}
    assert len(fake_profile) == 1
    assert fake_profile[0]["repeats"] == 4
    assert callable(fake_profile[0]["loss_fn"])
    assert isinstance(fake_profile[0]["inputs"], tuple)
    stdout = capsys.readouterr().out
    for fragment in ["nodes", "2", "3.00 MiB", "12.5 ms", "48 B", "40 B", "3.0 ms"]:
        assert fragment in stdout
    assert f"wrote {out}" in stdout


def test_profile_quiet_prints_nothing(tmp_path, fake_profile, capsys):
    path = write(tmp_path, "models.py", GOOD_FACTORY)
    out = tmp_path / "g.json"
    assert cli.main(["profile", f"{path}:build", "--out", str(out), "--quiet"]) == 0
    assert out.exists()
    assert fake_profile[0]["repeats"] is None  # the profiler's own default
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_profile_default_out(tmp_path, fake_profile, monkeypatch):
    path = write(tmp_path, "models.py", GOOD_FACTORY)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["profile", f"{path}:build", "--quiet"]) == 0
    assert (tmp_path / "models-build.json").exists()


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("no_colon_here", "bad model spec"),
        ("{tmp}/missing.py:build", "model file not found"),
        ("{tmp}/models.py:nope", "has no attribute 'nope'"),
        ("{tmp}/garbage.py:returns_none", "returned a NoneType"),
        ("no_such_pkg_xyz.models:build", "importing module 'no_such_pkg_xyz.models' failed"),
    ],
)
def test_profile_bad_spec_exits_2_with_one_line(tmp_path, fake_profile, capsys, spec, fragment):
    write(tmp_path, "models.py", GOOD_FACTORY)
    write(tmp_path, "garbage.py", GARBAGE)
    code = cli.main(["profile", spec.format(tmp=tmp_path), "--out", str(tmp_path / "o.json")])
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("scheduler: error: ")
    assert fragment in lines[0]
    assert fake_profile == []


def test_profile_out_is_a_directory(tmp_path, fake_profile, capsys):
    path = write(tmp_path, "models.py", GOOD_FACTORY)
    assert cli.main(["profile", f"{path}:build", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_traceback_flag_reraises(tmp_path, fake_profile):
    with pytest.raises(SpecError):
        cli.main(["--traceback", "profile", "no_colon_here"])


@pytest.mark.parametrize("argv", [["profile", "x.py:f", "--repeats", "0"], ["profile"], [], ["solve", "x.py:f"]])
def test_usage_errors_exit_2(argv, capsys):
    assert cli.main(argv) == 2
    assert "usage: scheduler" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["profile", "--help"]])
def test_help_has_an_example(argv, capsys):
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "example" in out
    assert "scheduler profile examples/gpt.py:build" in out


def test_only_working_verbs_are_registered():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    assert sorted(subparsers.choices) == ["advise", "apply", "bench", "compare", "max-batch",
                                          "profile", "solve"]


def test_importing_the_cli_does_not_import_torch():
    """`scheduler --help` stays fast: the verbs import the pipeline (and torch) only when run."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    code = "import scheduler.cli, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "False"
