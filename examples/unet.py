"""A small U-Net with BatchNorm and skip connections: a DAG, not a chain.

The encoder's feature maps at each resolution are kept alive until the matching decoder
level concatenates them (``torch.cat`` skip connections), so activation memory is not
the simple running sum of a chain: this is the example to try a scheduler on a graph
with long-lived branches.

Layout (``base`` channels ``b``, input ``size`` ``s``, which must be divisible by 8)::

    down[0]  DoubleConv          c  -> b    at s        --- skip ---------------+
    down[1]  MaxPool + DoubleConv b -> 2b   at s/2      --- skip ----------+    |
    down[2]  MaxPool + DoubleConv 2b -> 4b  at s/4      --- skip ----+     |    |
    mid      MaxPool + DoubleConv 4b -> 8b  at s/8                   |     |    |
    up[0]    ConvTranspose 8b -> 4b, cat skip, DoubleConv -> 4b  <---+     |    |
    up[1]    ConvTranspose 4b -> 2b, cat skip, DoubleConv -> 2b  <---------+    |
    up[2]    ConvTranspose 2b -> b,  cat skip, DoubleConv -> b   <--------------+
    out      1x1 Conv b -> classes

Each ``DoubleConv`` is (Conv2d 3x3 - BatchNorm2d - ReLU) twice. ReLUs are not in-place,
so no recorded activation is overwritten. In train mode BatchNorm updates its running
statistics in place on every forward, so recomputing a BatchNorm forward (as activation
checkpointing does) updates them again. ``torch.fx.symbolic_trace`` works; every layer
is a leaf ``call_module`` node whose name (``down.1.pool``, ``up.0.conv.net.3``, ...)
gives the block it belongs to.

Run it with the CLI::

    scheduler profile examples/unet.py:build --out graphs/unet.json
"""

from __future__ import annotations

import torch
from torch import nn


class DoubleConv(nn.Module):
    """(Conv2d 3x3 - BatchNorm2d - ReLU) twice; keeps the spatial size.

    Args:
        in_ch: Input channels.
        out_ch: Output channels.
    """

    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_ch, out_ch, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(),
            nn.Conv2d(out_ch, out_ch, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(N, in_ch, H, W)`` to ``(N, out_ch, H, W)``."""
        return self.net(x)


class Down(nn.Module):
    """Encoder level: 2x2 max-pooling, then a :class:`DoubleConv`.

    Args:
        in_ch: Input channels.
        out_ch: Output channels.
    """

    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__()
        self.pool = nn.MaxPool2d(2)
        self.conv = DoubleConv(in_ch, out_ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(N, in_ch, H, W)`` to ``(N, out_ch, H/2, W/2)``."""
        return self.conv(self.pool(x))


class Up(nn.Module):
    """Decoder level: 2x transposed-conv upsampling, concatenation with the skip
    connection, then a :class:`DoubleConv`.

    Args:
        in_ch: Input channels (twice the skip connection's channels).
        out_ch: Output channels.
    """

    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(in_ch, in_ch // 2, kernel_size=2, stride=2)
        self.conv = DoubleConv(in_ch // 2 + out_ch, out_ch)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        """Upsample ``x`` and fuse it with ``skip``.

        Args:
            x: Decoder input of shape ``(N, in_ch, H, W)``.
            skip: Encoder features of shape ``(N, out_ch, 2H, 2W)``.

        Returns:
            Tensor of shape ``(N, out_ch, 2H, 2W)``.
        """
        x = self.up(x)  # (N, in_ch/2, 2H, 2W)
        x = torch.cat([skip, x], dim=1)  # (N, out_ch + in_ch/2, 2H, 2W)
        return self.conv(x)


class UNet(nn.Module):
    """U-Net with three pooling levels.

    Args:
        channels: Input image channels.
        classes: Output channels (per-pixel class logits).
        base: Channels at full resolution; doubled at every level down.
    """

    def __init__(self, channels: int = 3, classes: int = 2, base: int = 16) -> None:
        super().__init__()
        b = base
        self.down = nn.ModuleList(
            [
                DoubleConv(channels, b),  # (N, b, s, s)
                Down(b, 2 * b),  # (N, 2b, s/2, s/2)
                Down(2 * b, 4 * b),  # (N, 4b, s/4, s/4)
            ]
        )
        self.mid = Down(4 * b, 8 * b)  # (N, 8b, s/8, s/8)
        self.up = nn.ModuleList(
            [
                Up(8 * b, 4 * b),  # (N, 4b, s/4, s/4)
                Up(4 * b, 2 * b),  # (N, 2b, s/2, s/2)
                Up(2 * b, b),  # (N, b, s, s)
            ]
        )
        self.out = nn.Conv2d(b, classes, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Segment an image batch.

        Args:
            x: Images of shape ``(N, channels, H, W)`` with ``H`` and ``W`` divisible
                by 8.

        Returns:
            Per-pixel logits of shape ``(N, classes, H, W)``.
        """
        skips = []
        for down in self.down:
            x = down(x)
            skips.append(x)
        x = self.mid(x)
        for up, skip in zip(self.up, reversed(skips)):
            x = up(x, skip)
        return self.out(x)


def build(
    *, batch: int = 4, channels: int = 3, size: int = 64, base: int = 16, classes: int = 2, seed: int = 0
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build a U-Net and a random image batch.

    Args:
        batch: Batch size of the example input.
        channels: Input image channels.
        size: Height and width of the example images (must be divisible by 8).
        base: Channels at full resolution (the bottleneck has ``8 * base``).
        classes: Output channels.
        seed: Seed for ``torch.manual_seed``; the same seed gives identical
            parameters and inputs.

    Returns:
        ``(model, (x,))`` where ``model`` is a :class:`UNet` in train mode returning
        logits of shape ``(batch, classes, size, size)``, and ``x`` is a float tensor
        of shape ``(batch, channels, size, size)``.

    Raises:
        ValueError: If ``size`` is not divisible by 8.
    """
    if size % 8 != 0:
        raise ValueError(f"size must be divisible by 8 (three 2x2 poolings), got {size}")
    torch.manual_seed(seed)
    model = UNet(channels=channels, classes=classes, base=base).train()
    x = torch.randn(batch, channels, size, size)
    return model, (x,)
