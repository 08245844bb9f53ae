"""Which submodules a plan takes over: its units (`find_units`).

A unit is a submodule whose calls the plan runs; everything else in the step is the model's
own ``forward``, run as written. ``units="auto"`` looks, in order, for

1. modules already wrapped by FSDP2's ``fully_shard`` (the root excluded);
2. a Hugging Face model's ``_no_split_modules`` classes (its decoder or encoder layers);
3. the children of a ``ModuleList`` or ``nn.Sequential`` with identical structure (two or
   more of one class, with the same parameter names, shapes and dtypes);

and takes the first rule that finds two or more (rule 3 finds the outermost such children
wherever they sit: stages of blocks, an encoder's and a decoder's layers). ``units="default"``
(what `scheduler.solve` takes when none is named) is ``"auto"`` for a model that declares its
blocks in ``_no_split_modules`` (Hugging Face, diffusers: their traced graph is not what their
eager forward runs, which builds no causal mask and keeps the cache out of training); for a
model of those libraries whose ``_no_split_modules`` is empty (wav2vec2, DeBERTa-v2), rule 3
(units by structure; the code around them, a head that reads tensor values included, runs as
the user's: `capture.recorded`); and None (one traced graph for the whole step, whose
regions may span blocks) for the rest. ``UnitChoice.why`` says which rule and why. Users
name units with a class, a glob of module paths (``"model.layers.*"``), a list of globs, or
a predicate ``(path, module) -> bool``. Only the outermost of nested matches are units, and
never the root.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Callable

import torch.nn as nn

__all__ = ["DEFAULT", "UnitChoice", "find_units"]

#: ``units=`` when none is named: ``"auto"`` where the model declares ``_no_split_modules``,
#: units by structure for a Hugging Face or diffusers model whose list is empty, else None
#: (see the module docstring)
DEFAULT = "default"


@dataclass(frozen=True)
class UnitChoice:
    """The units a plan takes over and why: ``paths`` (module paths, in module order; empty
    for a whole-graph plan) and ``why``, one line for the plan's summary."""

    paths: tuple[str, ...]
    why: str


def find_units(model: nn.Module, units: Any = "auto") -> UnitChoice:
    """The plan's units in ``model`` (see the module docstring for ``units``).

    Raises:
        ValueError: ``units`` names no submodule, or is of a kind not understood (the
            message names the value and the forms it can take).
    """
    if isinstance(units, str) and units == DEFAULT:
        if getattr(model, "_no_split_modules", None):
            units = "auto"
        elif _declares_blocks(model):
            return _by_structure(model, [(p, m) for p, m in model.named_modules() if p], (
                f"the default for a {_family(model)} model whose _no_split_modules is empty: "
                "units by structure, "))
        else:
            return UnitChoice((), "the default for a model without _no_split_modules: one "
                                  "traced graph for the whole step (units='auto': its blocks)")
    if units is None or units is False:
        return UnitChoice((), "units=None: one traced graph for the whole step")
    mods = [(p, m) for p, m in model.named_modules() if p]
    if isinstance(units, str) and units == "auto":
        return _auto(model, mods)
    if isinstance(units, type) and issubclass(units, nn.Module):
        pick, what = (lambda p, m: isinstance(m, units)), f"class {units.__name__}"
    elif isinstance(units, str) or (isinstance(units, (list, tuple)) and units
                                    and all(isinstance(u, str) for u in units)):
        globs = [units] if isinstance(units, str) else list(units)
        pick, what = (lambda p, m: any(fnmatch.fnmatchcase(p, g) for g in globs)), repr(units)
    elif callable(units):
        pick, what = units, f"predicate {getattr(units, '__name__', 'units')}"
    else:
        raise ValueError(
            f"units={units!r} is not understood: pass 'auto', 'default', None (one graph for "
            "the whole step), a module class, a glob of module paths such as "
            "'model.layers.*' (or a list of them), or a predicate (path, module) -> bool")
    paths = _outermost([p for p, m in mods if pick(p, m)])
    if not paths:
        raise ValueError(
            f"units={units!r} matches no submodule of {type(model).__name__}; its module "
            f"paths start {', '.join(p for p, _ in mods[:4])}, ...: name those, or pass "
            "units='auto'")
    return UnitChoice(paths, f"units named by {what}: {_count(model, paths)}")


def _auto(model: nn.Module, mods: list[tuple[str, nn.Module]]) -> UnitChoice:
    rules: list[tuple[str, Callable[[str, nn.Module], bool]]] = []
    try:
        from torch.distributed.fsdp import FSDPModule
        rules.append(("modules wrapped by fully_shard", lambda p, m: isinstance(m, FSDPModule)))
    except ImportError:  # pragma: no cover - torch without distributed
        pass
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        rules.append((f"the model's _no_split_modules ({', '.join(sorted(names))})",
                      lambda p, m: type(m).__name__ in names))
    for what, pick in rules:
        paths = _outermost([p for p, m in mods if pick(p, m)])
        if len(paths) >= 2:
            return UnitChoice(paths, f"{what}: {_count(model, paths)}")
    return _by_structure(model, mods, (
        f"the model's _no_split_modules ({', '.join(sorted(names))}) name fewer than two "
        "modules: units by structure, " if names else
        "units by structure (the model declares no _no_split_modules): "))


def _by_structure(model: nn.Module, mods: list[tuple[str, nn.Module]], why: str
                  ) -> UnitChoice:
    """Rule 3: the outermost identical children of a ModuleList or Sequential, wherever they
    sit; ``why`` starts the reason."""
    paths = _outermost([p for p, m in mods if p in _repeated(mods)])
    if len(paths) >= 2:
        return UnitChoice(paths, f"{why}the identical children of a ModuleList or Sequential: "
                                 f"{_count(model, paths)}")
    return UnitChoice((), f"{why}no repeated blocks (no ModuleList or Sequential of identical "
                          "children, no _no_split_modules, no fully_shard): one traced graph "
                          "for the whole step")


#: (module, class) of the model classes whose subclasses declare their blocks in
#: ``_no_split_modules``, and whose step the default plans in units (module docstring)
BLOCK_DECLARING = (("transformers.modeling_utils", "PreTrainedModel"),
                   ("diffusers.models.modeling_utils", "ModelMixin"))


def _family(model: nn.Module) -> str:
    cls = next(c for c in type(model).__mro__ if (c.__module__, c.__name__) in BLOCK_DECLARING)
    return "Hugging Face" if cls.__name__ == "PreTrainedModel" else "diffusers"


def _declares_blocks(model: nn.Module) -> bool:
    """Whether ``model`` is of a library whose models declare their blocks in
    ``_no_split_modules`` (`BLOCK_DECLARING`): transformers' or diffusers'."""
    return any((c.__module__, c.__name__) in BLOCK_DECLARING for c in type(model).__mro__)


def _repeated(mods: list[tuple[str, nn.Module]]) -> set[str]:
    """Paths of the children of each ModuleList/Sequential whose children (two or more) are
    one class with the same parameters."""
    out: set[str] = set()
    for path, m in mods:
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < 2:
            continue
        kids = list(m.named_children())
        shapes = {(type(c), tuple((n, tuple(t.shape), t.dtype) for n, t in c.named_parameters()))
                  for _, c in kids}
        if len(shapes) == 1 and next(iter(shapes))[1]:
            out.update(f"{path}.{name}" for name, _ in kids)
    return out


def _outermost(paths: list[str]) -> tuple[str, ...]:
    keep: list[str] = []
    for p in paths:
        if not any(p.startswith(q + ".") for q in keep):
            keep.append(p)
    return tuple(keep)


def _count(model: nn.Module, paths: tuple[str, ...]) -> str:
    mods = dict(model.named_modules())
    kinds: dict[str, int] = {}
    for p in paths:
        kinds[type(mods[p]).__name__] = kinds.get(type(mods[p]).__name__, 0) + 1
    first = paths[0] if len(paths) == 1 else f"{paths[0]} .. {paths[-1]}"
    return f"{', '.join(f'{n} {k}' for k, n in kinds.items())} ({first})"
