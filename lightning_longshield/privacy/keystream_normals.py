"""The default noise on CPU: fp32 normals from an AES-256-CTR keystream (OpenSSL), by Box-Muller in torch ops.

torch's CPU generator, MT19937, draws one value at a time (4.4 ns a value on two EPYC cores) and its outputs are
linear in its state. AES-256 in counter mode, keyed by 256 secret bits, is a cryptographically secure stream (the
generator of NIST SP 800-90A's CTR_DRBG); with the CPU's AES instructions OpenSSL gives 4 bytes in about 0.65 ns on
the same cores (its ChaCha20, used before, 1.5 ns). The transform then runs as vectorised, intra-op parallel torch
ops, about 2 ns a value more.

Layout, fixed so that the values do not depend on how they are consumed: one draw fills a list of tensors, flattened
and concatenated in order, in blocks of `BLOCK_VALUES` (which may span tensors: a model's many small tensors share
blocks, so every op works on a whole block) from one keystream read in order: the AES-256 encryptions of the 128-bit
big-endian counters ``nonce 2^64``, ``nonce 2^64 + 1``, ... (NIST SP 800-38A's CTR mode), 16 bytes each. A block of
``m`` values reads ``2 p`` little-endian 32-bit words, ``p = ceil(m / 2)``. The low 31 bits ``h`` of word ``j < p``
give the radius's uniform ``u_j = (fl(h) + 1) 2^-31`` (``fl``: the fp32 rounding, exact below 2^24); where ``h <
2^8`` (``u < 2^-23``: the radii beyond 5.65, about one draw in 2^23) the low 31 bits ``l`` of the draw's next fine
word refine it to ``u_j = (h + (fl(l) + 1) 2^-31) 2^-31`` in [2^-62, 2^-23], a 62-bit uniform to fp32's precision.
Fine words are the keystream from counter ``nonce 2^64 + 2^63`` on, taken in order of the values that need one. The
low 24 bits ``k`` of word ``p + j`` give ``v_j = k 2^-24`` in [0, 1). Value ``j`` is ``sqrt(-2 ln u_j) cos(2 pi
v_j)`` and value ``p + j`` is ``sqrt(-2 ln u_j) sin(2 pi v_j)`` (the last sine dropped when ``m`` is odd).

Radii reach ``sqrt(124 ln 2) ~ 9.27``: the noise is a Gaussian cut off there, a privacy cost that
`privacy.cut_off` bounds and the printed guarantee adds where it matters. Where one sample's clipped gradient moves
the sum by ``C``, a released value beyond ``9.27 sigma C`` from the sum without it could not have come from the data
without it: per step the sample is in, over every spread of the gradient over the coordinates, at most 1.7e-13 at
``sigma`` 1, 1.8e-8 at 0.3, 6.8e-5 at 0.2 (with the 31-bit uniforms used before: 1.2e-5, 1.3e-2 and 0.85 for 10^9
coordinates; torch's 24-bit ones end at 5.77). The conversion is the usual one, not hardened against attacks on
floating-point samplers (``secure_mode`` hardens it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Optional

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from lightning_longshield.privacy.randomness import KEY_BYTES

#: Values formed per block: 1 MiB of keystream, in which the block is formed, and one fp32 temporary of 512 KiB;
#: large enough that each torch op runs on every intra-op thread and its call overhead is below 0.1 ns a value.
BLOCK_VALUES = 2**18
#: Words of one draw: 2^34 counter blocks, far below the 2^64 that would carry into the nonce's half of the counter.
_MOST_WORDS = 2**36
#: Draws a key serves: the nonce fills the counter block's high 64 bits.
_MOST_NONCES = 2**64
_RADIUS_BITS = 31
#: Radius words below this take a fine word (`keystream_normals`' layout): below 2^8 fp32 holds 16 or more bits of it.
_FINE_BELOW = 2**8
#: The counter block, past the nonce's, where a draw's fine words start: far beyond its 2^34 main blocks.
_FINE_COUNTER = 2**63
_ANGLE_BITS = 24


def keystream_normals_(
    outs: Sequence[torch.Tensor], key: bytes, nonce: int, std: float, scale: Optional[float] = None
) -> None:
    """Fill every tensor of ``outs`` (contiguous fp32 CPU tensors) with ``N(0, std^2)`` values from AES-256-CTR
    keyed by ``key`` (32 bytes) with nonce ``nonce`` (< 2^64), or, with ``scale``, replace each by ``out * scale
    + N(0, std^2)``: in place, one block at a time, no tensor of noise allocated."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"AES-256 takes a {KEY_BYTES}-byte key; got {len(key)} bytes.")
    if not 0 <= nonce < _MOST_NONCES:
        raise ValueError(f"A keystream nonce is in [0, 2^64), not {nonce}.")
    for out in outs:
        if out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"Keystream normals fill contiguous fp32 CPU tensors, not {out.dtype} on {out.device}.")
    flats = [out.view(-1) for out in outs if out.numel()]
    total = sum(flat.numel() for flat in flats)
    if not total:
        return
    if total + 1 > _MOST_WORDS:
        raise ValueError(f"One keystream draw covers at most {_MOST_WORDS - 1} values; draw {total} in parts.")
    # The initial counter block; OpenSSL increments all 128 bits, big-endian, one per 16 bytes.
    encryptor = Cipher(algorithms.AES(key), modes.CTR(nonce.to_bytes(8, "big") + bytes(8))).encryptor()
    # 16 spare bytes: some releases of cryptography ask an output buffer up to a cipher block longer than the input.
    stream = bytearray(4 * 2 * _pairs(min(BLOCK_VALUES, total)) + 16)
    words, view = torch.frombuffer(stream, dtype=torch.int32), memoryview(stream)
    segments, fine = _Segments(flats), _FineWords(key, nonce)
    for start in range(0, total, BLOCK_VALUES):
        size = min(BLOCK_VALUES, total - start)
        count = 2 * _pairs(size)
        words[:count].zero_()
        encryptor.update_into(view[: 4 * count], stream)  # in place: the keystream itself (zeros encrypted)
        values = box_muller(words[:count], std, fine.words)
        filled = 0
        while filled < size:
            segment = segments.take(size - filled)
            noise = values[filled:filled + segment.numel()]
            if scale is None:
                segment.copy_(noise)
            else:
                torch.add(noise, segment, alpha=scale, out=segment)
            filled += segment.numel()


def box_muller(words: torch.Tensor, std: float, fine_words: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """One block of the layout above from its ``2 p`` int32 ``words`` (the radii's 31 bits, the angles' 24) and
    ``fine_words(n)``, the draw's next ``n`` fine words (int32): its ``2 p`` fp32 values, ``radius * cos`` then
    ``radius * sin``, formed in ``words``' memory (an fp32 view of it), so a block holds one temporary beside its
    keystream, the cosine."""
    if words.numel() % 2:
        raise ValueError(f"A block takes an even number of words, not {words.numel()}.")
    pairs = words.numel() // 2
    words[:pairs].bitwise_and_((1 << _RADIUS_BITS) - 1)
    words[pairs:].bitwise_and_((1 << _ANGLE_BITS) - 1)
    fine = None
    if pairs and int(words[:pairs].min()) < _FINE_BELOW:  # about one block in 2^6 at 2^17 pairs
        fine = torch.nonzero(words[:pairs] < _FINE_BELOW).flatten()
        low = fine_words(fine.numel()).bitwise_and_((1 << _RADIUS_BITS) - 1).float()
        fine_u = words[:pairs][fine].float().add_(low.add_(1.0), alpha=2.0**-_RADIUS_BITS)
    values = words.view(torch.float32)
    values.copy_(words)  # each word's k as fp32, rounded to nearest (at most 2^31), element by element in place
    radius, angle = values[:pairs], values[pairs:]
    # u = (fl(h) + 1) 2^-31, or (h + (fl(l) + 1) 2^-31) 2^-31: at least 2^-62, at most 1 (fl(h) + 1 rounds to at most
    # 2^31), so ln u <= 0 and the square root's argument is never negative.
    radius.add_(1.0)
    if fine is not None:
        radius[fine] = fine_u
    radius.mul_(2.0**-_RADIUS_BITS).log_().mul_(-2.0 * std * std).sqrt_()
    angle.mul_(2 * math.pi * 2.0**-_ANGLE_BITS)
    cosine = torch.cos(angle)
    angle.sin_().mul_(radius)
    radius.mul_(cosine)
    return values


class _FineWords:
    """A draw's fine words: the AES-256-CTR keystream from counter ``nonce 2^64 + 2^63`` on, in order, read only
    when a block needs some (its encryptor made then)."""

    def __init__(self, key: bytes, nonce: int) -> None:
        self._key, self._nonce, self._encryptor = key, nonce, None

    def words(self, count: int) -> torch.Tensor:
        """The next ``count`` (at least one) fine words."""
        if self._encryptor is None:
            counter = (self._nonce * 2**64 + _FINE_COUNTER).to_bytes(16, "big")
            self._encryptor = Cipher(algorithms.AES(self._key), modes.CTR(counter)).encryptor()
        return torch.frombuffer(bytearray(self._encryptor.update(bytes(4 * count))), dtype=torch.int32)


class _Segments:
    """Consecutive pieces of a list of flat tensors, as if they were one."""

    def __init__(self, flats: list[torch.Tensor]) -> None:
        self._flats, self._index, self._offset = flats, 0, 0

    def take(self, most: int) -> torch.Tensor:
        """The next piece: at most ``most`` values, within one tensor."""
        flat = self._flats[self._index]
        piece = flat[self._offset:self._offset + most]
        self._offset += piece.numel()
        if self._offset == flat.numel():
            self._index, self._offset = self._index + 1, 0
        return piece


def _pairs(values: int) -> int:
    return (values + 1) // 2
