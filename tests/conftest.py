"""Shared fixtures: small configurations of the example models, the recorded graphs and the
standard budgets.

``examples`` is not an installed package, so the repository root is put on ``sys.path``.
Test files import the constants and helpers here with ``from conftest import ...``.
Kept deliberately small; test-specific helpers live in the test files.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

import pytest

if TYPE_CHECKING:
    from scheduler.ir.graph import CostGraph

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: the recorded `CostGraph`s of real models, and the test data (schedules found by solvers)
GRAPHS_DIR = ROOT / "graphs"
DATA_DIR = ROOT / "tests" / "data"
#: ``(name, path)`` of every recorded graph, ``graphs/<name>.json``, by name
RECORDED_GRAPHS: list[tuple[str, Path]] = [(p.stem, p) for p in sorted(GRAPHS_DIR.glob("*.json"))]
assert RECORDED_GRAPHS, f"no recorded graphs in {GRAPHS_DIR}: the tests that read them need them"

#: the standard budgets, as fractions of the unscheduled simulated peak
BUDGETS = (0.9, 0.7, 0.5)


def unscheduled_peak(graph: CostGraph) -> int:
    """The simulated peak bytes of the graph's step without checkpointing."""
    from scheduler.cost.simulate import simulate
    from scheduler.ir.schedule import Schedule

    return simulate(graph, Schedule.none(graph)).peak_bytes


def peak_error(graph: CostGraph, schedule: Any, module: Any, inputs: Any
               ) -> tuple[float, int, int]:
    """How far ``schedule``'s predicted peak of the tensors on ``graph`` (kernels' scratch
    left out, `scratch.without_scratch`) is from the storage tracker's count of one measured
    step of ``module`` (its rewrite): the relative error, the predicted and measured bytes.
    (The allocator's count, scratch included, is held to the full prediction in
    tests/capture/test_scratch.py.)"""
    import scheduler
    from scheduler.capture.scratch import without_scratch
    from scheduler.cost.simulate import simulate

    predicted = simulate(without_scratch(graph), schedule).peak_bytes
    measured = scheduler.measure(module, inputs, repeats=1, warmup=0, allocator=False).peak_bytes
    return abs(predicted - measured) / measured, predicted, measured


def budget_bytes(graph: CostGraph, fraction: float) -> int:
    """``fraction`` of `unscheduled_peak`, in bytes (rounded down), as `scheduler.parse_budget`
    reads a fraction."""
    return int(fraction * unscheduled_peak(graph))


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``-n 2``, as the README runs the suite), one torch thread per
    worker: two workers of two threads each on two cores slow torch many times over."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        global _DEFAULT_THREADS
        _DEFAULT_THREADS = torch.get_num_threads()
        torch.set_num_threads(1)


#: torch's thread count before `pytest_configure` (None: it left it alone)
_DEFAULT_THREADS: int | None = None


@pytest.fixture(scope="module")
def torch_default_threads() -> Any:
    """Torch's own thread count for a test module whose assertions need it: oneDNN sizes its
    convolution scratch by the thread count, and the scratch tests need it as large as a
    single process has it."""
    import torch

    if _DEFAULT_THREADS is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(_DEFAULT_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def recorded_graph() -> Callable[[str], CostGraph]:
    """``recorded_graph(name)``: ``graphs/<name>.json`` as a new `CostGraph` on every call.

    Each file is read once a session. A fresh object each call, because what solvers and the
    simulator remember is kept per graph object (replays, bounds, brute-force spaces): a test
    that shares one would depend on what ran before it."""
    from scheduler.ir.graph import CostGraph

    texts: dict[str, str] = {}
    paths = dict(RECORDED_GRAPHS)

    def load(name: str) -> CostGraph:
        if name not in paths:
            raise KeyError(f"no recorded graph {name!r}; graphs/ holds {sorted(paths)}")
        if name not in texts:
            texts[name] = paths[name].read_text()
        return CostGraph.from_dict(json.loads(texts[name]))

    return load

#: Small but non-trivial sizes of every example (seconds, not minutes, to profile on 2 cores),
#: kept with the model factories the benchmarks share (benchmarks/_models.py)
def benchmark_modules(*names: str) -> tuple[ModuleType, ...]:
    """The scripts ``names`` of ``benchmarks/`` (not a package), imported with that folder on
    ``sys.path`` only while they load, so their names (``solvers``, ``sweep``, ...) shadow
    nothing else. Test files bind them as ``peers, _record = benchmark_modules("peers",
    "_record")``."""
    folder = str(ROOT / "benchmarks")
    sys.path.insert(0, folder)
    try:
        return tuple(importlib.import_module(name) for name in names)
    finally:
        sys.path.remove(folder)


(_models,) = benchmark_modules("_models")
SMALL = _models.SMALL
EXAMPLES = list(SMALL)


@pytest.fixture(scope="session")
def build_example() -> Callable[..., tuple[Any, tuple[Any, ...]]]:
    """``build_example(name, **overrides) -> (model, inputs)`` with the `SMALL` sizes; skips
    ``hf_gpt2`` when ``transformers`` is not installed. Same arguments, same seed: an
    identical, fresh model."""

    def build(name: str, **overrides: Any) -> tuple[Any, tuple[Any, ...]]:
        if name == "hf_gpt2":
            pytest.importorskip("transformers")
        mod = importlib.import_module(f"examples.{name}")
        return mod.build(**{**SMALL[name], **overrides})

    return build


class ModelState:
    """An independent copy of everything `trace`/`profile` must leave as it was: state_dict
    values (BatchNorm running statistics included), parameters' ``.grad`` (object and value),
    train/eval flags, ``requires_grad``, hooks and instance attributes."""

    def __init__(self, model: Any) -> None:
        self.state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
        self.grads = [(p, p.grad, None if p.grad is None else p.grad.clone())
                      for p in model.parameters()]
        self.meta = self._meta(model)

    @staticmethod
    def _meta(model: Any) -> dict[str, Any]:
        mods = list(model.named_modules())
        return {
            "params": [id(p) for p in model.parameters()],
            "requires_grad": [p.requires_grad for p in model.parameters()],
            "training": [(n, m.training) for n, m in mods],
            "hooks": [(n, len(m._forward_hooks), len(m._forward_pre_hooks),
                       len(m._backward_hooks)) for n, m in mods],
            "attributes": [(n, sorted(vars(m))) for n, m in mods],
        }

    def assert_unchanged(self, model: Any) -> None:
        import torch

        state = model.state_dict(keep_vars=True)
        assert list(state) == list(self.state)
        for k, v in self.state.items():
            assert torch.equal(state[k].detach(), v), f"state_dict[{k!r}] changed"
        for p, g_obj, g_val in self.grads:
            assert p.grad is g_obj, "a parameter's .grad was replaced"
            if g_val is not None:
                assert torch.equal(p.grad, g_val), "a parameter's .grad changed"
        after = self._meta(model)
        for key, value in self.meta.items():
            assert after[key] == value, f"model {key} changed"


@pytest.fixture(scope="session")
def model_state() -> type[ModelState]:
    """`ModelState`: ``before = model_state(model); ...; before.assert_unchanged(model)``."""
    return ModelState


def give_grads(model: Any) -> None:
    """Give every parameter a non-trivial ``.grad``, so restoring it to ``None`` is caught."""
    import torch

    g = torch.Generator().manual_seed(7)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


@pytest.fixture(scope="session")
def with_grads() -> Callable[[Any], None]:
    """`give_grads`."""
    return give_grads
