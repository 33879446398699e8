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

import math
from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK = 1024  # counters per program; part of the element-to-counter map, so fixed
STREAMS = 2
WORDS_PER_STREAM = 3  # the 64-bit Philox key, then two secret 32-bit counter words
_MAX_ELEMENTS = 4 * (2**32 - 1)  # one 32-bit counter word numbers the counters

_TWO_POW_MINUS_32 = tl.constexpr(2.0**-32)
_TWO_PI = tl.constexpr(2 * math.pi)


@triton.jit
def _box_muller(bits_radius, bits_angle):
    """Two independent standard normals from two 32-bit words: ``u1 = (x + 1/2) 2^-32`` in ``(0, 1]``, the angle
    uniform in ``[-pi, pi)`` (where sine and cosine are most accurate)."""
    u1 = bits_radius.to(tl.float32) * _TWO_POW_MINUS_32 + 0.5 * _TWO_POW_MINUS_32
    u2 = bits_angle.to(tl.float32) * _TWO_POW_MINUS_32 - 0.5
    radius = tl.sqrt(-2.0 * tl.log(u1))
    angle = _TWO_PI * u2
    return radius * tl.cos(angle), radius * tl.sin(angle)


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
def _store_quarter(total_ptr, out_ptr, offsets, numel, noise, scale, HAS_TOTAL: tl.constexpr):
    mask = offsets < numel
    if HAS_TOTAL:
        noise = tl.load(total_ptr + offsets, mask=mask, other=0.0) * scale + noise
    tl.store(out_ptr + offsets, noise, mask=mask)


@triton.jit(do_not_specialize=["call"])
def _keyed_noise_kernel(
    total_ptr, out_ptr, keys_ptr, numel, call, scale, std_per_stream,
    HAS_TOTAL: tl.constexpr, BLOCK: tl.constexpr,
):
    program = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    counters = (program * BLOCK + lanes).to(tl.uint32)
    call_word = counters * 0 + call.to(tl.uint32)
    a0, a1, a2, a3 = _stream_normals(keys_ptr, 0, counters, call_word)
    b0, b1, b2, b3 = _stream_normals(keys_ptr, 1, counters, call_word)
    base = program.to(tl.int64) * (4 * BLOCK) + lanes
    _store_quarter(total_ptr, out_ptr, base, numel, (a0 + b0) * std_per_stream, scale, HAS_TOTAL)
    _store_quarter(total_ptr, out_ptr, base + BLOCK, numel, (a1 + b1) * std_per_stream, scale, HAS_TOTAL)
    _store_quarter(total_ptr, out_ptr, base + 2 * BLOCK, numel, (a2 + b2) * std_per_stream, scale, HAS_TOTAL)
    _store_quarter(total_ptr, out_ptr, base + 3 * BLOCK, numel, (a3 + b3) * std_per_stream, scale, HAS_TOTAL)


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
    _keyed_noise_kernel[grid](
        out if total is None else total, out, keys, out.numel(), call, scale, std / math.sqrt(STREAMS),
        HAS_TOTAL=total is not None, BLOCK=BLOCK,
    )
    return out
