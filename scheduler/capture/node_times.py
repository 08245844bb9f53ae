"""Node times for a fake profile without running the whole step (placeholder; see below)."""

from __future__ import annotations

__all__ = ["isolated_times", "scaled_times"]


def isolated_times(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    raise NotImplementedError("times='isolated' is not implemented yet; use times='roofline'")


def scaled_times(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    raise NotImplementedError("times='scaled' is not implemented yet; use times='roofline'")
