"""The region module (`scheduler.checkpointing.CheckpointRegion`): what a replay costs beyond
its ops, and the calibration that times it (`capture.timing.checkpoint_costs`)."""

from __future__ import annotations

import traceback

import torch

import scheduler
from scheduler.capture import timing
from scheduler.capture.trace import default_loss_recipe
from scheduler.checkpointing import CheckpointRegion
from scheduler.solvers import get_solver


def test_a_replay_formats_no_traceback(monkeypatch) -> None:
    """Every replay ends by raising (PyTorch stops recomputing once backward has what it
    needs); the body is called past fx's call wrapper, which walked and formatted the traceback
    of every exception through it (about 0.2 ms a replay on a CPU)."""
    from examples.mlp import build

    model, inputs = build(batch=16, dim=16, depth=3)
    graph = scheduler.profile(model, inputs, repeats=1)
    schedule = get_solver("every_block")(graph, 1 << 62).schedule
    assert schedule.recompute_regions
    module = scheduler.apply(model, schedule, inputs)
    def step() -> None:
        for p in module.parameters():
            p.grad = None
        out = module(*inputs)
        default_loss_recipe(out)(out).backward()

    step()  # (a first step: anything set up once is set up)
    calls = []
    real = traceback.StackSummary.extract

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(traceback.StackSummary, "extract", staticmethod(counted))
    replays = []
    monkeypatch.setattr(CheckpointRegion, "_eager_body",
                        _counting(CheckpointRegion._eager_body, replays))
    step()
    assert sum(replays) >= len(schedule.recompute_regions)  # (every region replayed)
    assert not calls


def _counting(body, replays):
    def run(self, call, attrs, *inputs):
        replays.append(int(call.n >= 1))  # (call.n counts the calls before this one)
        return body(self, call, attrs, *inputs)
    return run


def test_the_calibration_times_the_region_module_the_executor_runs() -> None:
    region = timing._chain_region(3)
    assert isinstance(region, CheckpointRegion)
    x = torch.linspace(-1, 1, 8).requires_grad_()
    (y,) = region(x)
    torch.testing.assert_close(y, torch.tanh(torch.tanh(torch.tanh(x))))
    y.sum().backward()  # (replayed in backward)
    x2 = x.detach().requires_grad_()
    torch.tanh(torch.tanh(torch.tanh(x2))).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    call, saved = timing.checkpoint_costs(torch.device("cpu"), rounds=1)
    assert call >= 0 and saved >= 0
