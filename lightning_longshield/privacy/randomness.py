"""Secret randomness of the privacy mechanism: where the Poisson sampling masks and the noise seeds come from.

The guarantee holds only while the noise and the sampling are unpredictable to whoever sees the released model, so
by default both come from OS entropy drawn when training starts, are never derived from the public ``seed`` and
are never written to a checkpoint. A fixed seed exists only as the explicit opt-in ``noise_seed`` for tests.
"""

from __future__ import annotations

import hashlib
import secrets

import numpy as np
import torch


def derive_seed(base_seed: int, *keys: object) -> int:
    """A 63-bit seed hashed from ``base_seed`` and ``keys``: distinct keys give unrelated streams."""
    text = ":".join(str(part) for part in (base_seed, *keys))
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def fresh_seed() -> int:
    """63 bits from the OS CSPRNG."""
    return secrets.randbits(63)


class SeededUniforms:
    """Uniforms in [0, 1) for draw ``k`` from torch's generator seeded by a hash of ``(seed, k)``.

    Counter-based: any draw can be regenerated from its index, on every process alike. Unpredictable exactly as
    long as ``seed`` is secret (the default draws it from OS entropy).
    """

    def __init__(self, seed: int) -> None:
        self._seed = seed

    def uniforms(self, draw: int, size: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(derive_seed(self._seed, "poisson", draw))
        return torch.rand(size, generator=generator, dtype=torch.float64)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seed=<secret>)"


class CryptographicUniforms:
    """Uniforms in [0, 1) (53-bit) for draw ``k`` from SHAKE-256 keyed by a 256-bit secret and ``k``.

    An extendable-output hash keyed by a secret is a cryptographically secure stream: no observation of past masks
    helps predict another draw. About 1 GB/s, i.e. a few milliseconds per step for a million samples.
    """

    def __init__(self, key: bytes) -> None:
        if len(key) < 32:
            raise ValueError("CryptographicUniforms needs a key of at least 256 bits.")
        self._key = key

    def uniforms(self, draw: int, size: int) -> torch.Tensor:
        stream = hashlib.shake_256(self._key + draw.to_bytes(8, "little")).digest(8 * size)
        words = np.frombuffer(stream, dtype=np.uint64) >> np.uint64(11)
        return torch.from_numpy(words.astype(np.float64) * 2.0**-53)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key=<secret>)"


class ProjectionSeeds:
    """Seeds of randomized clipping's Gaussian projections, one per (DP step, micro-batch), from SHAKE-256 keyed by a
    secret shared by every process: the ranks of a context-parallel group must project the shards of a sequence with
    the same matrices. Fresh at every step, independent of the data, never stored (the accountant's assumptions).
    """

    def __init__(self, key: bytes) -> None:
        self._key = key

    def seed(self, step: int, microbatch: int) -> int:
        stream = hashlib.shake_256(self._key + b"projection" + step.to_bytes(8, "little")
                                   + microbatch.to_bytes(8, "little"))
        return int.from_bytes(stream.digest(8), "little") & (2**63 - 1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key=<secret>)"


UniformSource = SeededUniforms | CryptographicUniforms
