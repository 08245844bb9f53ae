"""A tiny Hugging Face Llama (``LlamaForCausalLM`` from a config, random weights, nothing
downloaded) for ``benchmarks/peers.py``: 4 layers, width 64, batch 2 x 128, SDPA attention,
the model issue 63's race names. A script helper: imported with ``benchmarks/`` on
``sys.path``; needs ``transformers``.
"""

from __future__ import annotations

import torch
from torch import nn


def build(*, batch: int = 2, seq_len: int = 128, n_layer: int = 4, hidden: int = 64,
          heads: int = 4, kv_heads: int = 2, vocab_size: int = 256,
          attn_implementation: str = "sdpa", seed: int = 0
          ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``(model, (input_ids,))``: a ``LlamaForCausalLM`` in train mode (no key/value cache,
    intermediate size twice the width) whose output's logits the race's default loss reads,
    and int64 token ids of shape ``(batch, seq_len)``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden,
                         intermediate_size=2 * hidden, num_hidden_layers=n_layer,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max(seq_len, 32), use_cache=False,
                         attn_implementation=attn_implementation, bos_token_id=0,
                         eos_token_id=0)
    model = LlamaForCausalLM(config).train()
    ids = torch.randint(1, vocab_size, (batch, seq_len),
                        generator=torch.Generator().manual_seed(seed + 1))
    return model, (ids,)
