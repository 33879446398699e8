"""Flat (all-parameter) per-sample clipping."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def per_sample_squared_norms(grad_samples: Iterable[torch.Tensor], batch_size: int) -> torch.Tensor:
    """Squared L2 norm (fp32, shape (B,)) of each sample's gradient over all given per-sample tensors.

    Returning squared norms lets shards of one gradient (other layers, other context-parallel ranks) be summed
    before the square root.
    """
    total: torch.Tensor | None = None
    for grad_sample in grad_samples:
        squared = torch.linalg.vector_norm(grad_sample.flatten(1), dim=1, dtype=torch.float32).square()
        total = squared if total is None else total + squared
    if total is None:
        raise ValueError("No per-sample gradients were captured: does the model have trainable parameters?")
    if total.shape != (batch_size,):
        raise RuntimeError(f"Per-sample gradients have batch size {total.shape[0]}, expected {batch_size}.")
    return total


def clip_factors(squared_norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """``min(1, C / ||g_i||)`` per sample, so every clipped gradient has norm at most ``C``."""
    norms = squared_norms.sqrt()
    return torch.where(norms > max_grad_norm, max_grad_norm / norms, torch.ones_like(norms))
