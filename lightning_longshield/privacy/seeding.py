"""Deterministic derivation of independent seeds from one base seed."""

from __future__ import annotations

import hashlib


def derive_seed(base_seed: int, *keys: object) -> int:
    """A 63-bit seed hashed from ``base_seed`` and ``keys``: distinct keys give unrelated streams."""
    text = ":".join(str(part) for part in (base_seed, *keys))
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
