"""Shape-generic traces: one trace of a call that holds for other sizes of its inputs.

A unit of a units plan is traced at its first training call (`units.runtime.UnitForward`).
Traced for those sizes only, a training run whose sequence length varies traces it again at
each length, and ``torch.compile(plan.module, dynamic=True)`` meets a new trace (a graph
break, then a recompile) at each. `trace` (``dynamic=True``) traces instead for all sizes the
graph allows:

* ``torch.export`` is given ``Dim.AUTO`` for every dimension of every tensor input
  (`export_dims`): it keeps symbolic the sizes the model's code computes from its inputs, and
  specialises the others (a size the code reads as an integer, 0 and 1). The placeholders'
  symbolic shapes and export's ranges give the `ShapePattern` of the inputs the graph holds
  for (`exported_pattern`): a dimension is a fixed size or a symbol, one symbol is one size
  wherever it appears, and each symbol has its range. A placeholder size that is an
  expression of symbols, a size node that reads an intermediate value, an assertion on
  sizes in the graph, or an input guard of export's that the pattern does not imply (the
  model branched on ``n % 2``: the graph holds for even lengths only) gives no pattern (the
  caller traces for the call's sizes instead: a graph is never run at sizes it was not
  traced for);
* ``torch.fx.symbolic_trace`` never sees a size: shapes read by the model's code are graph
  nodes (a Python branch on one fails to trace), so its graph holds for every size of inputs
  of the same ranks (`any_sizes`).

The size nodes of an exported graph (``aten.sym_size.int`` of an input, and arithmetic on
them) are moved to the graph's start (`hoist_sizes`): they then form one leading keep region
before the regions of a schedule solved over the static trace, whose nodes they are not.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.fx as fx

__all__ = ["ShapePattern", "any_sizes", "export_dims", "exported_pattern", "hoist_sizes",
           "quiet_auto_dims", "size_nodes"]

#: nodes that assert on sizes at run time (a shape-generic pattern does not express them)
_ASSERTS = ("_assert_scalar", "sym_constrain_range", "sym_constrain_range_for_size",
            "_assert_async")


@dataclass(frozen=True)
class ShapePattern:
    """The input shapes a traced graph holds for.

    Attributes:
        dims: per tensor input, per dimension: the size (an int) or a symbol's name.
        ranges: ``(symbol, lowest, highest or None)`` of each symbol.
    """

    dims: tuple[tuple[int | str, ...], ...]
    ranges: tuple[tuple[str, int, int | None], ...] = ()

    @property
    def symbolic(self) -> bool:
        """Whether some size may vary (else the pattern is one shape)."""
        return any(isinstance(d, str) for dims in self.dims for d in dims)

    def fits(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` have shapes the graph holds for: the ranks, each fixed size, one
        size per symbol, within its range. (Under ``torch.compile`` with dynamic shapes these
        comparisons become guards on relations of sizes, not on their values.)"""
        if len(tensors) != len(self.dims):
            return False
        ranges = {s: (lo, hi) for s, lo, hi in self.ranges}
        seen: dict[str, Any] = {}
        for t, dims in zip(tensors, self.dims):
            if t.dim() != len(dims):
                return False
            for size, d in zip(t.shape, dims):
                if isinstance(d, int):
                    if size != d:
                        return False
                elif d in seen:
                    if size != seen[d]:
                        return False
                else:
                    seen[d] = size
                    lo, hi = ranges.get(d, (0, None))
                    if size < lo or (hi is not None and size > hi):
                        return False
        return True


def any_sizes(tensors: Sequence[Any]) -> ShapePattern | None:
    """The pattern of a graph that holds for every size at these ranks (symbolic tracing's:
    module docstring): each dimension its own symbol; None when an input is not a tensor."""
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    return ShapePattern(tuple(tuple(f"d{i}_{j}" for j in range(t.dim()))
                              for i, t in enumerate(tensors)))


def export_dims(inputs: Sequence[Any]) -> tuple[Any, ...]:
    """``torch.export``'s ``dynamic_shapes`` for positional ``inputs``: ``Dim.AUTO`` for every
    dimension of each tensor (export keeps symbolic what the code allows), None for others."""
    auto = torch.export.Dim.AUTO
    return tuple({i: auto for i in range(x.dim())} if isinstance(x, torch.Tensor) and x.dim()
                 else None for x in inputs)


def size_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``gm`` that compute sizes (an int or bool value, not a tensor), in order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and _is_size(n.meta.get("val"))]


def _is_size(v: Any) -> bool:
    return isinstance(v, (torch.SymInt, torch.SymBool, torch.SymFloat, int, bool)) and not \
        isinstance(v, torch.Tensor)


def hoist_sizes(gm: fx.GraphModule) -> list[str] | None:
    """Move ``gm``'s size nodes (`size_nodes`) to just after its last placeholder, in order,
    and return their names; None (``gm`` unchanged) when one reads anything but inputs and
    other size nodes, or the graph asserts on sizes (module docstring)."""
    sizes = size_nodes(gm)
    names = {n.name for n in sizes}
    inputs = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    if any(str(getattr(n.target, "__name__", n.target)).split(".")[0] in _ASSERTS
           for n in gm.graph.nodes if n.op == "call_function"):
        return None
    if any(a.name not in names | inputs for n in sizes for a in n.all_input_nodes):
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    at = placeholders[-1] if placeholders else None
    for n in sizes:
        if at is None:
            next(iter(gm.graph.nodes)).prepend(n)
        else:
            at.append(n)
        at = n
    gm.graph.lint()
    gm.recompile()
    return [n.name for n in sizes]


def exported_pattern(gm: fx.GraphModule, ranges: dict[Any, Any],
                     guards: Sequence[str] | None) -> ShapePattern | None:
    """The `ShapePattern` of an exported ``gm`` from its placeholders' shapes and export's
    ``range_constraints`` (module docstring), or None where a size is an expression, or
    ``guards`` (the input guards export checks at run time, ``ExportedProgram._guards_code``;
    None: not known) hold one the pattern does not imply (a branch on ``n % 2``: the graph
    holds for even lengths only)."""
    dims: list[tuple[int | str, ...]] = []
    used: dict[str, Any] = {}
    names: list[str] = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        names.append(n.name)
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        row: list[int | str] = []
        for size in val.shape:
            if isinstance(size, int):
                row.append(size)
                continue
            expr = size.node.expr
            if getattr(expr, "is_Integer", False):  # (a symbolic int export specialised)
                row.append(int(expr))
                continue
            if not getattr(expr, "is_Symbol", False):
                return None  # (an expression of symbols: left to a trace per shape)
            row.append(str(expr))
            used[str(expr)] = expr
        dims.append(tuple(row))
    bounds = []
    for name, expr in sorted(used.items()):
        vr = ranges.get(expr)
        lo = int(vr.lower) if vr is not None and _finite(vr.lower) else 0
        hi = int(vr.upper) if vr is not None and _finite(vr.upper) else None
        bounds.append((name, lo, hi))
    if guards is None or not all(_implied(g, names, dims) for g in guards):
        return None
    return ShapePattern(tuple(dims), tuple(bounds))


_SIZE = r"L\['(\w+)'\]\.size\(\)\[(\d+)\]"
_GUARD = re.compile(rf"^{_SIZE} == (?:(\d+)|{_SIZE})$")


def _implied(guard: str, names: list[str], dims: list[tuple[int | str, ...]]) -> bool:
    """Whether ``guard``, one of export's input guards, is a size equal to a number or to
    another size that ``dims`` already says; any other guard is not (conservatively)."""
    m = _GUARD.match(guard.strip())
    if m is None:
        return False
    a, i, value, b, j = m.groups()
    try:
        left = dims[names.index(a)][int(i)]
        right = int(value) if value is not None else dims[names.index(b)][int(j)]
    except (ValueError, IndexError):
        return False
    return left == right


def _finite(x: Any) -> bool:
    """Whether a range's bound (an int, or a sympy number: ``int_oo`` is not) is finite."""
    try:
        return bool(abs(x) < 2 ** 62)
    except TypeError:
        return False


@contextlib.contextmanager
def quiet_auto_dims() -> Iterator[None]:
    """Hold back export's log line for each ``Dim.AUTO`` dimension it specialises (a size 1,
    a size the code reads as an int): `exported_pattern` keeps those sizes fixed."""
    log = logging.getLogger("torch._export.non_strict_utils")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)
