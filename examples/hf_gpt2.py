"""Hugging Face GPT-2 (``transformers.GPT2LMHeadModel``) with small, random weights.

This example shows the scheduler on a model that ``torch.fx.symbolic_trace`` cannot
trace, so the profiler has to fall back to ``torch.export``. Nothing is downloaded: the
model is built from a small ``GPT2Config`` (no ``from_pretrained``). It needs the
optional ``transformers`` dependency (``pip install transformers``, or the project's
``hf`` extra: ``pip install -e .[hf]``).

Run it with the CLI::

    scheduler profile examples/hf_gpt2.py:build --out graphs/hf_gpt2.json

What we found (torch 2.13, transformers 5.x, CPU):

* ``torch.fx.symbolic_trace(model)`` fails before tracing a single op, with
  ``ValueError: code: co_varnames is too small``: HF wraps ``forward`` in decorators
  taking ``*args, **kwargs`` and FX cannot patch that code object. (Past that, HF's
  forward also branches on inputs and config in Python.)
* ``torch.export.export(model, (input_ids,), strict=False)`` works with both
  ``attn_implementation="eager"`` (the default here) and ``"sdpa"``; with ``"sdpa"``
  the graph is smaller (one ``aten.scaled_dot_product_attention`` per layer instead of
  matmul/softmax/where). The exported graph also contains HF's causal-mask construction
  (``arange``/``cumsum``/``diff``/``index``/``le`` on integer tensors) and
  ``aten.dropout`` nodes with ``p=0.0`` (the model is in train mode).
* ``use_cache=False`` keeps the output to just ``logits``; with ``use_cache=True`` the
  forward would also build and return a KV cache.
* The output is a ``CausalLMOutputWithCrossAttentions`` (a dict-like ``ModelOutput``)
  whose only field is ``logits``; the exported program returns it as a one-element
  output.
* Only ``input_ids`` is safe to pass positionally: in transformers 5.x the second
  positional parameter of ``GPT2LMHeadModel.forward`` is the KV cache, not the
  attention mask. Use :func:`build_with_labels` for a module whose
  ``forward(input_ids, labels)`` returns HF's language-modelling loss.
* ``lm_head.weight`` is tied to ``transformer.wte.weight`` (GPT-2's default): one
  Parameter, two ``state_dict`` keys.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_INSTALL_HINT = (
    "examples/hf_gpt2.py needs the 'transformers' package: pip install transformers "
    "(or install this project's 'hf' extra: pip install -e .[hf])"
)


def _make_gpt2(
    *, seq_len: int, n_layer: int, n_head: int, n_embd: int, vocab_size: int, attn_implementation: str
) -> nn.Module:
    """Build a randomly initialised ``GPT2LMHeadModel`` in train mode (never downloads)."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:  # pragma: no cover - exercised only without transformers
        raise ImportError(_INSTALL_HINT) from e

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=seq_len,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,  # no dropout: keeps the model deterministic
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,  # no KV cache in the output
        bos_token_id=vocab_size - 1,  # GPT-2's default (50256) is outside a small vocab
        eos_token_id=vocab_size - 1,
        attn_implementation=attn_implementation,
    )
    model = GPT2LMHeadModel(config)
    # Name the loss explicitly; otherwise transformers warns that loss_type=None is
    # unrecognised before falling back to the same causal-LM loss.
    model.loss_type = "ForCausalLM"
    return model.train()


class GPT2WithLabels(nn.Module):
    """Thin wrapper whose ``forward(input_ids, labels)`` returns GPT-2's LM loss.

    Args:
        gpt2: A ``transformers.GPT2LMHeadModel``; stored as ``self.gpt2``, so
            ``state_dict`` keys are the HF keys prefixed with ``gpt2.``.
    """

    def __init__(self, gpt2: nn.Module) -> None:
        super().__init__()
        self.gpt2 = gpt2

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Compute the causal language-modelling loss.

        Args:
            input_ids: Token ids of shape ``(batch, seq_len)``, dtype int64.
            labels: Target ids of shape ``(batch, seq_len)``; HF shifts them by one
                position internally, so ``labels = input_ids`` is the usual choice.

        Returns:
            The scalar mean cross-entropy loss.
        """
        out: Any = self.gpt2(input_ids=input_ids, labels=labels)
        return out.loss


def build(
    *,
    batch: int = 2,
    seq_len: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 128,
    vocab_size: int = 512,
    seed: int = 0,
    attn_implementation: str = "eager",
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build a small random-weight ``GPT2LMHeadModel`` and example token ids.

    Args:
        batch: Batch size of the example input.
        seq_len: Sequence length of the example input (also ``n_positions``).
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block (must divide ``n_embd``).
        n_embd: Width of the residual stream.
        vocab_size: Number of token ids.
        seed: Seed for ``torch.manual_seed``; the same seed gives identical
            parameters and inputs.
        attn_implementation: ``"eager"`` (default) or ``"sdpa"``; both export with
            ``torch.export.export(..., strict=False)``. Eager is the default because under
            export HF's sdpa path builds an explicit causal mask that eager execution does
            not, so the exported graph saves ``n_layer * B * T * T * 4`` bytes more than the
            eager model; with eager attention both save the same.

    Returns:
        ``(model, (input_ids,))``: a ``GPT2LMHeadModel`` in train mode whose
        ``model(input_ids)`` returns a ``ModelOutput`` with ``logits`` of shape
        ``(batch, seq_len, vocab_size)``, and int64 token ids of shape
        ``(batch, seq_len)``.

    Raises:
        ImportError: If ``transformers`` is not installed.
    """
    torch.manual_seed(seed)
    model = _make_gpt2(
        seq_len=seq_len,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        vocab_size=vocab_size,
        attn_implementation=attn_implementation,
    )
    input_ids = torch.randint(0, vocab_size, (batch, seq_len), dtype=torch.long)
    return model, (input_ids,)


def build_with_labels(
    *,
    batch: int = 2,
    seq_len: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 128,
    vocab_size: int = 512,
    seed: int = 0,
    attn_implementation: str = "eager",
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Like :func:`build`, but the model returns HF's scalar language-modelling loss.

    Args:
        batch: Batch size of the example inputs.
        seq_len: Sequence length of the example inputs (also ``n_positions``).
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block (must divide ``n_embd``).
        n_embd: Width of the residual stream.
        vocab_size: Number of token ids.
        seed: Seed for ``torch.manual_seed``; the same seed gives the same parameters
            as :func:`build` with that seed, and the same ``input_ids``.
        attn_implementation: ``"eager"`` (default) or ``"sdpa"``.

    Returns:
        ``(model, (input_ids, labels))``: a :class:`GPT2WithLabels` in train mode whose
        ``model(input_ids, labels)`` is the scalar loss, with ``labels`` a copy of
        ``input_ids`` (HF shifts labels internally).

    Raises:
        ImportError: If ``transformers`` is not installed.
    """
    gpt2, (input_ids,) = build(
        batch=batch,
        seq_len=seq_len,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        vocab_size=vocab_size,
        seed=seed,
        attn_implementation=attn_implementation,
    )
    return GPT2WithLabels(gpt2).train(), (input_ids, input_ids.clone())


def build_12_layers() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """GPT-2 with 12 layers at the other defaults: the recorded ``graphs/hf_gpt2_12l.json``
    (``scheduler profile examples/hf_gpt2.py:build_12_layers --out graphs/hf_gpt2_12l.json``),
    the size the solver benchmarks use."""
    return build(n_layer=12)
