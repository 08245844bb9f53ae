"""Whether a units plan runs under the FSDP2 wrapping its memory was predicted for.

A plan's budget is per rank only for the wrapping it was solved for (`parallel`): solved for
one device (or DDP) and then ``fully_shard``-ed, or solved for FSDP2 and wrapped otherwise
(another world size, units left unsharded, a ``MixedPrecisionPolicy`` or
``reshard_after_forward`` other than solved for), its peak is not what was
predicted. `EngineCheck`, a forward pre-hook of the planned module, says so once, at the first
training call under ``fully_shard``: the plan still computes the model's values, but its
memory is another's.
(DDP wraps the module from outside, where no hook of ours sees it.)
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch
import torch.nn as nn

from ..distributed import fsdp_module_type

__all__ = ["EngineCheck", "engine_mismatch"]


class EngineCheck:
    """A forward pre-hook of a units plan's module: warn once (RuntimeWarning) when
    `engine_mismatch` finds the wrapping is not the one solved for."""

    def __init__(self, paths: tuple[str, ...], solved_for: str | None):
        self.paths, self.solved_for, self.done = paths, solved_for, False

    def __call__(self, module: nn.Module, args: Any) -> None:
        if (self.done or torch.compiler.is_compiling()
                or not (torch.is_grad_enabled() and module.training)):
            return
        fsdp = fsdp_module_type()
        if fsdp is None or not any(isinstance(m, fsdp) for m in (
                module, *(module.get_submodule(p) for p in self.paths))):
            return  # (unwrapped: look again at the next call, which may be wrapped)
        self.done = True
        why = engine_mismatch(module, self.paths, self.solved_for)
        if why is not None:
            warnings.warn(f"{why}: the plan's predicted peak is not this rank's. Solve with "
                          "the wrapping you train with (docs/distributed.md)", RuntimeWarning,
                          stacklevel=2)


def _name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def engine_mismatch(root: nn.Module, paths: tuple[str, ...], solved_for: str | None
                    ) -> str | None:
    """Why ``root``'s FSDP2 wrapping (of it and of its units at ``paths``) is not the one
    described by ``solved_for`` (`CostGraph.meta`'s ``"parallel"``, None: one device), or None
    when it is (or nothing is sharded: one device, or DDP, which no hook here sees)."""
    fsdp = fsdp_module_type()
    if fsdp is None:
        return None
    mods = [(p, root.get_submodule(p)) for p in paths] + [("", root)]
    sharded = [(p, m) for p, m in mods if isinstance(m, fsdp)]
    if not sharded:
        return None
    if solved_for is None or not solved_for.startswith("FSDP2"):
        return (f"plan.module is sharded by fully_shard, but the plan was solved for "
                f"{solved_for or 'one device'} (solve with parallel='fsdp2')")
    world = int(re.search(r"over (\d+) ranks", solved_for).group(1))
    reshard = "reshard_after_forward=False" not in solved_for
    solved_policy = tuple(m.group(1) if (m := re.search(rf"{k}=(\w+)", solved_for)) else None
                          for k in ("param_dtype", "reduce_dtype"))
    if solved_policy[1] == solved_policy[0]:
        solved_policy = (solved_policy[0], None)
    unsharded = [p for p, m in mods[:-1] if not isinstance(m, fsdp)]
    if unsharded or not isinstance(root, fsdp):
        return (f"the plan was solved for fully_shard on each unit and then the root, but "
                f"{repr(unsharded[0]) if unsharded else 'the root'} is not sharded")
    for path, m in sharded:
        try:
            group = m._get_fsdp_state()._fsdp_param_group
        except AttributeError:  # pragma: no cover - another FSDP2 version
            continue
        if group is None:
            continue
        where = repr(path) if path else "the root"
        policy = (_name(group.mp_policy.param_dtype), _name(group.mp_policy.reduce_dtype))
        if policy[1] == policy[0]:  # (FSDP2 reduces in param_dtype then)
            policy = (policy[0], None)
        if policy != solved_policy:
            return (f"{where} has MixedPrecisionPolicy(param_dtype={policy[0]}, reduce_dtype="
                    f"{policy[1]}); the plan was solved for param_dtype={solved_policy[0]}, "
                    f"reduce_dtype={solved_policy[1]} (FSDP2(..., param_dtype=..., "
                    "reduce_dtype=...))")
        if group.mesh_info.shard_mesh_size != world:
            return (f"{where} is sharded over {group.mesh_info.shard_mesh_size} ranks; the "
                    f"plan was solved for {world}")
        after = group.post_forward_mesh_info
        wrapped = True if after is group.mesh_info else False if after is None else "an integer"
        if path and wrapped != reshard:
            return (f"{where} is fully_shard-ed with reshard_after_forward={wrapped}; the plan "
                    f"was solved for {reshard} (FSDP2(..., reshard_after_forward=...))")
    return None
