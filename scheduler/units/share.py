"""One trace for identical units: a unit whose call runs the very ops a sibling's traced call
ran reuses that trace, with its own parameters, instead of exporting its own.

A planned model's units are mostly copies of one layer (a decoder's 32 layers), and tracing
one call (``torch.export`` at every size, `capture.shapes`) takes about a second on a small
layer, a dozen times per model when `step.warm_up` traces each unit for each call signature.
Structural equality of the modules is not enough to share it: Hugging Face layers differ by
``layer_idx``, which some read in ``forward`` (a sliding window on some layers, a cache slot),
so two layers of one class may run different ops.

What is compared is what ran: `record` runs the unit's call once, without gradients, under a
dispatch mode that writes down every aten op with its arguments: each tensor by where it came
from (the call's ``i``-th tensor input, the unit's parameter or buffer by its path, the
output of an earlier op), everything else by value; a tensor from anywhere else (an attribute
that is not a parameter or buffer, a global) by its identity, so that two units share a trace
only where they read the very same object. Two calls with the same record compute the same
function of their inputs and parameters, so the sibling's graph runs the call with the unit's
own parameters (`capture.program.Program`'s ``like``: attributes are read from the unit
where the sibling's were). Only units of one `kind` (the same classes, parameter and buffer
shapes, ``forward``, and no hooks below the unit but transformers' output capture) are
compared, and only calls of the same signature (`runtime.UnitForward`'s key). A unit whose
record differs traces for itself, and nothing is shared where the record cannot be made.

A record costs one forward of the unit without gradients (the user's dispatch modes do not
see it; buffers, gradients and RNG are restored), against an export per call.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..capture.autocast_cache import cache_off
from ..capture.program import Program
from ..capture.state import preserved_state
from ..capture.trace import trace
from ..capture.usercode import UserCodeWarning, is_library_hook

__all__ = ["ENABLED", "Record", "SharedTraces", "kind", "record"]

#: Whether plans made from now on share traces (a switch for benchmarks that time both)
ENABLED = True

#: what a unit's call ran: per aten op, its name, its arguments' structure and each leaf
Record = tuple[tuple[str, str, tuple[Any, ...]], ...]


def kind(unit: nn.Module, forward: Callable[..., Any]) -> tuple | None:
    """What two units must share to be compared at all: their module classes, parameter and
    buffer names, shapes and dtypes, and their ``forward`` function; None (never shared)
    where a module below the unit has hooks (they may do per module what a record does not
    show), but transformers' output capture (`capture.usercode.LIBRARY_HOOKS`, whose
    appends a trace returns and `lookup` compares), or ``forward`` is not a plain function
    or method."""
    func = getattr(forward, "__func__", forward)
    if not hasattr(func, "__code__"):
        return None
    mods = []
    for name, m in unit.named_modules():
        hooks = (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
        if name and not all(is_library_hook(h) for h in hooks):
            return None
        mods.append((name, type(m)))
    tensors = tuple((n, tuple(t.shape), t.dtype, type(t))
                    for n, t in (*unit.named_parameters(), *unit.named_buffers()))
    return (func, tuple(mods), tensors)


class _Recorder(TorchDispatchMode):
    """Writes down each aten op run under it (`record`). Tensors are known by identity,
    checked through a weak reference (an id a dead tensor had may come back), so that the
    record keeps nothing alive: the forward frees as it would without it."""

    def __init__(self, known: list[tuple[torch.Tensor, Any]]):
        super().__init__()
        self.labels: dict[int, tuple[Any, weakref.ref]] = {}
        self.kept: list[torch.Tensor] = []  # (objects from elsewhere: their ids stay theirs)
        for t, label in known:
            self._name(t, label)
        self.ops: list[tuple[str, str, tuple[Any, ...]]] = []

    def _name(self, t: torch.Tensor, label: Any) -> None:
        self.labels[id(t)] = (label, weakref.ref(t))

    def _label(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            got = self.labels.get(id(x))
            if got is None or got[1]() is not x:  # (from elsewhere: only the same object is
                self.kept.append(x)  # the same; it was alive before the call anyway)
                self._name(x, ("object", id(x)))
                return ("object", id(x))
            return got[0]
        if isinstance(x, (bool, int, float, complex, str, type(None))):
            return (type(x).__name__, x)
        return (type(x).__name__, repr(x))  # dtypes, devices, layouts, memory formats

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        leaves, spec = pytree.tree_flatten((args, kwargs))
        ins = tuple(self._label(x) for x in leaves)
        out = func(*args, **kwargs)
        i = len(self.ops)
        self.ops.append((str(func), str(spec), ins))
        for j, t in enumerate(pytree.tree_leaves(out)):
            if isinstance(t, torch.Tensor):
                self._name(t, ("op", i, j))
        return out


def record(call: nn.Module, unit: nn.Module, tensors: tuple[torch.Tensor, ...]) -> Record:
    """What ``call`` (a unit's `runtime._UnitCall` on one call's arguments) runs on
    ``tensors``, its tensor inputs: one forward without gradients, unseen by the user's
    dispatch modes, the unit's buffers, gradients and RNG restored after (module
    docstring)."""
    known = [(t, ("input", i)) for i, t in enumerate(tensors)]
    known += [(t, ("state", name))
              for name, t in (*unit.named_parameters(), *unit.named_buffers())]
    recorder = _Recorder(known[::-1])  # (an input that is also a parameter: the input)
    # (autocast's cache off: a cast it cached would be held until autocast exits, and the
    # plan's own step casts with the cache off, `autocast_cache.cache_off`)
    with _disable_current_modes(), preserved_state(unit), torch.no_grad(), cache_off(), \
            recorder:
        call(*tensors)
    ops = tuple(recorder.ops)
    recorder.kept.clear()
    return ops


@dataclass
class _Traced:
    prog: Program  # (its graph holds no parameter: `Program` reads them from its root)
    record: Record
    where: tuple


class SharedTraces:
    """The traces of one plan's units, per unit `kind` and call signature, for their
    siblings (module docstring); one per plan, shared by its `runtime.UnitForward`s. It
    holds each kept trace's program (what the unit that traced it holds anyway); a copy or
    a pickle of the plan keeps which units are siblings, not the traces (traces never
    copy)."""

    def __init__(self) -> None:
        self._traced: dict[tuple, _Traced] = {}
        self._members: dict[tuple, int] = {}  # per kind: its units
        self.enabled = ENABLED
        self.shared = 0  # calls that reused a sibling's trace (tests, benchmarks)

    def __getstate__(self) -> dict[str, Any]:
        return {**vars(self), "_traced": {}, "shared": 0}

    def join(self, unit_kind: tuple | None) -> None:
        """Count one more unit of ``unit_kind`` (`kind`; None: one never shared)."""
        if unit_kind is not None:
            self._members[unit_kind] = self._members.get(unit_kind, 0) + 1

    def siblings(self, unit_kind: tuple | None) -> bool:
        """Whether another unit of the plan is of ``unit_kind`` (a trace worth keeping)."""
        return self.enabled and unit_kind is not None and self._members.get(unit_kind, 0) > 1

    def lookup(self, key: tuple | None, call: nn.Module, unit: nn.Module,
               tensors: tuple[torch.Tensor, ...]) -> tuple[Program, tuple] | None:
        """A sibling's traced program for this call and where its captured outputs go, where
        the sibling's call ran the same ops (one forward: `record`); else None (and nothing
        run where no sibling traced this signature)."""
        got = self._traced.get(key) if key is not None else None
        if got is None or _recorded(call, unit, tensors) != got.record:
            return None
        if call.where != got.where:  # (what output-capture hooks appended, and where)
            return None
        self.shared += 1
        return got.prog, got.where

    def graph(self, key: tuple | None, call: nn.Module, unit: nn.Module,
              tensors: tuple[torch.Tensor, ...], *, tracer: str, dynamic: bool
              ) -> tuple[fx.GraphModule, tuple, Program | None, Record | None]:
        """The graph ``call`` runs, where its captured outputs go, the sibling's program it is
        (`lookup`) or None for its own trace (`capture.trace.trace` with ``tracer`` and
        ``dynamic``, unseen by the user's dispatch modes: they would read the tracer's fake
        tensors), and for its own trace, where a sibling may ask for it (``key`` and a
        sibling of the unit's kind), its record (for `add`); raises what the trace raises.
        Records are made as the trace runs, with the call's collector (`runtime._UnitCall`)."""
        like = self.lookup(key, call, unit, tensors)
        if like is not None:
            return like[0].gm, like[1], like[0], None
        with warnings.catch_warnings(), _disable_current_modes():
            warnings.simplefilter("ignore", UserCodeWarning)  # (said when profiled)
            gm = trace(call, tensors, tracer=tracer, dynamic=dynamic)
        where = call.where
        ops = (_recorded(call, unit, tensors)
               if key is not None and key not in self._traced and self.siblings(key[0])
               else None)
        return gm, where, None, ops

    def add(self, key: tuple | None, prog: Program, ops: Record | None, where: tuple) -> None:
        """Keep a unit's new trace (its program, as it runs) for its siblings, with the record
        `graph` made of its call (None: nothing kept)."""
        if key is not None and ops is not None and key not in self._traced:
            self._traced[key] = _Traced(prog, ops, where)


def _recorded(call: nn.Module, unit: nn.Module, tensors: tuple[torch.Tensor, ...]
              ) -> Record | None:
    """`record`, or None where the forward fails without gradients (then nothing is shared:
    the call is traced, which says why it fails if it does)."""
    try:
        return record(call, unit, tensors)
    except Exception:  # noqa: BLE001 - a record is an optimization; the trace decides
        return None
