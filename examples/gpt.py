"""A nanoGPT-style GPT decoder in plain PyTorch, in one readable file.

Modelled on Andrej Karpathy's nanoGPT ``model.py``: token + position embeddings, a stack
of pre-norm transformer blocks (``self.transformer.h``), a final LayerNorm and a language
model head tied to the token embedding. Dropout is on by default (``dropout=0.1``), so the
graph contains random ops (``nn.Dropout`` modules and the dropout inside
``scaled_dot_product_attention``) that a recomputation schedule has to replay faithfully.

Tracing notes:

* ``torch.fx.symbolic_trace(model)`` works. ``self.training`` is a plain Python bool, so
  ``dropout_p=self.dropout if self.training else 0.0`` is resolved at trace time and the
  traced graph bakes the constant in (``dropout_p=0.1`` in train mode); trace again after
  switching ``train()``/``eval()``. ``nn.Dropout`` modules stay leaf ``call_module`` nodes
  and ``F.scaled_dot_product_attention`` becomes one ``call_function`` node.
* ``forward(idx, targets=None)`` keeps nanoGPT's signature. ``symbolic_trace`` passes a
  Proxy for every argument, including ``targets``, so ``targets is None`` is ``False``
  during tracing and the traced graph always computes (and returns) the loss. For logits,
  call :meth:`GPT.logits` (or ``model(idx)`` eagerly).
* No shape assertions or other Python control flow on tensor values: heads are split
  with ``unflatten``/``flatten`` using Python ints from the config (so the blocks have no
  ``size()`` plumbing in the graph), and positions come from ``torch.arange`` on the
  traced sequence length. LayerNorms are ``nn.LayerNorm(..., bias=config.bias)`` leaf
  modules rather than nanoGPT's hand-written class.
* ``lm_head.weight`` and ``transformer.wte.weight`` are one tied Parameter: it appears
  once in ``parameters()`` but under two keys in ``state_dict()``.

Run it with the CLI::

    scheduler profile examples/gpt.py:build --out graphs/gpt.json
"""

# No ``from __future__ import annotations`` here: with string annotations, ``@dataclass``
# looks the defining module up in ``sys.modules``, which fails (AttributeError on
# Python 3.11) when this file is loaded by path with ``importlib.util`` and not registered
# there, as ``scheduler profile examples/gpt.py:build`` may do.
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    """Hyper-parameters of the GPT model."""

    block_size: int = 64  # maximum sequence length (context window)
    vocab_size: int = 512  # number of token ids
    n_layer: int = 4  # number of transformer blocks
    n_head: int = 4  # attention heads per block
    n_embd: int = 128  # width of the residual stream
    dropout: float = 0.1  # dropout probability (embeddings, attention, residuals)
    bias: bool = True  # bias in Linears and LayerNorms (False: a bit faster and better)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention using ``F.scaled_dot_product_attention``.

    Args:
        config: Model configuration; ``n_embd`` must be divisible by ``n_head``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # regularisation
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.head_size = config.n_embd // config.n_head
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over the sequence with a causal mask.

        Args:
            x: Input of shape ``(B, T, C)``: batch size, sequence length, ``n_embd``.

        Returns:
            Output of shape ``(B, T, C)``.
        """
        nh, hs = self.n_head, self.head_size  # Python ints: no shape arithmetic in the graph

        # calculate query, key, values for all heads in batch and move head forward to be the batch dim
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        k = k.unflatten(2, (nh, hs)).transpose(1, 2)  # (B, nh, T, hs)
        q = q.unflatten(2, (nh, hs)).transpose(1, 2)  # (B, nh, T, hs)
        v = v.unflatten(2, (nh, hs)).transpose(1, 2)  # (B, nh, T, hs)

        # causal self-attention; (B, nh, T, hs) x (B, nh, hs, T) -> (B, nh, T, T) -> (B, nh, T, hs)
        # self.training is a Python bool: symbolic tracing resolves it to a constant.
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).flatten(2)  # re-assemble all head outputs side by side: (B, T, C)

        # output projection
        y = self.resid_dropout(self.c_proj(y))  # (B, T, C)
        return y


class MLP(nn.Module):
    """Position-wise feed-forward network: Linear(4x) - GELU - Linear - Dropout.

    Args:
        config: Model configuration.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``x`` of shape ``(B, T, C)``; returns ``(B, T, C)``."""
        x = self.c_fc(x)  # (B, T, 4C)
        x = self.gelu(x)  # (B, T, 4C)
        x = self.c_proj(x)  # (B, T, C)
        x = self.dropout(x)  # (B, T, C)
        return x


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``.

    Args:
        config: Model configuration.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` of shape ``(B, T, C)``; returns ``(B, T, C)``."""
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class GPT(nn.Module):
    """GPT language model (decoder-only transformer).

    Args:
        config: Model configuration.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.vocab_size is not None
        assert config.block_size is not None
        self.config = config

        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),  # token embeddings
                wpe=nn.Embedding(config.block_size, config.n_embd),  # position embeddings
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # weight tying (https://paperswithcode.com/method/weight-tying): one Parameter
        # used by both the token embedding and the output head
        self.transformer.wte.weight = self.lm_head.weight

        # init all weights
        self.apply(self._init_weights)
        # apply special scaled init to the residual projections, per GPT-2 paper
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Return the number of parameters (the tied weight is counted once).

        Args:
            non_embedding: Subtract the position embeddings (the token embeddings are
                kept because they are tied to ``lm_head``).

        Returns:
            The parameter count.
        """
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Compute next-token logits at every position.

        Args:
            idx: Token ids of shape ``(B, T)`` with ``T <= block_size``, dtype int64.

        Returns:
            Logits of shape ``(B, T, vocab_size)``.
        """
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)  # (T,)

        # forward the GPT model itself
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (B, T, C)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (T, C)
        x = self.transformer.drop(tok_emb + pos_emb)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)  # (B, T, C)
        x = self.transformer.ln_f(x)  # (B, T, C)
        return self.lm_head(x)  # (B, T, vocab_size)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Run the model.

        Args:
            idx: Token ids of shape ``(B, T)``, dtype int64.
            targets: Optional target ids of shape ``(B, T)``; ``-1`` entries are ignored.

        Returns:
            The scalar mean cross-entropy loss if ``targets`` is given, otherwise the
            logits of shape ``(B, T, vocab_size)``. Under ``torch.fx.symbolic_trace``
            ``targets`` is always a Proxy, so the traced graph returns the loss.
        """
        logits = self.logits(idx)  # (B, T, vocab_size)
        if targets is None:
            return logits
        # (B*T, vocab_size) against (B*T,) -> scalar
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)


def build(
    *,
    batch: int = 4,
    block_size: int = 64,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 128,
    vocab_size: int = 512,
    dropout: float = 0.1,
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build a GPT model and random example tokens and targets.

    Args:
        batch: Batch size of the example inputs.
        block_size: Context length; the example sequences have exactly this length.
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block (must divide ``n_embd``).
        n_embd: Width of the residual stream.
        vocab_size: Number of token ids.
        dropout: Dropout probability (``0.0`` makes the model deterministic).
        seed: Seed for ``torch.manual_seed``; the same seed gives identical
            parameters and inputs.

    Returns:
        ``(model, (idx, targets))``: a :class:`GPT` in train mode whose
        ``model(idx, targets)`` is the scalar cross-entropy loss, and two int64
        tensors of shape ``(batch, block_size)`` with values in ``[0, vocab_size)``.
    """
    torch.manual_seed(seed)
    config = GPTConfig(
        block_size=block_size,
        vocab_size=vocab_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        dropout=dropout,
    )
    model = GPT(config).train()
    idx = torch.randint(0, vocab_size, (batch, block_size), dtype=torch.long)
    targets = torch.randint(0, vocab_size, (batch, block_size), dtype=torch.long)
    return model, (idx, targets)
