"""Keyed Gaussian noise drawn and added in one pass on CUDA (Triton): ``total * scale + N(0, std^2)``.

The torch path of `GaussianNoise` on CUDA draws two keyed Philox tensors, sums them and adds the scaled sum: eight
passes over every parameter and two temporaries. This kernel reads the sum once and writes the result once; the
random numbers never reach memory.

Randomness: two Philox-4x32-10 streams (Salmon et al., 2011; Triton's `tl.philox`), each keyed by 128 secret bits of
the step's `SecretKey` stream (the 64-bit key and two of the four 32-bit counter words; the other two words are the
counter's position and the draw's index in the step), 256 bits in all. Each stream's four 32-bit outputs per counter
become four normals by Box-Muller with cosine and sine, the radius from uniforms ``(x + 1/2) 2^-32`` in ``(0, 1]``
(cuRAND's resolution, as torch's CUDA draws); the two streams' normals are summed and scaled by ``std / sqrt(2)``.
Philox is a counter-based generator, not a cryptographic one: this is the same hardening as the torch path, not a
proof.

Counter ``c`` of program ``p`` (``c = p * BLOCK + i``) gives the elements ``p * 4 * BLOCK + j * BLOCK + i``,
``j = 0..3``, so every load and store is contiguous and the values do not depend on how the launch is scheduled.
Needs CUDA, or ``TRITON_INTERPRET=1`` (CPU tensors, for tests).
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK = 1024  # counters per program; part of the element-to-counter map, so fixed
NUM_WARPS = 8  # fastest of 4, 8, 16 and 32 on an H200 (4.6 ms per 1.24e9 elements); 90 registers, no spills
STREAMS = 2
WORDS_PER_STREAM = 3  # the 64-bit Philox key, then two secret 32-bit counter words
_MAX_ELEMENTS = 4 * (2**32 - 1)  # one 32-bit counter word numbers the counters

_TWO_POW_MINUS_32 = tl.constexpr(2.0**-32)
_HALF_PI = tl.constexpr(math.pi / 2)
_S3, _S5, _S7, _S9 = (tl.constexpr((-1) ** k / math.factorial(2 * k + 1)) for k in range(1, 5))
_C4, _C6, _C8, _C10 = (tl.constexpr((-1) ** k / math.factorial(2 * k)) for k in range(2, 6))


@triton.jit
def _cos_sin_of_turn(turn):
    """``cos`` and ``sin`` of ``2 pi turn`` for ``turn`` in ``[-1/2, 1/2)``: quarter turns split off exactly, then
    Taylor polynomials on ``[-pi/4, pi/4]`` (truncation error below 2e-9, under fp32 rounding). Cheaper than the
    general ``sin`` and ``cos``, which reduce any argument."""
    quarters = turn * 4.0
    nearest = tl.floor(quarters + 0.5)
    x = (quarters - nearest) * _HALF_PI  # quarters - nearest is exact (Sterbenz)
    x2 = x * x
    sin_x = x + x * x2 * (_S3 + x2 * (_S5 + x2 * (_S7 + x2 * _S9)))
    cos_x = 1.0 + x2 * (-0.5 + x2 * (_C4 + x2 * (_C6 + x2 * (_C8 + x2 * _C10))))
    quadrant = nearest.to(tl.int32) & 3  # the angle is quadrant * pi/2 + x
    swap = (quadrant & 1) == 1
    cos_out = tl.where(swap, sin_x, cos_x)
    sin_out = tl.where(swap, cos_x, sin_x)
    cos_out = tl.where((quadrant == 1) | (quadrant == 2), -cos_out, cos_out)
    sin_out = tl.where(quadrant >= 2, -sin_out, sin_out)
    return cos_out, sin_out


@triton.jit
def _box_muller(bits_radius, bits_angle):
    """Two independent standard normals from two 32-bit words: the radius from ``u1 = (x + 1/2) 2^-32`` in
    ``(0, 1]``, the angle uniform on the circle."""
    u1 = bits_radius.to(tl.float32) * _TWO_POW_MINUS_32 + 0.5 * _TWO_POW_MINUS_32
    radius = tl.sqrt(-2.0 * tl.log(u1))
    cos_angle, sin_angle = _cos_sin_of_turn(bits_angle.to(tl.float32) * _TWO_POW_MINUS_32 - 0.5)
    return radius * cos_angle, radius * sin_angle


@triton.jit
def _stream_normals(keys_ptr, stream: tl.constexpr, counters, call_word):
    """Four blocks of standard normals from one keyed Philox stream at ``counters``."""
    seed = tl.load(keys_ptr + stream * 3)
    word_a = tl.load(keys_ptr + stream * 3 + 1).to(tl.uint32) + counters * 0
    word_b = tl.load(keys_ptr + stream * 3 + 2).to(tl.uint32) + counters * 0
    r0, r1, r2, r3 = tl.philox(seed, counters, word_a, word_b, call_word)
    z0, z1 = _box_muller(r0, r1)
    z2, z3 = _box_muller(r2, r3)
    return z0, z1, z2, z3


@triton.jit
def _load_quarter(total_ptr, offsets, numel, scale, HAS_TOTAL: tl.constexpr):
    if HAS_TOTAL:
        return tl.load(total_ptr + offsets, mask=offsets < numel, other=0.0) * scale
    return tl.zeros(offsets.shape, dtype=tl.float32)


@triton.jit(do_not_specialize=["call"])
def _keyed_noise_kernel(
    total_ptr, out_ptr, keys_ptr, numel, call, scale, std_per_stream,
    HAS_TOTAL: tl.constexpr, BLOCK: tl.constexpr,
):
    program = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    base = program.to(tl.int64) * (4 * BLOCK) + lanes
    # The sum's loads are issued first, so that their latency hides behind the generators' arithmetic.
    t0 = _load_quarter(total_ptr, base, numel, scale, HAS_TOTAL)
    t1 = _load_quarter(total_ptr, base + BLOCK, numel, scale, HAS_TOTAL)
    t2 = _load_quarter(total_ptr, base + 2 * BLOCK, numel, scale, HAS_TOTAL)
    t3 = _load_quarter(total_ptr, base + 3 * BLOCK, numel, scale, HAS_TOTAL)
    counters = program.to(tl.uint32) * BLOCK + lanes.to(tl.uint32)  # unsigned: no overflow below _MAX_ELEMENTS
    call_word = counters * 0 + call.to(tl.uint32)
    a0, a1, a2, a3 = _stream_normals(keys_ptr, 0, counters, call_word)
    b0, b1, b2, b3 = _stream_normals(keys_ptr, 1, counters, call_word)
    tl.store(out_ptr + base, t0 + (a0 + b0) * std_per_stream, mask=base < numel)
    tl.store(out_ptr + base + BLOCK, t1 + (a1 + b1) * std_per_stream, mask=base + BLOCK < numel)
    tl.store(out_ptr + base + 2 * BLOCK, t2 + (a2 + b2) * std_per_stream, mask=base + 2 * BLOCK < numel)
    tl.store(out_ptr + base + 3 * BLOCK, t3 + (a3 + b3) * std_per_stream, mask=base + 3 * BLOCK < numel)


def keyed_noise_(
    out: torch.Tensor, keys: torch.Tensor, call: int, std: float,
    total: Optional[torch.Tensor] = None, scale: float = 1.0,
) -> torch.Tensor:
    """Write ``total * scale + N(0, std^2)`` (or the noise alone) into ``out``, an fp32 contiguous tensor.

    ``keys``: `STREAMS * WORDS_PER_STREAM` int64 secret words on ``out``'s device (`SecretKey.philox_words`);
    ``call``: the draw's index within the step (distinct draws of one step must use distinct indices). ``total``
    may be ``out`` itself (in place).
    """
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("keyed_noise_ writes fp32 contiguous tensors.")
    if total is not None and (total.shape != out.shape or total.dtype != torch.float32 or not total.is_contiguous()):
        raise ValueError("keyed_noise_ adds to an fp32 contiguous tensor of the output's shape.")
    if keys.numel() != STREAMS * WORDS_PER_STREAM or keys.dtype != torch.int64 or keys.device != out.device:
        raise ValueError(f"keyed_noise_ needs {STREAMS * WORDS_PER_STREAM} int64 key words on {out.device}.")
    if out.numel() > _MAX_ELEMENTS:
        raise ValueError(f"keyed_noise_ draws at most {_MAX_ELEMENTS} elements per tensor; got {out.numel()}.")
    if not 0 <= call < 2**32:
        raise ValueError(f"The draw index must fit 32 bits; got {call}.")
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(out.numel(), 4 * BLOCK),)
    # Triton launches on the current device, which need not be the tensors' one.
    with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
        _keyed_noise_kernel[grid](
            out if total is None else total, out, keys, out.numel(), call, scale, std / math.sqrt(STREAMS),
            HAS_TOTAL=total is not None, BLOCK=BLOCK, num_warps=NUM_WARPS,
        )
    return out
