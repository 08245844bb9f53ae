"""The models of the fake-profile tests (`test_fake`, `test_fake_errors`) and the comparison
of two profiles' memory.

Cases: every example at its test size (`conftest.SMALL`; Hugging Face GPT-2 with both
attention implementations) and tiny Hugging Face models built from configs (Llama, T5 with
labels, Whisper, ViT, BERT), in `TINY`; the configurations of the recorded graphs in
``graphs/`` (the examples' defaults, GPT-2 with 12 layers) and larger Hugging Face configs, in
`LARGE`. No model is downloaded.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from conftest import SMALL

from scheduler.capture.scratch import without_scratch
from scheduler.ir.graph import CostGraph

__all__ = ["CASES", "FAKE", "LARGE", "TINY", "assert_same_memory", "cases", "example",
           "memory_of"]

#: a fake profile whose times need no run (``times="isolated"``/``"scaled"`` are tested with
#: `node_times`)
FAKE = dict(mode="fake", times="roofline", device_spec="cpu")
Build = Callable[[], tuple[nn.Module, Any]]


# ----------------------------------------------------------------------------- the models


def example(name: str, fn: str = "build", **kw: Any) -> Build:
    def build() -> tuple[nn.Module, Any]:
        if name == "hf_gpt2":
            pytest.importorskip("transformers")
        mod = importlib.import_module(f"examples.{name}")
        return getattr(mod, fn)(**kw)
    return build


def _ids(shape: tuple[int, ...], high: int, seed: int) -> torch.Tensor:
    return torch.randint(1, high, shape, generator=torch.Generator().manual_seed(seed))


def _hf() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return pytest.importorskip("transformers")


def llama(layers: int = 2, hidden: int = 32, seq: int = 16, batch: int = 2,
          attn: str = "eager") -> Build:
    def build() -> tuple[nn.Module, Any]:
        tf = _hf()
        torch.manual_seed(0)
        cfg = tf.LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=max(32, seq),
                             attn_implementation=attn, use_cache=False, bos_token_id=0,
                             eos_token_id=0)
        return tf.LlamaForCausalLM(cfg).train(), {"input_ids": _ids((batch, seq), 96, 1),
                                                  "labels": _ids((batch, seq), 96, 2)}
    return build


class T5WithLabels(nn.Module):
    """T5 given ``labels`` (it shifts them into ``decoder_input_ids`` in place), returning its
    loss (its output otherwise holds a cache object that export cannot flatten)."""

    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, labels=labels).loss


def t5(layers: int = 1, seq: int = 8, batch: int = 2) -> Build:
    def build() -> tuple[nn.Module, Any]:
        tf = _hf()
        torch.manual_seed(0)
        cfg = tf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=layers,
                          num_decoder_layers=layers, num_heads=2, decoder_start_token_id=0,
                          pad_token_id=0, dropout_rate=0.0)
        return (T5WithLabels(tf.T5ForConditionalGeneration(cfg)).train(),
                (_ids((batch, seq), 64, 1), _ids((batch, seq), 64, 2)))
    return build


def whisper() -> tuple[nn.Module, Any]:
    tf = _hf()
    torch.manual_seed(0)
    cfg = tf.WhisperConfig(vocab_size=64, num_mel_bins=8, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2, d_model=32,
                           encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
                           max_target_positions=16, decoder_start_token_id=0, pad_token_id=0,
                           bos_token_id=0, eos_token_id=0, attn_implementation="eager",
                           use_cache=False)
    feats = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
    return (tf.WhisperForConditionalGeneration(cfg).train(),
            {"input_features": feats, "labels": _ids((2, 8), 64, 2)})


def vit() -> tuple[nn.Module, Any]:
    tf = _hf()
    torch.manual_seed(0)
    cfg = tf.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                       num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                       num_labels=5, attn_implementation="eager")
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    return (tf.ViTForImageClassification(cfg).train(),
            {"pixel_values": pixels, "labels": _ids((2,), 5, 2)})


def bert() -> tuple[nn.Module, Any]:
    tf = _hf()
    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                        attn_implementation="eager")
    return (tf.BertForMaskedLM(cfg).train(),
            {"input_ids": _ids((2, 16), 96, 1), "labels": _ids((2, 16), 96, 2)})


TINY: dict[str, Build] = {
    **{name: example(name, **SMALL[name]) for name in SMALL},
    "hf_gpt2_sdpa": example("hf_gpt2", **SMALL["hf_gpt2"], attn_implementation="sdpa"),
    "llama": llama(), "t5_labels": t5(), "whisper": whisper, "vit": vit, "bert": bert,
}
#: the configurations of ``graphs/*.json`` (see each example's module docstring) and larger
#: Hugging Face configs
LARGE: dict[str, Build] = {
    "graph_gpt": example("gpt"), "graph_mlp": example("mlp"), "graph_unet": example("unet"),
    "graph_hf_gpt2": example("hf_gpt2"), "graph_hf_gpt2_12l": example("hf_gpt2",
                                                                      "build_12_layers"),
    "graph_hf_gpt2_sdpa": example("hf_gpt2", attn_implementation="sdpa"),
    "llama_8l_sdpa": llama(layers=8, hidden=128, seq=128, batch=4, attn="sdpa"),
    "t5_labels_3l": t5(layers=3, seq=64, batch=4),
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
