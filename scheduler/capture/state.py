"""The user's model and random numbers as they were: what profiling and tracing put back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["preserved_state"]


@contextlib.contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Restore the model's buffers (e.g. BatchNorm running statistics), parameters' ``.grad``
    and RNG state (the CPU's, and every CUDA device's where CUDA is initialized: dropout
    on a GPU draws from its generator) on exit, so that profiling and tracing leave the
    user's model, and the random numbers its training draws next, as they were."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads:
            p.grad = g
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
