"""Fused per-layer clipping of a linear layer's weight (FlashDP's idea, in Triton): no per-sample gradient in memory.

A sample's weight gradient is ``W_i = G_i^T A_i`` (``G_i``: ``(T, out)`` output gradients, ``A_i``: ``(T, in)``
inputs). Two kernels replace "materialise ``(B, out, in)``, take norms, scale, sum":

1. `_squared_norms_kernel`: one program per (sample, output tile, input tile) computes that tile of ``W_i`` in
   registers, token block by token block, squares it, sums each row of ``BLOCK_IN`` squares in fp32 and the rows in
   fp64, and adds the tile's share to the sample's fp64 squared norm with one atomic add (FlashDP's intra-block then
   inter-block reduction; the kernel's end is the synchronisation point before the clip factors are known). The
   blocking is `clipping.NORM_BLOCK`'s: a sum of 64 non-negative fp32 terms is within ``65 * 2^-24`` relative in any
   order, so the norm is within ``2^-19`` however many tiles a layer has and in whatever order the atomics land.
2. `_clipped_sum_kernel`: one program per (output tile, input tile) recomputes each sample's tile of ``W_i`` the
   same way, scales it by the sample's clip factor and adds it into the fp32 clipped sum, which it reads and writes
   once.

Both form tiles in fp32; fp32 inputs use exact IEEE products (``input_precision="ieee"``), never TF32, whose
rounding could lift a clipped contribution above its bound. The two kernels compute each tile with the same code on
the same inputs; should a compiler order their fp32 reductions over the ``T`` tokens differently, each is within
``T 2^-24`` of the exact sum for inputs without cancellation, which the caller's clipping margin also covers.
FLOPs: twice a weight gradient's (the tile is recomputed), as in FlashDP; memory: ``(B,)`` norms. Needs CUDA, or
``TRITON_INTERPRET=1`` (CPU tensors, for tests). The tile's output rows, token block and launch settings are a
`FusedTiles`, which a caller passes to both kernels alike; its input columns stay ``NORM_BLOCK``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lightning_longshield.privacy.clipping import NORM_BLOCK, factors_toward_zero

BLOCK_IN = NORM_BLOCK  # the fp32 row sums of squares are that long


@dataclass(frozen=True)
class FusedTiles:
    """The two kernels' tile: ``block_out`` output rows by ``BLOCK_IN`` input columns, formed ``block_tokens``
    tokens at a time, launched with ``num_warps`` and ``num_stages``. Pass the same one to both kernels: the norm
    and the clipped sum then form each tile with the same code, hence the same rounding."""

    block_out: int = 64
    block_tokens: int = 32
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_out", "block_tokens"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"FusedTiles({name}={value}): a power of two >= 16 (a tensor-core product's side).")
        if self.num_warps not in (1, 2, 4, 8, 16, 32) or self.num_stages < 1:
            raise ValueError(f"FusedTiles(num_warps={self.num_warps}, num_stages={self.num_stages}): num_warps a"
                             " power of two up to 32, num_stages >= 1.")

    def launch(self) -> dict[str, int]:
        """The kernels' tile constants and launch settings."""
        return dict(BLOCK_OUT=self.block_out, BLOCK_IN=BLOCK_IN, BLOCK_TOKENS=self.block_tokens,
                    num_warps=self.num_warps, num_stages=self.num_stages)


DEFAULT_TILES = FusedTiles()


@triton.jit
def _sample_tile(
    a_ptr, g_ptr, sample, offs_out, offs_in, tokens, n_out, n_in,
    stride_ab, stride_at, stride_ai, stride_gb, stride_gt, stride_go,
    BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr, BLOCK_TOKENS: tl.constexpr, PRECISION: tl.constexpr,
):
    """The ``(BLOCK_OUT, BLOCK_IN)`` tile of ``G_sample^T A_sample`` in fp32.

    Every offset is int64 (``offs_out`` and ``offs_in`` come as int64 from the kernels): Triton passes a stride below
    2^31 as int32, and ``t * stride_gt`` reaches ``T x out``, past 2^31 for an unchunked 128k-vocabulary head at
    T >= 16,744; ``out * stride_go`` does the same for a transposed gradient, and a weight past 2^31 elements
    overflows ``out * in``."""
    offs_t = tl.arange(0, BLOCK_TOKENS).to(tl.int64)
    sample = tl.cast(sample, tl.int64)
    g_sample, a_sample = g_ptr + sample * stride_gb, a_ptr + sample * stride_ab
    tile = tl.zeros((BLOCK_OUT, BLOCK_IN), dtype=tl.float32)
    for start in range(0, tokens, BLOCK_TOKENS):
        t = start + offs_t
        g = tl.load(g_sample + t[None, :] * stride_gt + offs_out[:, None] * stride_go,
                    mask=(t[None, :] < tokens) & (offs_out[:, None] < n_out), other=0.0)
        a = tl.load(a_sample + t[:, None] * stride_at + offs_in[None, :] * stride_ai,
                    mask=(t[:, None] < tokens) & (offs_in[None, :] < n_in), other=0.0)
        tile = tl.dot(g, a, tile, input_precision=PRECISION)
    return tile


@triton.jit
def _squared_norms_kernel(
    a_ptr, g_ptr, norms_ptr, tokens, n_out, n_in,
    stride_ab, stride_at, stride_ai, stride_gb, stride_gt, stride_go,
    BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr, BLOCK_TOKENS: tl.constexpr, PRECISION: tl.constexpr,
):
    sample = tl.program_id(0)
    offs_out = (tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)).to(tl.int64)
    offs_in = (tl.program_id(2) * BLOCK_IN + tl.arange(0, BLOCK_IN)).to(tl.int64)
    tile = _sample_tile(a_ptr, g_ptr, sample, offs_out, offs_in, tokens, n_out, n_in,
                        stride_ab, stride_at, stride_ai, stride_gb, stride_gt, stride_go,
                        BLOCK_OUT, BLOCK_IN, BLOCK_TOKENS, PRECISION)
    row_sums = tl.sum(tile * tile, axis=1)  # BLOCK_IN fp32 squares each
    tl.atomic_add(norms_ptr + sample, tl.sum(row_sums.to(tl.float64)))


@triton.jit
def _clipped_sum_kernel(
    a_ptr, g_ptr, factors_ptr, out_ptr, batch, tokens, n_out, n_in,
    stride_ab, stride_at, stride_ai, stride_gb, stride_gt, stride_go, stride_oo, stride_oi,
    BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr, BLOCK_TOKENS: tl.constexpr, PRECISION: tl.constexpr,
):
    offs_out = (tl.program_id(0) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)).to(tl.int64)
    offs_in = (tl.program_id(1) * BLOCK_IN + tl.arange(0, BLOCK_IN)).to(tl.int64)
    total = tl.zeros((BLOCK_OUT, BLOCK_IN), dtype=tl.float32)
    for sample in range(0, batch):
        tile = _sample_tile(a_ptr, g_ptr, sample, offs_out, offs_in, tokens, n_out, n_in,
                            stride_ab, stride_at, stride_ai, stride_gb, stride_gt, stride_go,
                            BLOCK_OUT, BLOCK_IN, BLOCK_TOKENS, PRECISION)
        factor = tl.load(factors_ptr + sample)
        # A sample with factor 0 may have inf or NaN tiles (0 x inf is NaN): it adds exactly zero.
        total += tl.where(factor > 0, factor * tile, 0.0)
    pointers = out_ptr + offs_out[:, None] * stride_oo + offs_in[None, :] * stride_oi
    mask = (offs_out[:, None] < n_out) & (offs_in[None, :] < n_in)
    tl.store(pointers, tl.load(pointers, mask=mask, other=0.0) + total, mask=mask)


def _operands(activation: torch.Tensor, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``(B, T, in)`` and ``(B, T, out)`` in one dtype (the output gradients', as Opacus forms per-sample gradients),
    and the kernels' product precision."""
    batch = grad_output.shape[0]
    a = activation.to(grad_output.dtype).reshape(batch, -1, activation.shape[-1])
    g = grad_output.reshape(batch, -1, grad_output.shape[-1])
    return a, g, "ieee" if g.dtype == torch.float32 else "tf32"


def linear_squared_norms(
    activation: torch.Tensor, grad_output: torch.Tensor, tiles: FusedTiles = DEFAULT_TILES
) -> torch.Tensor:
    """``(B,)`` fp64 squared Frobenius norms of the per-sample weight gradients ``G_i^T A_i``, none materialised."""
    a, g, precision = _operands(activation, grad_output)
    batch, tokens, n_in = a.shape
    n_out = g.shape[-1]
    norms = torch.zeros(batch, dtype=torch.float64, device=g.device)
    grid = (batch, triton.cdiv(n_out, tiles.block_out), triton.cdiv(n_in, BLOCK_IN))
    _squared_norms_kernel[grid](a, g, norms, tokens, n_out, n_in, *a.stride(), *g.stride(), PRECISION=precision,
                                **tiles.launch())
    return norms


def add_clipped_linear_sum(
    out: torch.Tensor,
    activation: torch.Tensor,
    grad_output: torch.Tensor,
    factors: torch.Tensor,
    tiles: FusedTiles = DEFAULT_TILES,
) -> torch.Tensor:
    """``out += sum_i factors[i] G_i^T A_i`` (``out``: fp32 ``(out, in)``), no per-sample gradient in memory; with
    the ``tiles`` the norms were taken with."""
    if out.dtype != torch.float32:
        raise TypeError(f"The clipped sum must be fp32, got {out.dtype}.")
    a, g, precision = _operands(activation, grad_output)
    batch, tokens, n_in = a.shape
    n_out = g.shape[-1]
    factors = factors_toward_zero(factors).to(device=g.device).contiguous()  # fp32, never rounded up
    grid = (triton.cdiv(n_out, tiles.block_out), triton.cdiv(n_in, BLOCK_IN))
    _clipped_sum_kernel[grid](a, g, factors, out, batch, tokens, n_out, n_in, *a.stride(), *g.stride(), *out.stride(),
                              PRECISION=precision, **tiles.launch())
    return out
