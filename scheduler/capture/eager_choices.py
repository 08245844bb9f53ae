"""While `trace` exports a model: the choices libraries make from tensor values, taken as
its eager run took them (`eager_choices`), so that the graph profiled is the step that runs."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

__all__ = ["EAGER_CHOICES", "TRACING_CHECKS", "choices", "compiled_choices", "eager_choices"]

#: Library functions whose answer depends on tensor values, which an export cannot read:
#: ``(module, name)``. Hugging Face's mask
#: builder asks them whether eager SDPA may skip the causal mask (``is_causal=True``, no mask)
#: or the bidirectional one (an encoder's: ViT, BERT), and whether the positions hold packed
#: sequences; under ``torch.export`` all answer "build the mask", which eager code does not
#: (+78% peak at sequence 1024 on a small Llama; on a units plan, a unit whose eager call
#: differs from the profiled one runs unplanned).
EAGER_CHOICES = (("transformers.masking_utils", "_ignore_causal_mask_sdpa"),
                 ("transformers.masking_utils", "_ignore_bidirectional_mask_sdpa"),
                 ("transformers.masking_utils", "find_packed_sequence_indices"))

_REPLAY_CHOICES: list[bool | str] = [False]

#: The checks by which those library functions tell a traced call (``torch.compile``'s
#: included) from an eager one: ``(module, name)``
TRACING_CHECKS = (("transformers.masking_utils", "is_tracing"),)


@contextlib.contextmanager
def compiled_choices() -> Iterator[None]:
    """While it is active, the library code of `EAGER_CHOICES` answers an eager call as it
    answers one traced by ``torch.compile`` (`TRACING_CHECKS` say "tracing"): Hugging Face's
    mask builder then builds the mask it builds in a compiled step (it cannot read the
    positions' values there to find that no sequences are packed), so that an eager call
    passes a model's layers what they receive compiled. (`units.step.warm_up` traces the
    units for both calls.) A library not loaded, or without these checks, is left alone."""
    patched = []
    for mod_name, name in TRACING_CHECKS:
        mod = sys.modules.get(mod_name)
        if callable(getattr(mod, name, None)):
            patched.append((mod, name, getattr(mod, name)))
            setattr(mod, name, _tracing)
    try:
        yield
    finally:
        for mod, name, fn in patched:
            setattr(mod, name, fn)


def _tracing(*args: Any, **kwargs: Any) -> bool:
    return True


@contextlib.contextmanager
def eager_choices(*, unpacked: bool = False) -> Iterator[None]:
    """While it is active, `trace` records the answers of `EAGER_CHOICES` in its eager run
    and gives them again while ``torch.export`` traces, so that the graph is the step the
    model runs eagerly at these inputs. Only for a graph that is profiled, not run: the
    answers are the example inputs' (a units plan runs the model's own code, which asks
    again at every call; a whole-graph plan would bake them into its step).

    ``unpacked``: the inputs give no position ids, so the model makes them as ``arange``,
    one sequence per row, and eager code finds no packed sequences; said here because a
    fake step cannot read the positions to find it out."""
    _REPLAY_CHOICES.append("unpacked" if unpacked else True)
    try:
        yield
    finally:
        _REPLAY_CHOICES.pop()


@contextlib.contextmanager
def choices(answers: list[Any], record: bool) -> Iterator[None]:
    patched = []
    for mod_name, name in EAGER_CHOICES if _REPLAY_CHOICES[-1] else ():
        mod = sys.modules.get(mod_name)
        fn = getattr(mod, name, None)
        if fn is None:
            continue

        def wrapped(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
            if _name == "find_packed_sequence_indices" and _REPLAY_CHOICES[-1] == "unpacked":
                return None
            if record:
                out = _fn(*args, **kwargs)
                answers.append((_name, out is None if not isinstance(out, bool) else out))
                return out
            if answers and answers[0][0] == _name:
                _, said = answers.pop(0)
                if isinstance(said, bool) and _name != "find_packed_sequence_indices":
                    return said
                if said is True:  # eager returned None: no packed sequences
                    return None
            return _fn(*args, **kwargs)

        setattr(mod, name, wrapped)
        patched.append((mod, name, fn))
    try:
        yield
    finally:
        for mod, name, fn in patched:
            setattr(mod, name, fn)
