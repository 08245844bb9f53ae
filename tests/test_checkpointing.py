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


class _Table(torch.nn.Module):
    """A buffer several blocks read (as torchtitan's Llama shares its RoPE table)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(0.5, 1.5, dim))


class _Block(torch.nn.Module):
    def __init__(self, dim: int, shared: _Table) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)
        self.shared = shared  # (the same module object in every block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.shared.table + x  # (``mul`` saves the table)


class _SharedBuffer(torch.nn.Module):
    def __init__(self, dim: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.table = _Table(dim)
        self.blocks = torch.nn.ModuleList(_Block(dim, self.table) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def test_a_buffer_a_replay_only_reads_is_not_written_back() -> None:
    """A region whose nodes read a buffer that kept nodes outside it also saved: the replay
    restored every buffer it read with ``copy_``, which bumps the version counter, so the kept
    nodes' backward refused to run ("modified by an inplace operation"). Each block recomputed
    alone, every other block kept: loss and gradients are the unmodified model's."""
    torch.manual_seed(0)
    model, x = _SharedBuffer(), torch.randn(32, 16)
    reference = _SharedBuffer()
    reference.load_state_dict(model.state_dict())
    reference(x).backward()
    graph = scheduler.profile(model, (x,), repeats=1)
    n = len(graph.compute_nodes)
    blocks = [i for i, name in enumerate(graph.compute_nodes) if name.endswith("_lin")]
    assert len(blocks) == 4
    for b, start in enumerate(blocks):
        stop = blocks[b + 1] if b + 1 < len(blocks) else n - 2  # (the loss stays kept)
        spans = [(0, start, "keep")] if start else []
        spans += [(start, stop, "recompute"), (stop, n, "keep")]
        schedule = scheduler.Schedule.from_regions(graph, spans)
        module = scheduler.apply(model, schedule, (x,))
        for p in model.parameters():
            p.grad = None
        loss = module(x)
        loss.backward()
        assert torch.equal(loss, reference(x)), b
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), (b, name)
        assert torch.equal(model.table.table, torch.linspace(0.5, 1.5, 16))
