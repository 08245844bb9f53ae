"""The models that the benchmarks and the tests share: one factory per model, each returning a
fresh ``(model, inputs)`` (positional inputs as a tuple, keyword inputs as a dict), the same
model and inputs on every call (seeded).

* `EXAMPLES`: ``examples/*.py`` at their test sizes (`SMALL`);
* `RECORDED`: the configurations of the recorded graphs ``graphs/*.json`` (each example's
  defaults; GPT-2 with 12 layers);
* `HF`: the tiny Hugging Face architectures the tests build from configs (GPT-2 with SDPA,
  Llama eager and SDPA, T5 and Whisper given labels, ViT, BERT), random weights, nothing
  downloaded; `HF_LARGE`: larger configurations of two of them;
* `TORCHTITAN`: torchtitan's own Llama 3 debug model (`titan_llama3`).

A factory whose optional package is missing (``transformers``, ``torchtitan``) raises
`Unavailable`, an ``ImportError`` whose message says what to install; the tests turn it into a
skip, the sweep into a row that says so. Nothing here imports ``pytest``.

The benchmarks are scripts, not part of the package: this module is imported with the
``benchmarks`` folder on ``sys.path`` (the scripts have it there; the tests put it there).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

__all__ = ["ALL", "EXAMPLES", "HF", "HF_LARGE", "RECORDED", "ROOT", "SMALL", "TITAN_INSTALL",
           "TORCHTITAN", "Build", "T5WithLabels", "TitanWithLoss", "Unavailable", "bert",
           "example", "llama", "t5", "titan_llama3", "vit", "whisper"]

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package
    sys.path.insert(0, str(ROOT))

Build = Callable[[], tuple[nn.Module, Any]]


class Unavailable(ImportError):
    """A model factory's optional package is not installed; the message says which one and
    how to install it."""


# ----------------------------------------------------------------------------- the examples

#: Small but non-trivial sizes of every example (seconds, not minutes, to profile on 2 cores).
#: MLP uses batch=256 so that activations, not parameters, dominate its peak.
SMALL: dict[str, dict[str, Any]] = {
    "mlp": dict(batch=256, dim=64, depth=3),
    "gpt": dict(batch=2, block_size=16, n_layer=2, n_head=2, n_embd=32, vocab_size=64),
    "unet": dict(batch=2, channels=3, size=16, base=4, classes=2),
    "hf_gpt2": dict(batch=2, seq_len=16, n_layer=2, n_head=2, n_embd=32, vocab_size=64),
}


def example(name: str, fn: str = "build", **kw: Any) -> Build:
    """``examples/<name>.py``'s ``fn(**kw)``."""
    def build() -> tuple[nn.Module, Any]:
        if name.startswith("hf_"):
            _transformers()
        return getattr(importlib.import_module(f"examples.{name}"), fn)(**kw)
    return build


# ----------------------------------------------------------------------------- Hugging Face


def _transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from configs: never download
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise Unavailable(f"this model needs transformers ({e}): pip install -e '.[hf]'") from e


def _ids(shape: tuple[int, ...], high: int, seed: int) -> torch.Tensor:
    return torch.randint(1, high, shape, generator=torch.Generator().manual_seed(seed))


def llama(layers: int = 2, hidden: int = 32, seq: int = 16, batch: int = 2,
          attn: str = "eager") -> Build:
    """``LlamaForCausalLM`` given ``input_ids`` and ``labels``."""
    def build() -> tuple[nn.Module, Any]:
        tf = _transformers()
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
    """``T5ForConditionalGeneration`` given ``labels`` (`T5WithLabels`)."""
    def build() -> tuple[nn.Module, Any]:
        tf = _transformers()
        torch.manual_seed(0)
        cfg = tf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=layers,
                          num_decoder_layers=layers, num_heads=2, decoder_start_token_id=0,
                          pad_token_id=0, dropout_rate=0.0)
        return (T5WithLabels(tf.T5ForConditionalGeneration(cfg)).train(),
                (_ids((batch, seq), 64, 1), _ids((batch, seq), 64, 2)))
    return build


def whisper() -> tuple[nn.Module, Any]:
    """``WhisperForConditionalGeneration`` given ``input_features`` and ``labels``."""
    tf = _transformers()
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
    """``ViTForImageClassification`` given ``pixel_values`` and ``labels``."""
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                       num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                       num_labels=5, attn_implementation="eager")
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    return (tf.ViTForImageClassification(cfg).train(),
            {"pixel_values": pixels, "labels": _ids((2,), 5, 2)})


def bert() -> tuple[nn.Module, Any]:
    """``BertForMaskedLM`` given ``input_ids`` and ``labels``."""
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                        attn_implementation="eager")
    return (tf.BertForMaskedLM(cfg).train(),
            {"input_ids": _ids((2, 16), 96, 1), "labels": _ids((2, 16), 96, 2)})


# ----------------------------------------------------------------------------- torchtitan

#: the release the torchtitan model was checked with, and what it needs at import time, each
#: installed with --no-deps (so that torch is never replaced)
TITAN_INSTALL = ("pip install --no-deps torchtitan==0.2.2 tyro==1.0.17 docstring_parser==0.18.0 "
                 "torchdata==0.11.0 tensorboard==2.21.0")
#: torchtitan modules that ``import torchtitan`` runs but the Llama 3 model never calls, and
#: the heavy packages they import: the MoE token-permutation kernel (triton, about 1 GB
#: installed) and the Hugging Face data loaders (datasets, with pyarrow and pandas).
#: `_import_titan` lets an inert stand-in take their place while it imports.
_TITAN_STUBBED = {"torchtitan.models.moe.kernels": "triton",
                  "torchtitan.hf_datasets.text_datasets": "datasets"}


class _Stubbed:
    """A name of a module `_import_titan` stood in for: calling it raises."""

    def __init__(self, name: str, needs: str) -> None:
        self.name, self.needs = name, needs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.name} was replaced by an inert stand-in when torchtitan was "
                           f"imported without {self.needs}; install {self.needs} to call it")


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stubbed(f"{self.__name__}.{name}", _TITAN_STUBBED[self.__name__])


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        return importlib.machinery.ModuleSpec(name, self) if name in _TITAN_STUBBED else None

    def create_module(self, spec: Any) -> types.ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _import_titan() -> tuple[Any, Callable[..., torch.Tensor]]:
    """torchtitan's ``models.llama3`` package and its loss, ``cross_entropy_loss``.

    ``import torchtitan`` imports its MoE kernels (which import triton) and its data loaders
    (which import datasets); the Llama 3 model uses neither. Where those packages are not
    installed, the two torchtitan modules that import them are stood in for while torchtitan
    is imported (`_TITAN_STUBBED`). Only those torchtitan modules are replaced: triton itself
    is never faked, since torch looks for it (``torch._dynamo``) and would take a fake for
    the real thing.

    Raises:
        Unavailable: torchtitan (0.2.x) or a package it imports is not installed.
    """
    if importlib.util.find_spec("torchtitan") is None:
        raise Unavailable(f"torchtitan is not installed: {TITAN_INSTALL}")
    from importlib.metadata import version
    have = version("torchtitan")
    if not have.startswith("0.2."):
        raise Unavailable(f"torchtitan {have} is installed; the Llama 3 model here is built "
                          f"with a 0.2.x release (sdpa attention with a CPU backward): "
                          f"{TITAN_INSTALL}")
    finder = None
    missing = {m for m, pkg in _TITAN_STUBBED.items()
               if m not in sys.modules and importlib.util.find_spec(pkg) is None}
    if missing:
        finder = _StubFinder()
        sys.meta_path.insert(0, finder)
    try:
        llama3 = importlib.import_module("torchtitan.models.llama3")
        loss = importlib.import_module("torchtitan.components.loss").cross_entropy_loss
    except ImportError as e:
        raise Unavailable(f"torchtitan {have} is installed but does not import ({e}): "
                          f"{TITAN_INSTALL}") from e
    finally:
        if finder is not None:
            sys.meta_path.remove(finder)
    return llama3, loss


class TitanWithLoss(nn.Module):
    """torchtitan's ``Transformer`` and its training loss (``cross_entropy_loss``, a sum over
    tokens), as its trainer computes it: ``forward(tokens, labels)`` returns the loss."""

    def __init__(self, model: nn.Module, loss: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(self.model(tokens), labels)


def titan_llama3(layers: int = 4, dim: int = 64, heads: int = 4, vocab: int = 256,
                 batch: int = 4, seq: int = 64) -> Build:
    """torchtitan's Llama 3 ``"debugmodel"`` flavour (its own ``TransformerModelArgs``:
    sdpa attention, RoPE table ``freqs_cis`` shared by every block), shrunk to ``layers``
    blocks of width ``dim`` with ``heads`` heads, a ``vocab``-token vocabulary and a RoPE
    table of ``seq`` positions, initialised by its own ``init_weights`` (under ``no_grad``,
    as torchtitan's trainer does); inputs: ``batch`` x ``seq`` tokens and labels."""
    def build() -> tuple[nn.Module, Any]:
        llama3, loss = _import_titan()
        args = dataclasses.replace(llama3.llama3_args["debugmodel"], n_layers=layers, dim=dim,
                                   n_heads=heads, vocab_size=vocab, max_seq_len=seq)
        torch.manual_seed(0)
        model = llama3.Transformer(args)
        with torch.no_grad():
            model.init_weights()
        tokens, labels = _ids((batch, seq), vocab, 1), _ids((batch, seq), vocab, 2)
        return TitanWithLoss(model, loss).train(), (tokens, labels)
    return build


# ----------------------------------------------------------------------------- the catalogue

#: the examples at their test sizes
EXAMPLES: dict[str, Build] = {name: example(name, **kw) for name, kw in SMALL.items()}
#: the models of ``graphs/<name>.json`` as ``graph_<name>`` (see each example's docstring)
RECORDED: dict[str, Build] = {
    "graph_gpt": example("gpt"), "graph_hf_gpt2": example("hf_gpt2"),
    "graph_hf_gpt2_12l": example("hf_gpt2", "build_12_layers"), "graph_mlp": example("mlp"),
    "graph_unet": example("unet"),
}
#: the tiny Hugging Face architectures the tests build
HF: dict[str, Build] = {
    "hf_gpt2_sdpa": example("hf_gpt2", **SMALL["hf_gpt2"], attn_implementation="sdpa"),
    "llama": llama(), "llama_sdpa": llama(attn="sdpa"), "t5_labels": t5(),
    "whisper": whisper, "vit": vit, "bert": bert,
}
#: larger configurations (the fake-profile tests compare them with real profiles)
HF_LARGE: dict[str, Build] = {
    "graph_hf_gpt2_sdpa": example("hf_gpt2", attn_implementation="sdpa"),
    "llama_8l_sdpa": llama(layers=8, hidden=128, seq=128, batch=4, attn="sdpa"),
    "t5_labels_3l": t5(layers=3, seq=64, batch=4),
}
#: torchtitan's models
TORCHTITAN: dict[str, Build] = {"titan_llama3": titan_llama3()}
#: every model the sweep (benchmarks/sweep.py) runs
ALL: dict[str, Build] = {**EXAMPLES, **RECORDED, **HF, **TORCHTITAN}
