"""Plans under ``torch.distributed``: one schedule on every rank, and wrappers a plan cannot honour.

Data-parallel training (DDP, FSDP2) runs the same step on every rank and matches collectives
by the order ranks reach them, so every rank must run the same schedule. Each rank profiles
its own step, though: measured times differ between ranks, and with them which of two
near-equal schedules a solver picks, or how far a time-limited search gets. `same_schedule`
makes rank 0's schedule everyone's (`scheduler.solve` calls it); a rank whose traced graph
differs from rank 0's (another model, other input shapes) is named in a `ScheduleError` raised
on every rank, rather than left to run a schedule made for another graph.

The traced step runs the ops of the model's inner modules itself: it calls as modules only
the graph's ``call_module`` targets (fx leaf modules such as ``nn.Linear``; none at all for a
graph captured by ``torch.export``). Hooks on any other submodule never run: FSDP2's
``fully_shard`` on a transformer block relies on that block's forward pre-hook to unshard its
parameters, and the step then meets sharded parameters (``mixed torch.Tensor and DTensor``).
`check_wrapping` finds such submodules and names them; ``fully_shard`` the plan's root module
only (``fully_shard(plan.module)``), whose hooks run because the user calls it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch.distributed as dist
import torch.nn as nn

from .ir.graph import CostGraph
from .ir.schedule import Schedule, ScheduleError
from .parallel import Param, ParallelError

__all__ = ["UnsupportedWrappingError", "check_unwrapped", "check_wrapping",
           "fsdp_module_type", "hook_ids", "param_groups", "process_group", "same_schedule"]


class UnsupportedWrappingError(RuntimeError):
    """A submodule carries a wrapper or hooks that the plan's traced step would not run; the
    message names the submodule and the way out."""


def same_schedule(schedule: Schedule, group: dist.ProcessGroup | None = None, *,
                  graph: CostGraph | None = None) -> Schedule:
    """Rank 0's ``schedule``, on every rank of ``group``.

    With ``torch.distributed`` initialised and more than one rank in ``group`` (default: the
    world), this is a collective: every rank must call it. Rank 0 of the group broadcasts its
    schedule (its JSON form, `Schedule.to_dict`) and gets its own object back; the other
    ranks get the schedule rebuilt from it. Otherwise ``schedule`` is returned as it is.

    Args:
        schedule: this rank's schedule (only rank 0's is used).
        group: the process group; None for the default one.
        graph: this rank's profiled graph. When given, every rank checks rank 0's schedule
            against its own graph and the ranks exchange the outcome, so that a mismatch on
            any rank raises on all of them (none is left waiting in a later collective).

    Raises:
        ScheduleError: rank 0's schedule does not fit the graph of one or more ranks; the
            message names them and says why.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return schedule
    rank = dist.get_rank(group)
    payload = [schedule.to_dict() if rank == 0 else None]
    dist.broadcast_object_list(payload, group=group, group_src=0)
    shared = schedule if rank == 0 else Schedule.from_dict(payload[0])
    if graph is None:
        return shared
    try:
        shared.validate(graph)
        problem = ""
    except ScheduleError as e:
        problem = str(e)
    problems: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    bad = [(r, p) for r, p in enumerate(problems) if p]
    if bad:
        ranks = ", ".join(str(r) for r, _ in bad)
        first_rank, first = bad[0]
        raise ScheduleError(
            f"rank 0's schedule does not fit the traced graph of rank(s) {ranks} (this is rank "
            f"{rank}); rank {first_rank}: {first}. Every rank must solve the same model with "
            f"the same input shapes (the same per-rank batch) for one schedule to serve all")
    return shared


def hook_ids(module: nn.Module) -> frozenset[int]:
    """The ids of every forward/backward (pre-)hook registered on ``module`` and its
    submodules now. Hooks present while the model was traced ran during tracing (their ops
    are in the graph); pass this snapshot, taken then, to `check_wrapping` as ``known``."""
    return frozenset(k for _, m in module.named_modules() for hooks in _hook_dicts(m)
                     for k in hooks)


def check_wrapping(module: nn.Module, called: Iterable[str] = (), *,
                   known: Iterable[int] = ()) -> None:
    """Refuse submodules of ``module`` whose wrappers or hooks the plan's traced step bypasses.

    A submodule is bypassed unless it is ``module`` itself (the user calls it), one of
    ``called`` or inside one of them (a called module runs its own forward, children
    included). A bypassed submodule must carry no FSDP2 state (``fully_shard``) and no
    forward/backward (pre-)hook other than those in ``known``.

    Args:
        module: the module a plan runs for (``plan.module``), after wrapping.
        called: qualified names, relative to ``module``, of the submodules the traced step
            calls as modules (`capture.program.Program.called_modules`).
        known: hook ids to accept (`hook_ids` of the model when it was traced).

    Raises:
        UnsupportedWrappingError: naming the first bypassed submodule that is wrapped or
            hooked, what it carries, and the way out.
    """
    called = set(called)
    known = set(known)
    fsdp_module = fsdp_module_type()
    for name, sub in _bypassed(module, called, ""):
        if fsdp_module is not None and isinstance(sub, fsdp_module):
            cls = next(c for c in type(sub).__mro__ if not issubclass(c, fsdp_module))
            raise UnsupportedWrappingError(
                f"submodule {name!r} ({cls.__name__}) is wrapped by FSDP2 "
                f"(fully_shard): its forward pre-hook unshards its parameters, but the plan's "
                f"traced step runs the ops inside {name!r} without calling it as a module, so "
                f"the hook never runs and the step would meet sharded parameters. "
                f"fully_shard the plan's root module only: fully_shard(plan.module), without "
                f"fully_shard on its submodules")
        kinds = [kind for kind, hooks in zip(_HOOK_KINDS, _hook_dicts(sub))
                 if any(k not in known for k in hooks)]
        if kinds:
            raise UnsupportedWrappingError(
                f"submodule {name!r} ({type(sub).__name__}) has {' and '.join(kinds)} that the "
                f"plan's traced step would never run: it runs the ops inside {name!r} without "
                f"calling it as a module. Remove them, register them on plan.module itself or "
                f"on a module the step calls, or register them before solving (hooks present "
                f"while tracing are traced into the graph)")


_HOOK_KINDS = ("forward pre-hooks", "forward hooks", "backward pre-hooks", "backward hooks")


def _hook_dicts(m: nn.Module) -> tuple[dict[int, object], ...]:
    return (m._forward_pre_hooks, m._forward_hooks, m._backward_pre_hooks, m._backward_hooks)


def _bypassed(module: nn.Module, called: set[str], prefix: str
              ) -> Iterator[tuple[str, nn.Module]]:
    """``(qualified name, submodule)`` of every submodule below ``module`` that is neither
    in ``called`` nor inside a called one, parents first."""
    for child_name, child in module.named_children():
        name = f"{prefix}{child_name}"
        if name in called:
            continue
        yield name, child
        yield from _bypassed(child, called, name + ".")


def fsdp_module_type() -> type | None:
    """FSDP2's module class, or None where ``torch.distributed`` is not built in."""
    if not dist.is_available():
        return None
    # (torch's own package, imported on the first check rather than with scheduler)
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def check_unwrapped(model: nn.Module, action: str) -> None:
    """Raise `UnsupportedWrappingError` (one line, naming the wrapper and where) when
    ``model`` is, or holds, a module wrapped for data-parallel training (DDP, FSDP, FSDP2's
    ``fully_shard``), before anything touches it: profiling such a model runs the wrapper's
    lazy initialisation and collectives on fake tensors or counts a rank's shards as the
    model, and a plan is made for the model itself. ``action`` names the call refused."""
    kinds: list[tuple[type, str]] = []
    if dist.is_available():
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.nn.parallel import DistributedDataParallel

        kinds = [(DistributedDataParallel, "DistributedDataParallel"),
                 (FullyShardedDataParallel, "FSDP"), (fsdp_module_type(), "FSDP2's fully_shard")]
    for path, m in model.named_modules():
        kind = next((name for cls, name in kinds if isinstance(m, cls)), None)
        if kind is not None:
            where = "the model itself" if not path else f"submodule {path!r}"
            raise UnsupportedWrappingError(
                f"scheduler.{action}: {where} ({type(m).__name__}) is wrapped by {kind}; "
                "plan the model before wrapping it, then wrap the plan's module: plan = "
                "scheduler.solve(model, ...), then DistributedDataParallel(plan.module), or "
                "fully_shard each of plan.units.paths in plan.module and then plan.module "
                "(docs/distributed.md). The model was not touched")


def param_groups(model: nn.Module, units: Iterable[str]) -> dict[str, tuple[Param, ...]]:
    """The parameters of each unit of ``model`` (by path) and of the root (``""``: those in no
    unit), each counted once, as `parallel.per_rank` reads them. Raises `ParallelError` for a
    parameter two units share (``fully_shard`` gives a parameter to one module only)."""
    owner: dict[int, str] = {}
    groups: dict[str, list[Param]] = {}
    for path in (*units, ""):
        groups[path] = []
        sub = model.get_submodule(path)
        for name, p in sub.named_parameters():
            if id(p) in owner:
                if path and owner[id(p)]:
                    raise ParallelError(
                        f"parameter {path}.{name} is shared by units {owner[id(p)]!r} and "
                        f"{path!r}: fully_shard gives a parameter to one module; plan with "
                        "units that do not share parameters (units=...)")
                continue
            owner[id(p)] = path
            rows = p.shape[0] if p.dim() else 1
            groups[path].append(Param(rows, p.numel() // max(rows, 1), p.element_size(),
                                      p.requires_grad))
    return {k: tuple(v) for k, v in groups.items()}


def process_group() -> tuple[int | None, str]:
    """The default process group's size and backend (``"gloo"``, ``"nccl"``), or ``(None,
    "nccl")`` where ``torch.distributed`` is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), "gloo" if dist.get_backend() == "gloo" else "nccl"
    return None, "nccl"
