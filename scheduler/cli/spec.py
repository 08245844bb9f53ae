"""Resolve a MODEL_SPEC (``path/to/file.py:factory`` or ``package.module:factory``).

A factory takes no arguments and returns ``(model, inputs)`` or ``(model, inputs, loss_fn)``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["SpecError", "load_factory", "resolve_factory", "split_spec"]

_FORMS = "'path/to/file.py:factory' or 'package.module:factory'"


class SpecError(ValueError):
    """A MODEL_SPEC that cannot be resolved into a model and its example inputs."""


def split_spec(spec: str) -> tuple[str, str]:
    """Split ``"examples/gpt.py:build"`` into ``("examples/gpt.py", "build")``.

    The last colon separates, so a Windows path with a drive letter still works.

    Raises:
        SpecError: when there is no colon or either side is empty.
    """
    target, colon, attr = spec.rpartition(":")
    if not colon or not target or not attr:
        raise SpecError(f"bad model spec {spec!r}: expected {_FORMS}")
    return target, attr


def _is_file_target(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


@contextlib.contextmanager
def _on_sys_path(directory: str) -> Iterator[None]:
    # Temporary, so that resolving one spec does not change what later imports find.
    sys.path.insert(0, directory)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(directory)


def _import_file(path: Path, spec: str) -> ModuleType:
    if not path.is_file():
        raise SpecError(f"model file not found: {str(path)!r} (from spec {spec!r})")
    resolved = path.resolve()
    # A name unique per file: two 'model.py' files in different folders must not collide.
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    name = f"_scheduler_spec_{resolved.stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise SpecError(f"cannot load {str(path)!r} as a Python module (from spec {spec!r})")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before executing: dataclasses and pickling look the module up by name.
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise SpecError(
            f"importing {str(path)!r} failed: {type(exc).__name__}: {_one_line(exc)}"
        ) from exc
    return module


def _import_module(target: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except Exception as exc:
        raise SpecError(
            f"importing module {target!r} failed: {type(exc).__name__}: {_one_line(exc)}"
        ) from exc


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or "(no message)"


def _callables_of(module: ModuleType) -> list[str]:
    own = []
    for name, value in vars(module).items():
        if name.startswith("_") or not callable(value):
            continue
        # Prefer what the file defines over what it imported (torch, nn, ...).
        if getattr(value, "__module__", None) == module.__name__:
            own.append(name)
    return sorted(own, key=str.lower)


def _check_result(result: Any, spec: str) -> tuple[Any, tuple[Any, ...], Callable[..., Any] | None]:
    import torch  # deferred: `scheduler --help` should not pay for importing torch

    expected = "(model, inputs) or (model, inputs, loss_fn) with model an nn.Module"
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise SpecError(f"factory {spec!r} returned {_describe(result)}; expected {expected}")
    model, inputs = result[0], result[1]
    loss_fn = result[2] if len(result) == 3 else None
    if not isinstance(model, torch.nn.Module):
        raise SpecError(
            f"factory {spec!r} returned {_describe(model)} as the model; expected {expected}"
        )
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    elif isinstance(inputs, (tuple, list)):
        inputs = tuple(inputs)
    elif isinstance(inputs, dict):
        from ..capture.calls import call_inputs  # deferred, as torch above

        try:
            inputs = call_inputs(model, inputs)
        except TypeError as e:
            raise SpecError(f"factory {spec!r} returned keyword inputs that do not bind: {e}"
                            ) from None
    else:
        raise SpecError(
            f"factory {spec!r} returned {_describe(inputs)} as the inputs; expected a tensor, "
            "a tuple of the model's positional arguments or a dict of keyword arguments"
        )
    for i, x in enumerate(inputs):
        if _looks_like_data(x):
            raise SpecError(
                f"factory {spec!r} returned input {i} as {_describe(x)} of numbers (nested "
                "lists); the model needs tensors: return torch.tensor(...) of it instead"
            )
    if loss_fn is not None and not callable(loss_fn):
        raise SpecError(
            f"factory {spec!r} returned {_describe(loss_fn)} as loss_fn; expected a callable or None"
        )
    return model, inputs, loss_fn


def _looks_like_data(value: Any) -> bool:
    """A list or tuple of numbers that is nested or holds floats: data meant as a tensor (a flat
    list of ints may be a real argument, such as a shape)."""
    if not isinstance(value, (list, tuple)) or not value:
        return False
    nested = False
    stack, leaves = list(value), []
    while stack:
        v = stack.pop()
        if isinstance(v, (list, tuple)):
            nested = True
            stack.extend(v)
        else:
            leaves.append(v)
    numbers = all(isinstance(v, (int, float)) for v in leaves)
    return bool(leaves) and numbers and (nested or any(isinstance(v, float) for v in leaves))


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        inner = ", ".join(type(v).__name__ for v in value[:5])
        more = ", ..." if len(value) > 5 else ""
        return f"a {type(value).__name__} of {len(value)} ({inner}{more})"
    return f"a {type(value).__name__}"


def load_factory(spec: str) -> tuple[Any, tuple[Any, ...], Callable[..., Any] | None]:
    """Resolve a MODEL_SPEC, call its factory, and return ``(model, inputs, loss_fn)``.

    Args:
        spec: ``path/to/file.py:factory`` (the file is loaded as a module, its folder on
            ``sys.path`` meanwhile so that sibling imports work) or ``package.module:factory``
            (imported with the current directory on ``sys.path``, as ``python -m`` would).

    Returns:
        ``(model, inputs, loss_fn)``: ``inputs`` always a tuple (a single tensor is wrapped),
        ``loss_fn`` None when the factory returned only two values.

    Raises:
        SpecError: with one line saying what was wrong: no colon, a missing file, an import
            that failed, a missing factory (listing the module's callables), a factory that
            raised, or one that returned something of the wrong shape.

    Example:
        >>> model, inputs, loss_fn = load_factory("examples/gpt.py:build")  # doctest: +SKIP
    """
    factory, directory = _resolve(spec)
    # Sibling imports may also happen lazily inside the factory, so it runs on the path too.
    with _on_sys_path(directory):
        try:
            params = inspect.signature(factory).parameters.values()
            required = [
                p.name
                for p in params
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            ]
        except (TypeError, ValueError):  # builtins without a signature: just try the call
            required = []
        if required:
            raise SpecError(
                f"factory {spec!r} requires arguments ({', '.join(required)}); "
                "a factory is called with none: give them defaults or wrap it"
            )
        try:
            result = factory()
        except Exception as exc:
            raise SpecError(
                f"factory {spec!r} raised {type(exc).__name__}: {_one_line(exc)}"
            ) from exc
    return _check_result(result, spec)


def _resolve(spec: str) -> tuple[Callable[..., Any], str]:
    """The factory a MODEL_SPEC names, uncalled, and the folder its imports need."""
    target, attr = split_spec(spec)
    if _is_file_target(target):
        path: Path | None = Path(target)
        directory = str(path.resolve().parent) if path.is_file() else str(path.parent)
    else:
        path = None
        directory = os.getcwd()
    with _on_sys_path(directory):
        module = _import_file(path, spec) if path is not None else _import_module(target)
    if not hasattr(module, attr):
        names = _callables_of(module)
        has = ", ".join(names) if names else "no public callables"
        where = str(path) if path is not None else target
        raise SpecError(f"{where!r} has no attribute {attr!r}; it defines: {has}")
    factory = getattr(module, attr)
    if not callable(factory):
        raise SpecError(f"{spec!r} names a {type(factory).__name__}, not a callable factory")
    return factory, directory


def resolve_factory(spec: str) -> Callable[..., Any]:
    """The factory a MODEL_SPEC names, not called: for callers that pass it arguments (such
    as ``max_batch``, which calls ``factory(batch=n)``). The returned callable has the
    factory's signature and runs it with the spec's folder on ``sys.path``.

    Raises:
        SpecError: as `load_factory`, for everything up to calling the factory.
    """
    factory, directory = _resolve(spec)

    @functools.wraps(factory)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _on_sys_path(directory):
            return factory(*args, **kwargs)

    return call
