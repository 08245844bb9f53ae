"""Hugging Face T5 and Whisper given ``labels``: solvers plan around the in-place writes of
``shift_tokens_right`` (``new_zeros``, item assignment, ``masked_fill_``), so that a plan is
never refused by the rewriter (issue 34, item 2: ``auto`` once answered a schedule whose region
started between ``new_zeros`` and ``fill_``, and ``solve`` raised `ScheduleError`).

Models are built from tiny configs with random weights (no download). Each plan's loss and
gradients are compared with the unmodified model's, bit for bit on CPU.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from conftest import BUDGETS, budget_bytes

import scheduler
from scheduler.capture.trace import trace
from scheduler.ir.replays import allowed
from scheduler.ir.schedule import KEEP, RECOMPUTE, Schedule, ScheduleError
from scheduler.plan import solve_graph
from scheduler.rewrite import rewrite
from scheduler.solvers import get_solver
from scheduler.solvers.base import finish
from scheduler.solvers.heuristics import BASELINES

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class T5WithLabels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                    num_decoder_layers=2, num_heads=2, decoder_start_token_id=0,
                                    pad_token_id=0, dropout_rate=0.0)
        self.m = transformers.T5ForConditionalGeneration(cfg)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, labels=labels).loss


class WhisperWithLabels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        cfg = transformers.WhisperConfig(
            vocab_size=64, num_mel_bins=8, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=2, decoder_attention_heads=2, d_model=32,
            encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
            max_target_positions=32, decoder_start_token_id=0, pad_token_id=0, bos_token_id=0,
            eos_token_id=0, attn_implementation="eager", use_cache=False)
        self.m = transformers.WhisperForConditionalGeneration(cfg)

    def forward(self, input_features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_features=input_features, labels=labels).loss


def _ids(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(1, 64, shape, generator=torch.Generator().manual_seed(seed))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Any, ...]]]] = {
    "t5": (T5WithLabels, lambda: (_ids((8, 32), 1), _ids((8, 32), 2))),
    "whisper": (WhisperWithLabels, lambda: (
        torch.randn(8, 8, 32, generator=torch.Generator().manual_seed(3)), _ids((8, 24), 2))),
}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]().train()


def _step(module: nn.Module, inputs: tuple[Any, ...], loss_fn: Any = None
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    for p in module.parameters():
        p.grad = None
    out = module(*inputs)
    loss = loss_fn(out) if loss_fn else out
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}
    for p in module.parameters():
        p.grad = None
    return loss.detach(), grads


def _same(got: Any, ref: Any, where: str) -> None:
    (loss, grads), (rloss, rgrads) = got, ref
    assert torch.equal(loss, rloss), f"loss {loss.item()!r} != {rloss.item()!r}: {where}"
    assert list(grads) == list(rgrads)
    differ = [n for n in grads if (grads[n] is None) != (rgrads[n] is None) or (
        grads[n] is not None and not torch.equal(grads[n], rgrads[n]))]
    assert not differ, f"gradients of {differ} differ: {where}"


_CACHE: dict[str, Any] = {}


def _setup(name: str) -> tuple[nn.Module, tuple[Any, ...], Any, Any, Any]:
    """(model, inputs, graph, traced graph, reference step), once per model a session."""
    if name not in _CACHE:
        torch.set_num_threads(1)
        inputs = MODELS[name][1]()
        ref = _step(_build(name), inputs)
        model = _build(name)
        graph = scheduler.profile(model, inputs, repeats=1, units=None)
        assert graph.written_reads, "the profile recorded no in-place write: the test is vacuous"
        _CACHE[name] = (model, inputs, graph, trace(model, inputs), ref)
    return _CACHE[name]


def _check_plan(name: str, schedule: Schedule, where: str) -> None:
    model, inputs, _, gm, ref = _setup(name)
    module = rewrite(gm, schedule, model)
    _same(_step(module, inputs, module.forward.loss_fn), ref, where)


@pytest.mark.parametrize("name", [pytest.param("t5", marks=pytest.mark.slow), "whisper"])
def test_the_graph_allows_exactly_what_the_rewriter_runs(name: str) -> None:
    """Around each recorded write, a recompute region from each start to the end is allowed
    by the graph exactly when the rewriter accepts it."""
    model, inputs, graph, gm, _ = _setup(name)
    names = graph.compute_nodes
    n = len(names)
    at = {x: i for i, x in enumerate(names)}
    near = {i for w in graph.written_reads for x in (w.value, w.writer, w.reader) if x in at
            for i in range(max(1, at[x] - 2), min(n, at[x] + 3))}
    refused = 0
    for k in sorted(near):
        schedule = Schedule.from_regions(graph, [(0, k, KEEP), (k, n, RECOMPUTE)])
        try:
            rewrite(gm, schedule, model)
            accepted = True
        except ScheduleError as e:
            assert "writes in place" in str(e), str(e)
            accepted, refused = False, refused + 1
        assert allowed(graph, k, n) == accepted, (names[k], accepted)
    assert refused, "no start was refused: the test is vacuous"


def test_a_refused_cut_is_moved_before_any_result_is_returned() -> None:
    """The issue's schedule: a recompute region from ``fill_`` on. The rewriter refuses it;
    what every solver's result goes through (`base.finish`) moves the cut, and the plan then
    computes the model's loss and gradients."""
    _, _, graph, gm, _ = _setup("t5")
    names = graph.compute_nodes
    k = next(i for i, x in enumerate(names) if x.startswith("fill_"))
    schedule = Schedule.from_regions(graph, [(0, k, KEEP), (k, len(names), RECOMPUTE)])
    with pytest.raises(ScheduleError, match="writes in place"):
        _check_plan("t5", schedule, "refused")
    result = finish(graph, 1 << 50, schedule, solver="test", started=0.0)
    assert result.schedule.meta["moved_cuts"]
    _check_plan("t5", result.schedule, "moved")


def _solve(name: str, fraction: float, solver: str, time_limit_s: float) -> Schedule | None:
    graph = _setup(name)[2]
    budget = budget_bytes(graph, fraction)
    if solver == "auto":
        try:
            return solve_graph(graph, budget, solver="auto", time_limit_s=time_limit_s).schedule
        except scheduler.InfeasibleBudgetError:
            return None
    # a baseline returns its schedule even where it misses the budget: it still must run
    return get_solver(solver)(graph, budget).schedule


def test_t5_at_70_percent_plans_run() -> None:
    """The fast representative of the matrix below: T5 at 70% with ``auto`` (a short limit)
    and two baselines."""
    for solver in ("auto", "uniform:4", "greedy"):
        schedule = _solve("t5", 0.7, solver, 5.0)
        assert schedule is not None, solver
        _check_plan("t5", schedule, f"t5 at 70%, {solver}")


@pytest.mark.slow
@pytest.mark.parametrize("fraction", BUDGETS)
@pytest.mark.parametrize("name", ["t5", "whisper"])
def test_every_solver_plans_around_the_writes(name: str, fraction: float) -> None:
    for solver in ("auto", "none", *BASELINES, "uniform:8"):
        schedule = _solve(name, fraction, solver, 10.0)
        if schedule is None:
            continue  # auto: nothing fits (InfeasibleBudgetError, not a refused plan)
        _check_plan(name, schedule, f"{name} at {fraction:.0%}, {solver}")
