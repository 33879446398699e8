"""Secret randomness of the privacy mechanism: the key every draw of noise, Poisson masks and projections comes from.

The guarantee holds only while the noise, the sampling and randomized clipping's projections are unpredictable to
whoever sees the released model. Everything here derives from a `SecretKey`: 256 bits from the OS CSPRNG drawn when a
fit starts, never derived from the public ``seed`` and never written to a checkpoint (``noise_seed``, for tests
only, makes it reproducible). A draw is named by labels (what it is for, the DP step, the process, the parameter),
and SHAKE-256 over ``key || labels`` gives its bytes, so draws are counter-based: any one can be regenerated on any
process from its labels, and none reveals the key or another draw.

What is cryptographic and what is not:

- Poisson masks: SHAKE-256 output itself, turned into 53-bit uniforms: a cryptographically secure stream.
- Default noise on CPU: an AES-256-CTR keystream (OpenSSL) per draw, keyed by 256 bits of SHAKE-256 output for the
  (step, process): a cryptographically secure stream, turned into fp32 normals by Box-Muller the usual way
  (`keystream_normals`; not hardened against floating-point attacks, as ``secure_mode`` is).
- Projections, and the default noise on other devices, come from torch's generators, whose *whole* state is set from
  SHAKE-256 for each (step, process or parameter): on CPU all 19,937 bits of MT19937's state (never
  ``manual_seed``, which keeps 32 bits of a seed on CPU); on CUDA Philox's 64-bit seed and 64-bit offset (a multiple
  of 4: 126 secret bits), and two such generators whose draws are summed, 252 bits. Where Triton runs, CUDA noise
  comes from a fused kernel instead (`fused_noise`): two Philox streams, each keyed by a 64-bit key and two 32-bit
  counter words, 256 bits. No search over seeds finds a step's draws; a different step's generator is a fresh SHAKE
  output. MT19937 and Philox are not cryptographic generators: this is hardening, not a proof that outputs of one
  generator never reveal its state.
- ``secure_mode`` noise: ChaCha20 keyed by 256 fresh OS bits per tensor (`privacy.chacha20`), a cryptographically
  secure stream; see `GaussianNoise` for how it becomes Gaussian and what that does not prove.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import struct
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

KEY_BYTES = 32

# torch's CPU generator state: seed (u64), left (i32), seeded (i32), next (u64), MT19937's 624 words (each in a u64
# slot), then the cached normals (zeroed: a fresh state has none).
_MT_WORDS = 624
_MT_HEADER = 24
_MT_STATE_BYTES = 5056
# Philox offsets must be multiples of 4 (four 32-bit outputs per counter).
_PHILOX_OFFSET_BITS = 62
# The fused kernel's Philox stream: a 64-bit key and two 32-bit counter words.
_PHILOX_STREAM_BYTES = 16


def derive_seed(base_seed: int, *keys: object) -> int:
    """A 63-bit seed hashed from a *public* ``base_seed`` and ``keys`` (model initialisation per rank). Never for
    the mechanism: torch's CPU generator would keep 32 bits of it."""
    digest = hashlib.blake2b(":".join(str(part) for part in (base_seed, *keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def top_53_bits(stream: bytes) -> torch.Tensor:
    """The top 53 bits of each little-endian 64-bit word of ``stream``, as int64."""
    if sys.byteorder != "little":
        raise RuntimeError("Keyed streams are read as little-endian words; this machine is big-endian.")
    words = torch.frombuffer(bytearray(stream), dtype=torch.int64)
    return (words >> 11) & (2**53 - 1)  # arithmetic shift: the mask drops the sign's copies


def _encode(labels: Sequence[object]) -> bytes:
    """Length-prefixed labels: distinct label tuples never encode alike."""
    parts = [str(label).encode() for label in labels]
    return b"".join(len(part).to_bytes(4, "little") + part for part in parts)


class SecretKey:
    """256 secret bits and the streams keyed by them: ``SHAKE-256(key || labels)``.

    Never stored, printed or checkpointed; `fresh` draws one from OS entropy, `from_seed` (tests only) derives one
    from an integer of any size, all of whose bits matter.
    """

    def __init__(self, key: bytes) -> None:
        if len(key) < KEY_BYTES:
            raise ValueError(f"A SecretKey needs at least {8 * KEY_BYTES} bits; got {8 * len(key)}.")
        self._key = bytes(key)

    @classmethod
    def fresh(cls) -> SecretKey:
        """A key from the OS CSPRNG."""
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_seed(cls, seed: int) -> SecretKey:
        """A reproducible key hashed from ``seed`` (every bit of it): as secret as the seed, no more."""
        return cls(hashlib.shake_256(b"longshield-seed" + _encode([seed])).digest(KEY_BYTES))

    def stream(self, size: int, *labels: object) -> bytes:
        """``size`` bytes of the stream named by ``labels``."""
        return hashlib.shake_256(self._key + _encode(labels)).digest(size)

    def derive(self, *labels: object) -> SecretKey:
        """An independent key for one use of this one (noise, sampling, projections)."""
        return SecretKey(self.stream(KEY_BYTES, "derive", *labels))

    def uniforms(self, size: int, *labels: object) -> torch.Tensor:
        """``size`` fp64 uniforms in [0, 1) with 53 random bits each, straight from the keyed SHAKE stream."""
        return top_53_bits(self.stream(8 * size, "uniforms", *labels)).double().mul_(2.0**-53)

    def generators(self, device: torch.device, *labels: object) -> tuple[torch.Generator, ...]:
        """Torch generators on ``device`` whose whole state comes from the stream named by ``labels``.

        CPU: one MT19937 generator, all 624 words of its state keyed. CUDA and other Philox devices: two generators,
        each with a keyed 64-bit seed and 62-bit offset; `standard_normal` sums their draws (252 secret bits).
        """
        device = torch.device(device)
        generators = tuple(torch.Generator(device=device) for _ in range(1 if device.type == "cpu" else 2))
        for index, generator in enumerate(generators):
            self.key_generator(generator, *labels, philox_index=index)
        return generators

    def key_generator(self, generator: torch.Generator, *labels: object, philox_index: int = 0) -> None:
        """Set the whole state of ``generator`` (an existing one, such as a device's default generator) from the
        stream named by ``labels``: on CPU all of MT19937's state, elsewhere one Philox seed and offset (126 bits),
        the ``philox_index``-th of the streams so named."""
        if generator.device.type == "cpu":
            _key_mt19937(generator, self.stream(4 * _MT_WORDS, "mt19937", *labels))
        else:
            _key_philox(generator, self.stream(16, "philox", philox_index, *labels))

    def philox_words(self, *labels: object) -> list[int]:
        """The fused CUDA noise's key words for the draws named by ``labels`` (`fused_noise`): for each of its two
        Philox streams a 64-bit key (as a signed int64) and two 32-bit counter words, 256 secret bits in all."""
        data = self.stream(2 * _PHILOX_STREAM_BYTES, "philox-fused", *labels)
        words = []
        for start in range(0, len(data), _PHILOX_STREAM_BYTES):
            key, word_a, word_b = struct.unpack("<qII", data[start:start + _PHILOX_STREAM_BYTES])
            words += [key, word_a, word_b]
        return words

    def __repr__(self) -> str:
        return f"{type(self).__name__}(<secret>)"

    def __reduce_ex__(self, protocol: object) -> Any:
        # Pickling (and deep copies, which go through it) would write the key out, or share it with a copy that
        # draws the same noise: a key stays in the process that drew it.
        raise TypeError("A SecretKey is never pickled or copied: each process draws its own (LongShieldStrategy draws"
                        " fresh keys in every fit).")



def _key_mt19937(generator: torch.Generator, state_bytes: bytes) -> None:
    """Give the CPU ``generator`` the MT19937 state ``state_bytes`` (624 little-endian words), as if freshly seeded.

    Built from bytes (``torch.frombuffer``), not from another generator's state, so it also works under a fake-tensor
    trace; `set_state` refuses a state of the wrong size if torch's layout ever changes.
    """
    words = np.frombuffer(state_bytes, dtype="<u4").astype("<u8").tobytes()
    state = bytearray(_MT_STATE_BYTES)
    state[:_MT_HEADER] = struct.pack("<QiiQ", 0, 1, 1, 0)  # reported seed 0, left 1, seeded, next 0
    state[_MT_HEADER:_MT_HEADER + len(words)] = words
    generator.set_state(torch.frombuffer(state, dtype=torch.uint8))


def _key_philox(generator: torch.Generator, stream: bytes) -> None:
    generator.manual_seed(int.from_bytes(stream[:8], "little"))
    offset = int.from_bytes(stream[8:], "little") & (2**_PHILOX_OFFSET_BITS - 1)
    generator.set_offset(4 * offset)


def standard_normal(
    generators: Sequence[torch.Generator], shape: Sequence[int], device: torch.device,
    dtype: torch.dtype = torch.float32, std: float = 1.0,
) -> torch.Tensor:
    """``N(0, std^2)`` entries: one generator's draws, or several generators' draws summed and scaled by
    ``1 / sqrt(n)`` (the same distribution, keyed by all their states)."""
    return standard_normal_(torch.empty(tuple(shape), device=device, dtype=dtype), generators, std)


def standard_normal_(out: torch.Tensor, generators: Sequence[torch.Generator], std: float = 1.0) -> torch.Tensor:
    """`standard_normal` drawn into ``out``; a chunk after chunk of one tensor continues the generators' streams."""
    scale = std / math.sqrt(len(generators))
    out.normal_(0.0, scale, generator=generators[0])
    for generator in generators[1:]:
        out += torch.empty_like(out).normal_(0.0, scale, generator=generator)
    return out
