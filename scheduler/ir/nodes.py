"""The parts of a `CostGraph`: its nodes, the tensors they save, the storages forward
allocates and the steps of backward. Frozen, torch-free records; bytes are integers, times
seconds."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BwdStep", "CostGraphError", "Node", "Saved", "Storage", "WrittenRead"]


class CostGraphError(ValueError):
    """A cost graph (or its JSON file) is malformed: the message names the field."""


@dataclass(frozen=True)
class Saved:
    """One tensor autograd saved for a node's backward.

    ``source`` is the node that produced it, or ``"param:<name>"``, ``"buffer:<name>"``,
    ``"input:<i>"`` for tensors that exist before the step; ``storage`` is the `Storage` id
    (``None`` for parameters, buffers and inputs); ``bytes`` the storage's size.
    """

    source: str
    storage: int | None
    bytes: int


@dataclass(frozen=True)
class Node:
    """One executed graph node."""

    name: str
    op: str  # call_module | call_function | call_method
    target: str
    inputs: tuple[str, ...]  # names of the nodes whose values it reads (compute nodes only)
    module_path: str = ""  # e.g. "transformer.h.3.attn"
    block: str = ""  # the repeated block it belongs to, e.g. "transformer.h.3"; "" if none
    is_loss: bool = False  # part of the loss, not of the model: always runs un-checkpointed
    time_s: float = 0.0  # forward time: median of the repeats, scaled so that all forward
    # and backward times add up to the measured unscheduled step (see profile)
    bwd_time_s: float = 0.0  # time of its backward functions, median of the repeats
    out_bytes: int = 0  # new storage its outputs allocate (views allocate 0)
    saved: tuple[Saved, ...] = ()
    shape: str = ""  # output shapes and dtypes, e.g. "f32[4,64,128]"; part of the fingerprint
    # how many of its forward events (`CostGraph.fwd_events`) happen before autograd packs the
    # last tensor it saves (saved inputs are packed before an op runs, saved outputs after):
    # where a replay that stops at this node stops. None: not recorded (see `replay_mark`)
    pack_mark: int | None = None
    # extra forward time when it runs under a selective-checkpoint policy (the dispatch mode
    # of `torch.utils.checkpoint.create_selective_checkpoint_contexts` sees every op), per
    # run, scaled like ``time_s``; a save-set region pays it in forward and in its replay.
    # None: not measured (counted as 0)
    sac_s: float | None = None
    # the share of its forward work in ops whose FLOPs ``torch.utils.flop_counter`` counts
    # (matmuls, convolutions, attention), weighed by their roofline time on the profile's
    # device, in [0, 1]: what a replay of it still costs under ``torch.compile``, where the
    # other ops fuse into their consumers' kernels (`cost.compiled`). None: not recorded
    flop_share: float | None = None

    @property
    def saved_bytes(self) -> int:
        return sum(s.bytes for s in self.saved)


@dataclass(frozen=True)
class Storage:
    """A storage allocated during forward by node ``producer``.

    ``output``: it backs (part of) the producer's output; otherwise it is internal to the op.
    ``inner_free``: the profile saw it freed before the producer finished (an op temporary).
    ``last_use``: the last node, in forward order, that reads it (directly or through a view);
    the producer itself when nothing later does.
    ``savers``: the nodes whose backward saved it.
    ``views``: later nodes whose outputs alias it (views, in-place results, getitem).
    """

    id: int
    bytes: int
    producer: str
    output: bool
    inner_free: bool
    last_use: str
    savers: tuple[str, ...] = ()
    views: tuple[str, ...] = ()


@dataclass(frozen=True)
class BwdStep:
    """A contiguous part of the backward pass that ran one node's backward functions.

    ``events`` are ``("a", grad_id, bytes)`` for a gradient storage allocated and ``("f",
    grad_id, 0)`` for one freed, in the order they happened. ``node`` is ``""`` for work before
    the first backward function (the seed gradient of the loss).
    """

    node: str
    time_s: float
    events: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True)
class WrittenRead:
    """Node ``reader`` reads ``value`` (a node, or ``input:<name>`` for an input of the step),
    whose storage node ``writer`` writes in place, last, at or after some position where a
    recompute region could start.

    A recompute region that holds ``reader`` but not ``value`` and starts at or before
    ``writer`` is refused by the rewriter (`regions.CheckpointedStep`): its backward replay
    would read the written value, not the one forward read. `ir.replays` turns these into
    where recompute regions may start and end. Buffers are not recorded: a replay restores
    the buffers it mutates."""

    reader: str
    value: str
    writer: str
