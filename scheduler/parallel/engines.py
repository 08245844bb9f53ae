"""The data-parallel configurations a plan is solved for (`DDP`, `FSDP2`), the parameters
they move (`Param`), and the forms users write them in (`parse_parallel`). Torch-free."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["DDP", "DTYPE_BYTES", "FSDP2", "OPTIMIZER_STATES", "Param", "ParallelError",
           "Parallel", "check_optimizer", "optimizer_bytes", "parse_parallel"]


class ParallelError(ValueError):
    """A parallel configuration that is malformed, or that the profiled step cannot be
    planned for (the message names the value and the way out)."""


@dataclass(frozen=True)
class Param:
    """One parameter: ``rows`` (its dim 0; 1 for a scalar), the elements of one row, bytes per
    element, and whether it gets a gradient."""

    rows: int
    row_numel: int
    itemsize: int
    trainable: bool = True

    @property
    def bytes(self) -> int:
        return self.rows * self.row_numel * self.itemsize

    def shard_bytes(self, world: int) -> int:
        """Bytes of one rank's padded shard (FSDP2: dim 0 chunked, every chunk padded to the
        first one's size)."""
        return math.ceil(self.rows / world) * self.row_numel * self.itemsize


#: optimizers whose state ``optimizer=`` counts, per trainable parameter: tensors like it, and
#: bytes of scalars (Adam's ``step``, float32)
OPTIMIZER_STATES = {"adamw": (2, 4), "adam": (2, 4), "sgd-momentum": (1, 0), "sgd": (0, 0)}

#: the floating dtypes `FSDP2`'s ``param_dtype`` and ``reduce_dtype`` take, by the names
#: ``torch`` gives them (``str(torch.bfloat16)`` less ``"torch."``), and their bytes
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
               "float64": 8, "double": 8}


def check_optimizer(cls: str, optimizer: str | None) -> None:
    """Raise `ParallelError` unless ``optimizer`` is None or one of `OPTIMIZER_STATES`."""
    if optimizer is not None and optimizer not in OPTIMIZER_STATES:
        raise ParallelError(f"{cls}(optimizer={optimizer!r}): name one of "
                            f"{', '.join(OPTIMIZER_STATES)}, or None to leave optimizer state "
                            "out of the budget")


def optimizer_bytes(optimizer: str | None, groups: Mapping[str, Sequence[Param]],
                    size: Callable[[Param], int]) -> int:
    """The bytes of ``optimizer``'s state for the trainable parameters of ``groups``, each
    tensor like a parameter being ``size(param)`` bytes."""
    if not optimizer:
        return 0
    like, scalar = OPTIMIZER_STATES[optimizer]
    train = [p for ps in groups.values() for p in ps if p.trainable]
    return sum(like * size(p) + scalar for p in train)


@dataclass(frozen=True)
class DDP:
    """``DistributedDataParallel(plan.module, gradient_as_bucket_view=...)``; the world size
    does not change a rank's memory. ``optimizer``: count that optimizer's state (``"adamw"``:
    two tensors like each trainable parameter, as ``torch.optim.AdamW`` keeps) as held
    through the step, so that the budget can be the device's memory; None leaves it out."""

    gradient_as_bucket_view: bool = False
    optimizer: str | None = None

    def __post_init__(self) -> None:
        check_optimizer("DDP", self.optimizer)

    def describe(self) -> str:
        opt = f", {self.optimizer} state" if self.optimizer else ""
        return f"DDP (gradient_as_bucket_view={self.gradient_as_bucket_view}{opt})"


def _dtype_name(field: str, value: Any) -> str | None:
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ParallelError(f"FSDP2({field}={value!r}): a floating dtype, torch.bfloat16 or "
                            f"its name ({', '.join(DTYPE_BYTES)}), or None for the "
                            "parameters' own")
    return {"float": "float32", "half": "float16", "double": "float64"}.get(name, name)


@dataclass(frozen=True)
class FSDP2:
    """``fully_shard`` on each unit of the plan's module, then on the root, over ``world``
    ranks (one shard group); backward prefetches one unit, as PyTorch does by default.

    ``backend``: ``"gloo"`` counts the scratch buffers of gloo's CPU collectives (an
    all-gather's output-size buffer, a reduce-scatter's copy of its input) and of CPU
    ``chunk_cat`` (a padded copy of each gradient whose rows the world does not divide);
    ``"nccl"`` allocates none of them through PyTorch. ``optimizer``: count that optimizer's
    state, sharded like the parameters (see `DDP`).

    ``reshard_after_forward``: what each unit is ``fully_shard``-ed with. True (FSDP2's
    default): a unit frees its gathered parameters after its forward and gathers them again
    in backward. False: they stay from the unit's forward to the end of its backward, and
    backward gathers nothing. An integer (resharding to a smaller group after forward) is not
    modelled. The root never reshards after forward (FSDP2's default for it).

    ``param_dtype``, ``reduce_dtype``: the ``MixedPrecisionPolicy`` of every unit and of the
    root (a ``torch`` dtype or its name, ``"bfloat16"``; None: no policy, the parameters'
    own dtype). The parameters gather in ``param_dtype`` and their gradients reduce in
    ``reduce_dtype``; the shards and the sharded gradients keep the parameters' dtype.
    `scheduler.solve` then profiles a copy of the model cast to ``param_dtype``."""

    world: int
    backend: str = "nccl"
    optimizer: str | None = None
    reshard_after_forward: bool = True
    param_dtype: str | None = None
    reduce_dtype: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.world, bool) or not isinstance(self.world, int) or self.world < 1:
            raise ParallelError(f"FSDP2(world={self.world!r}): the world size is the number of "
                                "ranks sharing the parameters, an integer >= 1")
        if self.backend not in ("gloo", "nccl"):
            raise ParallelError(f"FSDP2(backend={self.backend!r}): 'nccl' (GPUs) or 'gloo' "
                                "(CPU)")
        if not isinstance(self.reshard_after_forward, bool):
            raise ParallelError(
                f"FSDP2(reshard_after_forward={self.reshard_after_forward!r}): only True "
                "(FSDP2's default) and False are modelled, not an integer (resharding to a "
                "smaller group): solve and wrap with True or False")
        check_optimizer("FSDP2", self.optimizer)
        object.__setattr__(self, "param_dtype", _dtype_name("param_dtype", self.param_dtype))
        object.__setattr__(self, "reduce_dtype",
                           _dtype_name("reduce_dtype", self.reduce_dtype))

    def describe(self) -> str:
        opts = [self.backend, *([f"{self.optimizer} state"] if self.optimizer else []),
                *([] if self.reshard_after_forward else ["reshard_after_forward=False"]),
                *([f"param_dtype={self.param_dtype}"] if self.param_dtype else []),
                *([f"reduce_dtype={self.reduce_dtype}"] if self.reduce_dtype else [])]
        return f"FSDP2 over {self.world} ranks ({', '.join(opts)})"


Parallel = DDP | FSDP2


def parse_parallel(spec: Any, world: int | None = None, backend: str = "nccl"
                   ) -> Parallel | None:
    """A parallel configuration from what users write: None; a `DDP` or `FSDP2`; ``"ddp"``;
    ``"fsdp2"`` (over ``world`` ranks: the initialised process group's size) or
    ``"fsdp2:8"``, over ``backend``; ``+adamw`` (any of `OPTIMIZER_STATES`) counts that
    optimizer's state: ``"fsdp2:8+adamw"``."""
    if spec is None or isinstance(spec, (DDP, FSDP2)):
        return spec
    if isinstance(spec, str):
        text, _, opt = spec.strip().lower().partition("+")
        kind, _, n = text.partition(":")
        if kind == "ddp" and not n:
            return DDP(optimizer=opt or None)
        if kind == "fsdp2":
            if n and (not n.isdigit() or int(n) < 1):
                raise ParallelError(f"parallel={spec!r}: the world size after 'fsdp2:' must "
                                    "be an integer >= 1, e.g. 'fsdp2:8'")
            if not n and world is None:
                raise ParallelError(f"parallel={spec!r} needs the world size: write "
                                    "'fsdp2:8', pass FSDP2(world=8), or initialise "
                                    "torch.distributed first")
            return FSDP2(int(n) if n else world, backend, optimizer=opt or None)
    raise ParallelError(f"parallel={spec!r} is not understood: pass 'ddp', 'fsdp2', "
                        "'fsdp2:<world>' (each with '+adamw' to count its state), "
                        "scheduler.parallel.DDP(...) or FSDP2(world=...)")
