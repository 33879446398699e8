"""Per-sample squared norms and clipping factors, with a bound that holds after floating-point rounding."""

from __future__ import annotations

from collections.abc import Iterable

import torch

# Clipped gradients are scaled to C * (1 - CLIP_MARGIN) rather than C: the margin absorbs the rounding of the fp32
# per-tensor squared norms (relative error below log2(n) * 2^-24 for n <= 2^32 elements, i.e. under 2^-19) and of
# the fp32 factor and product (2^-24 each), so every sample's contribution to the clipped sum, as computed, has
# norm <= C in every precision. The effect on the update is a relative 4e-6, far below any training signal.
CLIP_MARGIN = 2.0**-18


def per_sample_squared_norms(grad_samples: Iterable[torch.Tensor], batch_size: int) -> torch.Tensor:
    """Squared L2 norm (fp64, shape (B,)) of each sample's gradient over all given per-sample tensors.

    Returning squared norms lets shards of one gradient (other context-parallel ranks) be summed before the root.
    """
    return per_parameter_squared_norms(grad_samples, batch_size).sum(0)


def per_parameter_squared_norms(grad_samples: Iterable[torch.Tensor], batch_size: int) -> torch.Tensor:
    """Squared L2 norm (fp64, shape (P, B)) of each sample's gradient in each of the P given per-sample tensors.

    One batched pass: a single `torch._foreach_norm` over every (tensor, sample) slice (fp32 accumulation whatever
    the dtype; one multi-tensor kernel per chunk of slices on CUDA), then the per-slice results are squared in fp64.
    """
    tensors = list(grad_samples)
    if not tensors:
        raise ValueError("No per-sample gradients were captured: does the model have trainable parameters?")
    sizes = {t.shape[0] for t in tensors}
    if sizes != {batch_size}:
        raise RuntimeError(f"Per-sample gradients have batch sizes {sorted(sizes)}, expected {batch_size}.")
    slices = [t[i] for t in tensors for i in range(batch_size)]
    norms = torch.stack(torch._foreach_norm(slices, 2, dtype=torch.float32))
    return norms.view(len(tensors), batch_size).double().square()


def clip_factors(squared_norms: torch.Tensor, max_grad_norm: float, margin: float = CLIP_MARGIN) -> torch.Tensor:
    """fp32 ``min(1, C' / ||g_i||)`` per sample with ``C' = C (1 - margin)``: clipped norms are at most ``C``."""
    norms = squared_norms.double().sqrt()
    bound = max_grad_norm * (1 - margin)
    return torch.where(norms > bound, bound / norms, torch.ones_like(norms)).float()
