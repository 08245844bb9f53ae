"""Plans under torch.distributed (gloo, CPU, 2 processes): DDP and root-level FSDP2 train with
the gradients of the unwrapped model on the ranks' concatenated batches, every rank runs rank
0's schedule, per-block FSDP2 (whose hooks the traced step bypasses) is refused by name, and a
model wrapped before solving is refused in one line and left as it was.

One spawn of two ranks runs every distributed scenario (`_worker`) and saves what each rank
saw; the tests read those records. The reference gradients are the unmodified model's, in this
process, on both ranks' batches at once: DDP and FSDP2 average the ranks' gradients, and the
loss is a mean over the batch, so the averaged gradient is the concatenated batch's.
"""

from __future__ import annotations

import os
import socket
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import RECORDED_GRAPHS
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import scheduler
from examples.mlp import Block
from scheduler.capture.program import Program
from scheduler.cost.simulate import simulate
from scheduler.distributed import (
    UnsupportedWrappingError,
    check_wrapping,
    hook_ids,
    same_schedule,
)
from scheduler.ir.schedule import Schedule
from scheduler.units import units_plan

WORLD = 2
BATCH, DIM = 256, 16  # activations, not parameters, dominate the peak: 60% needs recompute
BUDGET = "60%"
UNITS_BUDGET = "75%"  # (the units plan keeps the model's own code between blocks)
#: the ranks solve with different solvers on purpose: their own schedules differ (both cut
#: by structure alone: greedy, which reads the profiled times, once matched every_block under
#: load)
SOLVERS = ("every_block", "uniform:4")
#: parameters the traced graph reads directly (get_attr), not through a called module
DIRECT = {"scale"}


class Net(nn.Module):
    """Three residual MLP blocks, then a learnt per-feature scale read directly in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(DIM) for _ in range(3)])
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return (x * self.scale).square().mean()


def _net() -> Net:
    torch.manual_seed(0)
    return Net().train()


def _batches() -> torch.Tensor:
    """``(WORLD, BATCH, DIM)``: rank r trains on ``[r]``."""
    return torch.randn(WORLD, BATCH, DIM, generator=torch.Generator().manual_seed(1))


def _full_grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    out: dict[str, torch.Tensor | None] = {}
    for name, p in module.named_parameters():
        g = p.grad
        out[name] = None if g is None else (g.full_tensor() if hasattr(g, "full_tensor")
                                            else g).detach().clone()
    return out


def _error(fn: Any) -> str | None:
    """The message of what ``fn()`` raises (a RuntimeError or ValueError), None if nothing."""
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    rec: dict[str, Any] = {}
    try:
        x = _batches()[rank]
        # (c) the ranks' own solves differ; the plan is rank 0's on both
        plan = scheduler.solve(_net(), (x,), budget=BUDGET, solver=SOLVERS[rank], repeats=1)
        rec["schedule"] = plan.schedule.to_dict()
        rec["own"] = scheduler.solve_graph(plan.graph, BUDGET, solver=SOLVERS[rank]
                                           ).schedule.to_dict()
        rec["estimate"] = plan.estimate.to_dict()
        rec["simulated"] = simulate(plan.graph, plan.schedule).to_dict()
        rec["status"] = (plan.status, plan.schedule.status)

        # (a) DDP around the plan's module: one step
        ddp = DistributedDataParallel(plan.module)
        ddp(x).backward()
        rec["ddp"] = _full_grads(plan.module)

        # (b) FSDP2 at the root of a plan for a fresh copy
        model = _net()
        called = Program(scheduler.trace(model, (x,))).called_modules
        module = scheduler.apply(model, plan.schedule, (x,))
        fully_shard(module)
        rec["root_check"] = _error(lambda: check_wrapping(module, called))
        module(x).backward()
        rec["fsdp"] = _full_grads(module)

        # 4. per-block FSDP2: the step never calls the blocks, so their hooks never unshard
        model = _net()
        module = scheduler.apply(model, plan.schedule, (x,))
        for block in model.blocks:
            fully_shard(block)
        fully_shard(module)
        rec["block_check"] = _error(lambda: check_wrapping(module, called))
        rec["block_run"] = _error(lambda: module(x).backward())

        # 5. per-block FSDP2 with a units plan: fully_shard each unit of plan.module, then the
        # root (torchtitan's order), beside the same FSDP2 setup of the model without a plan
        uplan = scheduler.solve(_net(), (x,), budget=UNITS_BUDGET, units="auto", repeats=1)
        rec["units"] = uplan.units.paths
        for path in uplan.units.paths:
            fully_shard(uplan.module.get_submodule(path))
        fully_shard(uplan.module)
        uplan.module(x).backward()
        rec["units_fsdp"] = _full_grads(uplan.module)
        rec["units_counts"] = (units_plan(uplan.module).planned_calls,
                               units_plan(uplan.module).fallback_calls,
                               len(units_plan(uplan.module).forwards))
        plain = _net()
        for block in plain.blocks:
            fully_shard(block)
        fully_shard(plain)
        plain(x).backward()
        rec["plain_fsdp"] = _full_grads(plain)

        # 6. solving or applying to a wrapped model: one line, and the model trains after it
        # exactly as the same wrapping of an untouched model does
        for wrap in WRAPS:
            wrapped = _wrapped(_net(), wrap)
            rec[f"solve_{wrap}"] = _error(lambda: scheduler.solve(
                wrapped, (x,), budget=BUDGET, repeats=1))
            rec[f"apply_{wrap}"] = _error(lambda: scheduler.apply(wrapped, plan.schedule, (x,)))
            wrapped(x).backward()
            rec[f"after_{wrap}"] = _full_grads(wrapped)
            untouched = _wrapped(_net(), wrap)
            untouched(x).backward()
            rec[f"untouched_{wrap}"] = _full_grads(untouched)

        # a rank whose graph differs (another batch size) is named, on every rank
        rows = BATCH if rank == 0 else BATCH // 2
        rec["mismatch"] = _error(lambda: scheduler.solve(
            _net(), (x[:rows],), budget="100%", solver="none", repeats=1))
    except Exception:  # noqa: BLE001 - reported by the tests, with the rank's traceback
        rec["crash"] = traceback.format_exc()
    torch.save(rec, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


WRAPS = ("ddp", "fsdp_root", "fsdp_blocks")


def _wrapped(model: Net, wrap: str) -> nn.Module:
    if wrap == "ddp":
        return DistributedDataParallel(model)
    if wrap == "fsdp_blocks":
        for block in model.blocks:
            fully_shard(block)
    fully_shard(model)
    return model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each rank of one 2-process gloo run recorded (see `_worker`)."""
    out = tmp_path_factory.mktemp("ranks")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    recs = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r, rec in enumerate(recs):
        assert "crash" not in rec, f"rank {r} crashed:\n{rec['crash']}"
    return recs


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """The unmodified model's gradients on the concatenation of both ranks' batches."""
    model = _net()
    model(_batches().reshape(WORLD * BATCH, DIM)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_every_rank_runs_rank_0s_schedule(ranks: list[dict[str, Any]]) -> None:
    regions = [rec["schedule"]["regions"] for rec in ranks]
    own = [rec["own"]["regions"] for rec in ranks]
    assert own[0] != own[1], "the ranks' own solves must differ for this test to mean anything"
    assert regions[0] == own[0] and regions[1] == own[0]
    assert any(r["policy"] == "recompute" for r in regions[0])
    # rank 1's estimate is rank 0's schedule simulated on rank 1's own profile
    assert ranks[1]["estimate"] == ranks[1]["simulated"]
    assert ranks[1]["status"][0] == ranks[0]["status"][1]


def test_ddp_gradients_are_the_concatenated_batch_gradients(
        ranks: list[dict[str, Any]], reference: dict[str, torch.Tensor]) -> None:
    for rec in ranks:
        assert set(rec["ddp"]) == set(reference)
        for name, ref in reference.items():
            torch.testing.assert_close(rec["ddp"][name], ref, msg=lambda m, n=name: f"{n}: {m}")


def test_fsdp2_at_the_root_gives_the_concatenated_batch_gradients(
        ranks: list[dict[str, Any]], reference: dict[str, torch.Tensor]) -> None:
    for rec in ranks:
        assert rec["root_check"] is None
        assert set(rec["fsdp"]) == set(reference)
        for name, ref in reference.items():
            if name in DIRECT:
                continue  # see the next test
            torch.testing.assert_close(rec["fsdp"][name], ref, msg=lambda m, n=name: f"{n}: {m}")


def test_fsdp2_at_the_root_reaches_parameters_read_directly(
        ranks: list[dict[str, Any]], reference: dict[str, torch.Tensor]) -> None:
    for rec in ranks:
        for name in DIRECT:
            assert rec["fsdp"][name] is not None, f"{name} got no gradient"
            torch.testing.assert_close(rec["fsdp"][name], reference[name])


def test_per_block_fsdp2_is_refused_naming_the_block(ranks: list[dict[str, Any]]) -> None:
    for rec in ranks:
        msg = rec["block_check"]
        assert msg is not None and "UnsupportedWrappingError" in msg
        assert "submodule 'blocks.0' (Block) is wrapped by FSDP2" in msg and "fully_shard(plan.module)" in msg
        # the plan's own forward refuses it the same way, before any op meets a DTensor
        run = rec["block_run"]
        assert run is not None and run.startswith("UnsupportedWrappingError"), run
        assert "submodule 'blocks.0' (Block) is wrapped by FSDP2" in run


def test_per_block_fsdp2_runs_a_units_plan(ranks: list[dict[str, Any]]) -> None:
    """`fully_shard` on each unit of a units plan's module, then the root: the plan's units
    run (counted, no fallback) and the gradients equal the same FSDP2 setup of the model
    without a plan, bit for bit."""
    for rec in ranks:
        assert rec["units"] == ("blocks.0", "blocks.1", "blocks.2")
        planned, fallback, units = rec["units_counts"]
        assert units >= 1 and planned == units and fallback == 0
        assert set(rec["units_fsdp"]) == set(rec["plain_fsdp"])
        for name, want in rec["plain_fsdp"].items():
            assert torch.equal(rec["units_fsdp"][name], want), name


@pytest.mark.parametrize("wrap", WRAPS)
def test_a_wrapped_model_is_refused_in_one_line_and_left_untouched(
        ranks: list[dict[str, Any]], wrap: str) -> None:
    """`solve` and `apply` on a model wrapped by DDP or FSDP2 (root, or each block then the
    root) raise one line naming the wrapper and the way out, before touching the model: its
    next step's gradients equal those of the same wrapping of a model never passed to them."""
    kind = "DistributedDataParallel" if wrap == "ddp" else "FSDP2's fully_shard"
    for rec in ranks:
        for action in ("solve", "apply"):
            msg = rec[f"{action}_{wrap}"]
            assert msg is not None and msg.startswith(f"UnsupportedWrappingError: scheduler."
                                                      f"{action}: the model itself"), msg
            assert kind in msg and "plan the model before wrapping it" in msg
            assert "\n" not in msg
        after, want = rec[f"after_{wrap}"], rec[f"untouched_{wrap}"]
        assert set(after) == set(want)
        for name, g in want.items():
            assert torch.equal(after[name], g), name


def test_a_rank_whose_graph_differs_is_named_on_every_rank(
        ranks: list[dict[str, Any]]) -> None:
    for r, rec in enumerate(ranks):
        msg = rec["mismatch"]
        assert msg is not None and msg.startswith("ScheduleError")
        assert "rank(s) 1 " in msg and f"this is rank {r}" in msg and "fingerprint" in msg


# ------------------------------------------------------------------ single process


def test_same_schedule_without_distributed_returns_the_schedule(recorded_graph: Any) -> None:
    assert not dist.is_initialized()
    graph = recorded_graph(RECORDED_GRAPHS[0][0])
    schedule = Schedule.none(graph)
    assert same_schedule(schedule) is schedule
    assert same_schedule(schedule, graph=graph) is schedule


class ExportOnly(Net):
    """`Net` with a Python branch on a shape: symbolic tracing cannot follow it, so the graph
    comes from torch.export, where every parameter is a ``get_attr`` of the graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 0:
            x = x + 0
        return super().forward(x)


@pytest.mark.parametrize("cls,tracer", [(Net, "fx"), (ExportOnly, "export")])
def test_program_reads_attributes_swapped_into_its_root(cls: type[Net], tracer: str) -> None:
    """A parameter replaced by setattr on the root (as FSDP2 does before forward) is the one
    the next run reads, and the one that gets the gradient."""
    torch.manual_seed(0)
    model = cls().train()
    x = _batches()[0][:8]
    gm = scheduler.trace(model, (x,))
    assert gm.meta["scheduler"].tracer == tracer
    prog = Program(gm, root=model)
    old = model.scale
    model.scale = nn.Parameter(torch.full((DIM,), 3.0))  # what FSDP2 does
    loss = prog.run((x,))[1]
    loss.backward()
    with torch.no_grad():
        ref = model(x)  # the model's own forward, which reads the new parameter
    # fx runs the user's modules (bit-for-bit); export runs ATen ops (default tolerance)
    exact = {"rtol": 0, "atol": 0} if tracer == "fx" else {}
    torch.testing.assert_close(loss.detach(), ref, **exact)
    assert model.scale.grad is not None and old.grad is None
    # without a root, the graph's own attribute paths are read: they keep the old parameter
    attrs = Program(gm).attrs
    assert [attrs[k] is old for k in attrs if k.endswith("scale")] == [True]


def _hooked(where: str | None, kind: str = "forward_pre") -> tuple[Net, list[str]]:
    """A fresh `Net` with a hook added on ``where`` (none for None) after tracing it, and the
    modules its traced step calls."""
    model = _net()
    called = Program(scheduler.trace(model, (_batches()[0][:8],))).called_modules
    if where is None:
        return model, called
    target = model.get_submodule(where)
    if kind == "forward_pre":
        target.register_forward_pre_hook(lambda m, a: None)
    else:
        target.register_full_backward_hook(lambda m, gi, go: None)
    return model, called


def test_called_modules_are_the_leaf_modules() -> None:
    _, called = _hooked(None)
    assert "blocks.0.fc1" in called and "blocks.0.norm" in called
    assert "blocks.0" not in called and "blocks" not in called


@pytest.mark.parametrize("where,kind,what", [("blocks.0", "forward_pre", "forward pre-hooks"),
                                             ("blocks.2", "backward", "backward hooks")])
def test_check_wrapping_names_a_hooked_bypassed_module(where: str, kind: str, what: str) -> None:
    model, called = _hooked(where, kind)
    with pytest.raises(UnsupportedWrappingError) as info:
        check_wrapping(model, called)
    msg = str(info.value)
    assert f"submodule {where!r} (Block) has {what}" in msg
    assert "register them on plan.module" in msg


@pytest.mark.parametrize("where", ["", "blocks.0.fc1"])
def test_check_wrapping_accepts_hooks_that_run(where: str) -> None:
    """Hooks on the root (the user calls it) or on a module the step calls do run."""
    model, called = _hooked(where)
    check_wrapping(model, called)


def test_check_wrapping_accepts_the_hooks_it_is_told_are_known() -> None:
    model, called = _hooked("blocks.1")
    known = hook_ids(model)
    assert len(known) == 1
    check_wrapping(model, called, known=known)
    model.blocks[1].register_forward_hook(lambda m, a, o: None)
    with pytest.raises(UnsupportedWrappingError, match="'blocks.1' .* has forward hooks"):
        check_wrapping(model, called, known=known)


def test_check_wrapping_with_an_exported_graph_refuses_any_hooked_submodule() -> None:
    """A torch.export graph calls no module: even a leaf's hooks would not run."""
    model, _ = _hooked("blocks.0.fc1")
    with pytest.raises(UnsupportedWrappingError, match="'blocks.0.fc1'"):
        check_wrapping(model, [])


def test_check_wrapping_accepts_a_plain_model() -> None:
    model, called = _hooked(None)
    check_wrapping(model, called)
    check_wrapping(model, [])
