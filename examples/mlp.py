"""A stack of residual MLP blocks: the simplest example, a pure chain.

Every block computes ``x + fc2(gelu(fc1(layernorm(x))))``, so the computation graph is a
linear chain of identical blocks with one residual edge inside each. This is the
textbook setting for activation checkpointing and a good first model to try the
scheduler on.

Run it with the CLI::

    scheduler profile examples/mlp.py:build --out graphs/mlp.json
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm residual MLP block: ``x + fc2(gelu(fc1(layernorm(x))))``.

    Args:
        dim: Width of the residual stream.
        hidden: Width of the hidden layer (defaults to ``4 * dim``).
    """

    def __init__(self, dim: int, hidden: int | None = None) -> None:
        super().__init__()
        hidden = 4 * dim if hidden is None else hidden
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block.

        Args:
            x: Input of shape ``(batch, dim)``.

        Returns:
            Output of shape ``(batch, dim)``.
        """
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    """A chain of :class:`Block` modules followed by a LayerNorm and a linear head.

    Args:
        dim: Width of the residual stream (also the input width).
        depth: Number of residual blocks.
        out_dim: Output width of the head (defaults to ``dim``).
    """

    def __init__(self, dim: int, depth: int, out_dim: int | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, dim if out_dim is None else out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run all blocks, the final norm and the head.

        Args:
            x: Input of shape ``(batch, dim)``.

        Returns:
            Head output of shape ``(batch, out_dim)``.
        """
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(
    *, batch: int = 512, dim: int = 256, depth: int = 8, seed: int = 0
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build a residual MLP and a random example input.

    Args:
        batch: Batch size of the example input.
        dim: Width of the residual stream (hidden layers are ``4 * dim`` wide).
        depth: Number of residual blocks.
        seed: Seed for ``torch.manual_seed``; the same seed gives identical
            parameters and inputs.

    Returns:
        ``(model, (x,))`` where ``model`` is a :class:`ResidualMLP` in train mode and
        ``x`` is a float tensor of shape ``(batch, dim)``.
    """
    torch.manual_seed(seed)
    model = ResidualMLP(dim, depth).train()
    x = torch.randn(batch, dim)
    return model, (x,)
