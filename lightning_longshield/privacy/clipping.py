"""Per-sample squared norms and clipping factors, with a bound that holds after floating-point rounding."""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable
from typing import Optional

import torch

# Clipped gradients are scaled to C * (1 - CLIP_MARGIN) rather than C: the margin absorbs the rounding of the
# per-sample norms (blocked, below 2^-19 relative: see NORM_BLOCK) and of the fp32 product (2^-24), so every sample's
# contribution to the clipped sum, as computed, has norm <= C in every precision. The factor itself is rounded toward
# zero (`clip_factors`, `factors_toward_zero`), never up: a relative margin cannot absorb the rounding of a factor in
# the subnormal range, which is up to 2x. The effect on the update is a relative 4e-6, far below any training signal.
CLIP_MARGIN = 2.0**-18


# Per-sample squared norms are sums of squares over blocks of NORM_BLOCK elements in fp32 (consecutive or strided:
# `strided_blocks`), then over the blocks in fp64. A sum of n non-negative rounded terms is off by at most about
# (n + 1) 2^-24 relative in *any* summation order, so a block's squared norm is within 65 * 2^-24 and the norm within
# 2^-19, whatever order the device's reduction kernel uses. One fp32 reduction over a whole tensor has no such bound:
# on CPU it is off by 3e-5 relative at 10^6 elements and 2e-3 at 1.6 * 10^7, which would let a clipped contribution
# exceed C.
NORM_BLOCK = 64

# Sizes not quoted: under Poisson sampling a micro-batch's size is a value of the private data.
NOT_BATCH_FIRST = (
    "Per-sample gradients do not have the micro-batch's samples along their first dimension: every trainable layer"
    " must take its input batch-first, the samples along dimension 0 (not (T, B, d): transpose it, or use"
    " batch_first=True), and be applied to every sample of the micro-batch (not to a selection such as"
    " layer(h[mask]), nor to an input shared by the batch such as a positional table looked up with"
    " torch.arange(T)[None]: expand it to (B, T))."
)


# Per-sample gradients have their parameter's dtype; their norms are fp32 reductions, which read these exactly.
CLIPPABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_clippable_dtypes(parameters: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Raise a `ValueError` naming the trainable parameters whose dtype the clipping cannot reduce (fp64: an fp32
    norm of fp64 values would narrow them, which torch refuses in the first micro-batch), with the fix."""
    found = [f"{name} ({p.dtype})" for name, p in parameters if p.requires_grad and p.dtype not in CLIPPABLE_DTYPES]
    if found:
        shown = "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
        raise ValueError(
            "DP-SGD clips trainable parameters in fp32, bf16 or fp16, but these have another dtype: " + shown + "."
            " Keep the parameters in fp32 (model.float()) and choose lower precision with the Trainer's precision"
            " setting (precision='bf16-mixed' or 'bf16-true')."
        )


def per_sample_squared_norms(grad_samples: Iterable[torch.Tensor], batch_size: int) -> torch.Tensor:
    """Squared L2 norm (fp64, shape (B,)) of each sample's gradient over all given per-sample tensors.

    Blocked (see ``NORM_BLOCK``): one reduction per tensor into fp32 block norms, then one fp64 sum of squares over
    the blocks of all tensors together (not a few small reductions per tensor). Returning squared norms lets shards
    of one gradient (other context-parallel ranks) be summed before the root.
    """
    return _sum_of_squares(torch.cat(_block_norms_of(grad_samples, batch_size), dim=1))


def per_parameter_squared_norms(grad_samples: Iterable[torch.Tensor], batch_size: int) -> torch.Tensor:
    """Squared L2 norm (fp64, shape (P, B)) of each sample's gradient in each of the P given per-sample tensors,
    blocked as `per_sample_squared_norms`."""
    rows = [_sum_of_squares(blocks) for blocks in _block_norms_of(grad_samples, batch_size)]
    return rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(rows)  # one tensor (per-layer clipping): a view


def _block_norms_of(grad_samples: Iterable[torch.Tensor], batch_size: int) -> list[torch.Tensor]:
    """fp32 block norms ``(B, K_p)`` of each per-sample tensor: fp32 products even for bf16 / fp16 gradients (exact
    for them), without an fp32 copy of more than one sample's gradient at a time."""
    tensors = list(grad_samples)
    if not tensors:
        raise ValueError("No per-sample gradients were captured: does the model have trainable parameters?")
    sizes = {t.shape[0] for t in tensors}
    if sizes != {batch_size}:
        raise RuntimeError(NOT_BATCH_FIRST)
    return [_block_norms(t.reshape(batch_size, -1)) for t in tensors]


def _sum_of_squares(block_norms: torch.Tensor) -> torch.Tensor:
    """``(B, K)`` fp32 block norms -> ``(B,)`` fp64 sums of their squares."""
    return block_norms.double().square_().sum(1)


def _block_norms(rows: torch.Tensor) -> torch.Tensor:
    """fp32 norms ``(B, K)`` of the rows' blocks; lower-precision rows one at a time where the reduction copies its
    input to fp32 first (a copy of one sample, not of all), else all at once (a launch per sample fewer)."""
    if rows.dtype != torch.float32 and not reads_low_precision_directly(rows.device):
        return torch.cat([_block_norms_fp32(row.unsqueeze(0)) for row in rows])
    return _block_norms_fp32(rows)


def reads_low_precision_directly(device: torch.device) -> bool:
    """Whether an fp32 reduction of bf16 or fp16 values reads them as they are: CUDA's accumulates them in fp32
    directly, other devices' first copy the whole input to fp32."""
    return device.type == "cuda"


def strided_blocks(device: torch.device) -> bool:
    """Whether a norm block is NORM_BLOCK elements ``numel / NORM_BLOCK`` apart (one thread per block, coalesced
    across blocks: a GPU's reduction over rows of 64 spends a warp's shuffles per block) rather than NORM_BLOCK
    consecutive elements (what CPU reductions run fastest, 25x faster than strided). Any NORM_BLOCK elements make a
    block: the bound is the same."""
    return device.type != "cpu"


def _block_norms_fp32(rows: torch.Tensor) -> torch.Tensor:
    """fp32 norms ``(B, K)`` of blocks of NORM_BLOCK elements of each row, the last of fewer where the row's length
    is not a multiple (``K = 0`` for an empty row)."""
    batch, numel = rows.shape
    whole = numel - numel % NORM_BLOCK
    parts = []
    if whole:
        whole_rows = rows if whole == numel else rows[:, :whole]  # no slice op where none is needed (the usual case)
        if strided_blocks(rows.device):
            blocks, within = whole_rows.reshape(batch, NORM_BLOCK, whole // NORM_BLOCK), 1
        else:
            blocks, within = whole_rows.reshape(batch, whole // NORM_BLOCK, NORM_BLOCK), 2
        parts.append(torch.linalg.vector_norm(blocks, dim=within, dtype=torch.float32))
    if whole < numel:
        parts.append(torch.linalg.vector_norm(rows[:, whole:], dim=1, keepdim=True, dtype=torch.float32))
    if not parts:  # an empty tensor
        return torch.zeros(batch, 0, dtype=torch.float32, device=rows.device)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def clip_factors(
    squared_norms: torch.Tensor,
    max_grad_norm: float | torch.Tensor,
    margin: float = CLIP_MARGIN,
    rounding: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``min(1, C' / ||g_i||)`` per sample with ``C' = C (1 - margin)``, in ``dtype`` (fp32, or fp64 for book-kept
    sums, which scale in fp64): clipped norms are at most ``C``.

    Every factor is rounded toward zero, never up: the quotient is formed in fp64 and stepped down one unit in the
    last place (round-to-nearest is within half of one, also among subnormals), and the fp32 factor is the largest
    fp32 value not above that (`factors_toward_zero`). A factor in fp32's subnormal range (a norm above about
    ``10^38 C``) rounded to nearest could be up to twice the exact one, far beyond what ``margin`` absorbs.

    ``max_grad_norm`` may be a tensor broadcasting against ``squared_norms`` (per-layer bounds). ``rounding``: per
    sample, a bound on how far what is added for a sample can be from ``c_i g_i`` per unit factor (book-kept sums);
    it is added to the norm, so the contribution as computed stays within ``C'``.

    A sample whose norm is not finite (an inf or NaN in its gradient, or squares past fp64's range) gets factor 0:
    its contribution is zero, a valid clipping (norm 0 <= C). Every path that adds ``factor x gradient`` makes that
    product exactly zero even where the gradient holds inf or NaN (`zero_non_finite_`), so one sample cannot turn
    the released sum into NaN, an event the noise would not cover.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"Clip factors are fp32 or fp64, not {dtype}.")
    if not 0 <= margin < 1:  # a margin of 1 or more would make every bound 0 or negative
        raise ValueError(f"A clipping margin is in [0, 1), not {margin}.")
    norms = squared_norms.double().sqrt()
    if rounding is not None:
        norms = norms + rounding
    bound = max_grad_norm * (1 - margin)
    quotients = (bound / norms).nan_to_num_(nan=0.0)  # bound / inf = 0
    quotients = torch.nextafter(quotients, torch.zeros_like(quotients))  # toward zero: at most the exact quotient
    factors = torch.where(norms <= bound, torch.ones_like(norms), quotients)  # a NaN norm is not <= bound: 0
    return factors if dtype == torch.float64 else factors_toward_zero(factors)


def clip_factor(norm: float, max_grad_norm: float, margin: float = CLIP_MARGIN) -> float:
    """`clip_factors` of one sample, on the host: the same fp64 operations in Python's floats, so the same fp32
    factor bit for bit (tested). ``norm`` is the sample's norm as torch computes it from the fp64 squared norm
    (``squared_norms.sqrt()``: torch's fp64 square root is not always correctly rounded, `math.sqrt` is, so they can
    differ in the last place). For CPU tensors of a few samples, where a dozen tensor ops on them cost more than the
    arithmetic (per-layer clipping computes factors once per parameter and micro-batch)."""
    bound = max_grad_norm * (1 - margin)
    if norm <= bound:
        return 1.0
    if math.isnan(norm):
        return 0.0
    return _fp32_toward_zero(math.nextafter(bound / norm, 0.0))  # norm > bound >= 0: no division by zero


def _fp32_toward_zero(value: float) -> float:
    """The largest fp32 value at most ``value`` (>= 0), as `factors_toward_zero` rounds."""
    rounded = struct.unpack("<f", struct.pack("<f", value))[0]  # to nearest, as a conversion to fp32
    if rounded <= value:
        return rounded
    bits = struct.unpack("<I", struct.pack("<f", rounded))[0]
    return struct.unpack("<f", struct.pack("<I", bits - 1))[0]  # one fp32 step toward zero (rounded > 0)


def factors_toward_zero(factors: torch.Tensor) -> torch.Tensor:
    """fp32 ``factors`` (non-negative) with every value rounded toward zero: the largest fp32 value at most the given
    one (fp64 or fp32). A plain conversion rounds to nearest, which for a subnormal can double the value."""
    if factors.dtype == torch.float32:
        return factors
    rounded = factors.float()
    above = rounded.double() > factors
    return torch.where(above, torch.nextafter(rounded, torch.zeros_like(rounded)), rounded)


def zero_non_finite_(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with every inf and NaN set to 0, in place. Applied to per-sample values whose sample has factor 0
    (`clip_factors`: only such samples can hold them), it makes that sample's contribution exactly zero, where
    ``0 x inf`` would be NaN; finite samples are untouched."""
    return tensor.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
