"""Autocast's cache of parameter casts in a recorded step: found, and moved into the base.

Under autocast, the casts of parameters (leaf tensors that require grad) live in autocast's
cache from their first use until the outermost ``torch.autocast`` exits, whatever holds them or
lets go of them: a checkpoint that drops its region's activations does not drop them, and its
replay finds them there and allocates nothing. The step is recorded from an empty cache (so
that every cast is seen: `record.Recorder.run`), and the storages that clearing the cache frees
after it (`clear_cached`) are taken out of the events into the base (``buffer_bytes``,
``meta["autocast_cache"]``: `cache_meta`): held through the step, as in a training loop's
steady state under one ``autocast`` block, where the casts of the step before are still cached
when a step begins. A node that saved such a cast saves it from the base (`saved_from_base`),
named after the parameter it is a cast of (`cast_source`).

The code a plan runs (`regions.CheckpointedStep`: the whole model's forward, or a unit's; a
unit the plan keeps whole, `units.own.Uncached`) runs with the cache off (`cache_off`), and
the profile records those nodes so too (`program.Program.run`): a cast there is an ordinary tensor, freed with its region's
activations when a checkpoint drops them and made again by the replay, so checkpointing frees
the casts as it frees everything else. Only the casts the model's own code makes outside the
planned code (between units, the loss) are cached and held in the base. What it costs: a
parameter used at several places in the planned code is cast at each (and its gradient summed
in float32, not in the low precision), and a replay casts its region's weights again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

import torch

from ..ir.graph import Saved
from ..measurement.storage import StorageTracker

__all__ = ["cache_meta", "cache_off", "caches_casts", "cast_source", "clear_cached",
           "mark_without_cached", "saved_from_base", "without_cached"]


def caches_casts() -> bool:
    """Whether autocast is on (on the CPU or CUDA) with its cache of parameter casts on."""
    return torch.is_autocast_cache_enabled() and (
        torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"))


@contextlib.contextmanager
def cache_off() -> Iterator[None]:
    """Autocast's cache of parameter casts off inside (where `caches_casts`), on again after:
    the casts made inside are neither looked up in the cache nor put there. A checkpoint
    entered inside records the cache as off, and its replay runs so too."""
    if not caches_casts():
        yield
        return
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(True)


def cast_source(t: torch.Tensor, name_of: Callable[[torch.Tensor], str | None]) -> str | None:
    """The name (``name_of`` the leaf: a parameter, buffer or input) that ``t`` is a cast or a
    view of a cast of, found through its autograd history; None if it is not one."""
    fn = t.grad_fn
    for _ in range(4):
        if fn is None:
            return None
        var = getattr(fn, "variable", None)  # (an AccumulateGrad)
        if var is not None:
            return name_of(var)
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return None
        fn = nxt[0]
    return None


def clear_cached(tracker: StorageTracker, recorded: Mapping[int, int]) -> set[int]:
    """Clear autocast's cache after the step and return the recorded storages that died with
    it (``recorded``: storage key -> storage id, those still alive): the ones only the cache
    held. The tracker's callbacks are off afterwards (the step is over)."""
    died: list[int] = []
    tracker.on_alloc, tracker.on_free = None, lambda key, _nbytes: died.append(key)
    torch.clear_autocast_cache()
    tracker.on_alloc = tracker.on_free = None
    return {recorded[k] for k in died if k in recorded}


def without_cached(events: list[tuple[str, int]],
                   cached: Collection[int]) -> list[tuple[str, int]]:
    """A node's forward events less those of the ``cached`` storages."""
    return [e for e in events if e[1] not in cached]


def mark_without_cached(events: list[tuple[str, int]], mark: int | None,
                        cached: Collection[int]) -> int | None:
    """A node's pack mark (how many of its forward ``events`` came before its last
    saved-tensor pack) less the events of ``cached`` storages before it."""
    if mark is None:
        return None
    return mark - sum(1 for e in events[:mark] if e[1] in cached)


def saved_from_base(saved: Iterable[Saved], cached: Collection[int],
                    cast_of: Mapping[int, str]) -> tuple[Saved, ...]:
    """What a node saved for backward, each ``cached`` cast saved from the base instead,
    named after the parameter it is a cast of (``cast_of``: storage id -> name)."""
    out = []
    for s in saved:
        if s.storage in cached:
            source = cast_of.get(s.storage) or "param:?"
            s = Saved(f"{source} (autocast cast)", None, s.bytes)
        out.append(s)
    return tuple(out)


def cache_meta(storages: Mapping[int, Mapping[str, Any]],
               cached: Collection[int]) -> tuple[int, dict[str, Any]]:
    """The bytes of the ``cached`` storages (added to the base) and the graph's
    ``meta["autocast_cache"]`` entry for them (empty when there are none)."""
    nbytes = sum(storages[sid]["bytes"] for sid in cached)
    return nbytes, ({"autocast_cache": {"bytes": nbytes, "storages": len(cached)}}
                    if cached else {})
