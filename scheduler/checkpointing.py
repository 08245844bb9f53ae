"""The module that runs one recompute region: `CheckpointRegion` calls the region's nodes (an
``fx.GraphModule`` body) under ``torch.utils.checkpoint.checkpoint(use_reentrant=False,
preserve_rng_state=True)``, with `save_policy` as the selective-checkpoint policy of a region
with a save set. `executor.generate` builds the bodies; `capture.timing.checkpoint_costs` times
this same module, so that what a checkpoint costs is measured on the code that runs.

Eager-only bookkeeping, skipped when ``torch.compiler.is_compiling()``: after a save-set node
(`run_saved`) the replay resets the RNG to where forward left it (the replay skips the node, so
it draws no random numbers there, and a later dropout must draw forward's mask); buffers a
region mutates (BatchNorm running statistics) are restored after its replay, so they are updated
once per step; buffers the replay left as they were are not written (a restore bumps their
version counter).
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx import traceback as fx_traceback
from torch.utils import _python_dispatch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
    checkpoint,
    create_selective_checkpoint_contexts,
    get_device_states,
    set_device_states,
)
from torch.utils.flop_counter import flop_registry

__all__ = ["ALL_OPS", "FLOP_OPS", "SAVE_KEY", "CheckpointRegion", "EagerCall", "run_saved",
           "run_saved_method", "save_policy"]

#: Key of the ``torch.fx.traceback`` annotation that marks a save-set node's ops; its value
#: says which of them are saved: `ALL_OPS` or `FLOP_OPS`.
SAVE_KEY = "scheduler_save"
#: every op of the node is saved
ALL_OPS = "all"
#: under ``torch.compile``, only its ops with FLOPs (``torch.utils.flop_counter``'s registry:
#: matmuls, convolutions, attention) are saved, the rest recomputed from them and the node's
#: inputs; eagerly, every op (`compiled_form` marks only nodes whose inputs backward has
#: without replaying an op with FLOPs)
FLOP_OPS = "flops"


# -- save sets -----------------------------------------------------------------------------
class EagerCall:
    """One eager forward of a region and its backward replay: which call this is, the
    region's inputs, and the RNG state forward left after each save-set node."""

    def __init__(self, vals: tuple[Any, ...], random: bool = True) -> None:
        self.n = 0
        self.vals = vals
        self.random = random  # (a region that draws no random numbers keeps no RNG state)
        self.rng: dict[str, tuple[Any, ...]] = {}


def run_saved(call: EagerCall | None, key: str, ops: str, fn: Any, /, *args: Any,
              **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with its ops marked for saving (``call`` None: compiled):
    ``ops`` is `ALL_OPS` or `FLOP_OPS` (see `save_policy`)."""
    with fx_traceback.annotate({SAVE_KEY: ops}):
        out = fn(*args, **kwargs)
    if call is not None and call.random:
        if call.n > 1:
            _set_rng(call.rng[key])
        else:
            call.rng[key] = _get_rng(call.vals)
    return out


def run_saved_method(call: EagerCall | None, key: str, ops: str, name: str, obj: Any, /,
                     *args: Any, **kwargs: Any) -> Any:
    return run_saved(call, key, ops, getattr(obj, name), *args, **kwargs)


@functools.lru_cache(maxsize=None)
def _is_view(op: Any) -> bool:
    """Whether an ATen op only returns aliases of its inputs without mutating them."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return False
    return not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)


def save_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective-checkpoint policy of every region with a save set.

    Ops of a save-set node that allocate their outputs are MUST_SAVE (cached in forward, not
    run by the replay), and so are its in-place ops (dropout's ``bernoulli_`` mutates a tensor
    it just allocated: replaying it on the cached tensor would apply it twice). Its pure view
    ops are recomputed: caching a view would pin its base (often the node's input) until the
    replay, and a view costs nothing to redo. Every op of other nodes is recomputed. Under
    ``torch.compile``, a node marked `FLOP_OPS` saves only its ops with FLOPs: its other ops
    fuse into backward's kernels, where recomputing them spares writing their outputs in
    forward and reading them back (`cost.compiled_form`).
    """
    custom = fx_traceback.current_meta.get("custom")
    mark = custom.get(SAVE_KEY) if custom else None
    if mark and not _is_view(op):
        if mark == FLOP_OPS and torch.compiler.is_compiling() \
                and getattr(op, "overloadpacket", None) not in flop_registry:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_SAVE_CONTEXT = functools.partial(create_selective_checkpoint_contexts, save_policy,
                                  allow_cache_entry_mutation=True)


# -- save sets under autocast --------------------------------------------------------------
# Autocast caches the cast of a parameter (a leaf that requires grad) until the outermost
# ``torch.autocast`` exits, and a cast it finds there is not dispatched at all. So forward and
# the replay of a region need not dispatch the same casts: forward casts a weight the cache did
# not hold, the replay (inside the same autocast block) finds it cached, or the other way
# round (forward found the cast a former region or step made; a replay in backward outside the
# block enters an autocast of its own, with an empty cache). Selective checkpointing matches
# the replay's ops to forward's by op and count, so one cast missing shifts every later cast:
# the replay would be handed the wrong saved tensor. Under autocast, a save set's region
# therefore leaves parameter casts out of that matching (as torch leaves out ``detach``): they
# run wherever they are dispatched, in forward and in the replay, and are never saved. A plan
# runs its code with the cache off (`capture.autocast_cache.cache_off`), where forward and the
# replay both dispatch every cast; the exclusion also covers a step run under another state.
_TO_COPY = torch.ops.aten._to_copy.default


def _param_cast(func: Any, args: tuple[Any, ...]) -> bool:
    """Whether ``func(*args)`` is a cast of a parameter: the only ops whose dispatch depends
    on autocast's cache (which holds the casts of leaves that require grad)."""
    if func is not _TO_COPY or not args:
        return False
    t = args[0]
    return isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf


class _SaveForward(_CachingTorchDispatchMode):
    """Selective checkpointing's forward mode, with parameter casts left out (`_param_cast`)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if _param_cast(func, args):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _SaveReplay(_CachedTorchDispatchMode):
    """Selective checkpointing's replay mode, with parameter casts left out (`_param_cast`):
    they are cast again where autocast's cache does not hold them."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if _param_cast(func, args):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _autocast_save_context() -> tuple[Any, Any]:
    """``context_fn`` of a region with a save set that runs eagerly under autocast."""
    storage: dict[Any, dict[int, Any]] = collections.defaultdict(dict)
    return (_SaveForward(save_policy, storage),
            _SaveReplay(save_policy, storage, allow_cache_entry_mutation=True))


def _get_rng(vals: tuple[Any, ...]) -> tuple[Any, ...]:
    # the states checkpoint(preserve_rng_state=True) itself stashes: CPU, and the devices of
    # the region's tensor inputs once CUDA is initialised
    with _python_dispatch._disable_current_modes():
        devices = get_device_states(*vals) if torch.cuda.is_initialized() else ([], [])
        return torch.get_rng_state(), *devices


def _rng_now() -> list[torch.Tensor]:
    # the CPU generator's state, and the CUDA generators' once CUDA is up
    with _python_dispatch._disable_current_modes():
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
        return [torch.get_rng_state(), *cuda]


def _set_rng(state: tuple[Any, ...]) -> None:
    cpu, devices, device_states = state
    with _python_dispatch._disable_current_modes():
        torch.set_rng_state(cpu)
        set_device_states(devices, device_states)


# -- the region module ---------------------------------------------------------------------
class CheckpointRegion(nn.Module):
    """A recompute region: called with its inputs and then its attributes, it runs
    ``checkpoint(partial(body, call, attributes), *inputs)``.

    Args:
        body: an ``fx.GraphModule`` of the region's nodes, ``body(call, attributes, *inputs)``;
            ``call`` is the eager call state (None when compiled).
        n_inputs: how many of the values it is called with are inputs (the rest: attributes).
        has_save: whether the region has a save set (then `save_policy` applies).
        buffer_modules: the called submodules whose buffers the region may mutate.
        buffer_args: positions, among the attributes, of those that are buffers.
        random: whether its nodes may draw random numbers (`capture.randomness`): only then
            does the checkpoint stash the RNG state for the replay (5,056 bytes on a CPU).
            A region judged not to is checked on its first eager call: if it moved the CPU
            RNG, it raises rather than replay with other random numbers.
    """

    def __init__(self, body: fx.GraphModule, n_inputs: int, has_save: bool,
                 buffer_modules: tuple[nn.Module, ...], buffer_args: tuple[int, ...],
                 random: bool = True):
        super().__init__()
        self.random = random
        self._checked = random
        self.n_inputs = n_inputs
        self.body = body
        self.has_save = has_save
        self.buffer_modules = buffer_modules  # (a tuple: the user's modules, not registered)
        self.buffer_args = buffer_args

    def forward(self, *vals: Any) -> tuple[Any, ...]:
        # the attributes reach the body bound, not as checkpoint inputs: checkpoint would
        # save those and refuse a buffer the region itself writes (a counter's ``add_``)
        inputs, attrs = vals[:self.n_inputs], vals[self.n_inputs:]
        # (compiled, checkpoint accepts only a context_fn of selective checkpointing)
        kw = {"context_fn": _SAVE_CONTEXT} if self.has_save else {}
        if torch.compiler.is_compiling():
            return checkpoint(functools.partial(self.body, None, attrs), *inputs,
                              use_reentrant=False, preserve_rng_state=self.random, **kw)
        if self.has_save and any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")):
            kw = {"context_fn": _autocast_save_context}
        # (the call state keeps the inputs only for a save set's RNG states: a nested region's
        # inputs must die when its parent's checkpoint lets go of them)
        call = EagerCall(inputs if self.has_save and self.random else (), self.random)
        before = None if self._checked else _rng_now()
        out = checkpoint(functools.partial(self._eager_body, call, attrs), *inputs,
                         use_reentrant=False, preserve_rng_state=self.random, **kw)
        if before is not None:
            if not all(torch.equal(a, b) for a, b in zip(before, _rng_now())):
                raise RuntimeError(
                    f"a recompute region judged to draw no random numbers moved the RNG "
                    f"(nodes {list(self.body.graph.nodes)[2:5]} ...): its replay would draw "
                    f"other numbers than forward did. This is a bug in scheduler's "
                    f"capture.randomness; please report it with the model. Meanwhile solve "
                    f"with solver='none' or the region's random op outside any region")
            self._checked = True
        return out

    def _eager_body(self, call: EagerCall, attrs: tuple[Any, ...], *inputs: Any
                    ) -> tuple[Any, ...]:
        call.n += 1
        replay = call.n > 1
        buffers = self._buffers_now(attrs) if replay else []
        # (the body's ``forward``, not its module call: fx's call wrapper walks and formats the
        # traceback of every exception through it, and the replay ends by raising one when it
        # has recomputed what backward needs: about 0.2 ms a replay on a CPU)
        if not buffers:
            return self.body.forward(call, attrs, *inputs)
        # outside every dispatch mode: selective checkpointing expects the replay to run
        # exactly the ops forward ran, and these copies are not part of the model
        with _python_dispatch._disable_current_modes(), torch.no_grad():
            saved = [b.clone() for b in buffers]
        try:
            return self.body.forward(call, attrs, *inputs)
        finally:
            # only the buffers the replay wrote are put back: a ``copy_`` bumps a buffer's
            # version counter, and an op outside the region that saved a buffer the region
            # only read (a RoPE table shared by every block) would then refuse its backward.
            # By value, not by version: BatchNorm's kernels update running statistics
            # without bumping it
            with _python_dispatch._disable_current_modes(), torch.no_grad():
                for b, s in zip(buffers, saved):
                    if not torch.equal(b, s):
                        b.copy_(s)

    def _buffers_now(self, attrs: tuple[Any, ...]) -> list[torch.Tensor]:
        bufs = {id(b): b for m in self.buffer_modules for b in m.buffers()}
        bufs.update((id(attrs[i]), attrs[i]) for i in self.buffer_args)
        return list(bufs.values())
