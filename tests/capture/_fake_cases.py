"""The models of the fake-profile tests (`test_fake`, `test_fake_errors`) and the comparison
of two profiles' memory.

Cases (the factories of ``benchmarks/_models.py``): every example at its test size
(`conftest.SMALL`; Hugging Face GPT-2 with both attention implementations) and tiny Hugging
Face models built from configs (Llama, T5 with labels, Whisper, ViT, BERT), in `TINY`; the
configurations of the recorded graphs in ``graphs/`` (the examples' defaults, GPT-2 with 12
layers) and larger Hugging Face configs, in `LARGE`. No model is downloaded.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch.nn as nn
from conftest import benchmark_modules

from scheduler.capture.scratch import without_scratch
from scheduler.ir.graph import CostGraph

(_models,) = benchmark_modules("_models")

__all__ = ["CASES", "FAKE", "LARGE", "TINY", "assert_same_memory", "cases", "example",
           "memory_of"]

#: a fake profile whose times need no run (``times="isolated"``/``"scaled"`` are tested with
#: `node_times`)
FAKE = dict(mode="fake", times="roofline", device_spec="cpu")
Build = Callable[[], tuple[nn.Module, Any]]


# ----------------------------------------------------------------------------- the models
# (the factories are benchmarks/_models.py's, shared with the sweep; here a missing optional
# package skips the test instead of raising)


def _skipping(build: Build) -> Build:
    def run() -> tuple[nn.Module, Any]:
        try:
            return build()
        except _models.Unavailable as e:
            pytest.skip(str(e))
    return run


def example(name: str, fn: str = "build", **kw: Any) -> Build:
    return _skipping(_models.example(name, fn, **kw))


def llama(*args: Any, **kw: Any) -> Build:
    return _skipping(_models.llama(*args, **kw))


TINY: dict[str, Build] = {
    **{name: _skipping(b) for name, b in _models.EXAMPLES.items()},
    **{name: _skipping(_models.HF[name])
       for name in ("hf_gpt2_sdpa", "llama", "t5_labels", "whisper", "vit", "bert")},
}
#: the configurations of ``graphs/*.json`` (see each example's module docstring) and larger
#: Hugging Face configs
LARGE: dict[str, Build] = {
    **{name: _skipping(b) for name, b in _models.RECORDED.items()},
    **{name: _skipping(b) for name, b in _models.HF_LARGE.items()},
}
CASES = {**TINY, **LARGE}


def cases(fast: list[str], but: tuple[str, ...] = ()) -> list[Any]:
    """Every case but ``but``, those not in ``fast`` marked ``slow``."""
    return [pytest.param(n, marks=[] if n in fast else [pytest.mark.slow], id=n)
            for n in CASES if n not in but]


# ----------------------------------------------------------------------------- comparison


def memory_of(g: CostGraph) -> dict[str, Any]:
    """Everything a profile records about memory, as plain values (JSON lists as tuples)."""
    return {
        "storages": {sid: (s.bytes, s.producer, s.output, s.inner_free, s.last_use,
                           tuple(s.savers), tuple(s.views)) for sid, s in g.storages.items()},
        "nodes": [(n.name, tuple(n.saved), n.pack_mark, n.out_bytes, n.shape) for n in g.nodes],
        "fwd_events": {k: [tuple(e) for e in v] for k, v in g.fwd_events.items()},
        "bwd_steps": [(s.node, tuple(tuple(e) for e in s.events)) for s in g.bwd_steps],
        "bytes": {"param": g.param_bytes, "buffer": g.buffer_bytes, "input": g.input_bytes,
                  "grad": g.grad_bytes},
    }


def assert_same_memory(real: CostGraph, fake: CostGraph) -> None:
    """Field by field, failing on the first difference with both values. The real profile's
    kernel scratch, which a fake one cannot see, is left out (`scratch.without_scratch`)."""
    want, got = memory_of(without_scratch(real)), memory_of(fake)
    for key in want:
        a, b = want[key], got[key]
        if a == b:
            continue
        if isinstance(a, dict):
            k = next(k for k in [*a, *b] if a.get(k) != b.get(k))
            pytest.fail(f"{key}[{k!r}]: real {a.get(k)!r}, fake {b.get(k)!r}")
        if len(a) != len(b):
            pytest.fail(f"{key}: real has {len(a)}, fake {len(b)}")
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        pytest.fail(f"{key}[{i}]: real {a[i]!r}, fake {b[i]!r}")
