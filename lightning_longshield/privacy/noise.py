"""Gaussian noise for the DP-SGD release, from generators independent of the global RNG and seeded in secret."""

from __future__ import annotations

import secrets
from typing import Optional

import torch

from lightning_longshield.privacy.randomness import derive_seed, fresh_seed


class GaussianNoise:
    """Draws ``N(0, std^2)`` fp32 noise for the DP steps of one process.

    Three sources, from the default to the explicit opt-in:

    - default: a 63-bit secret drawn from OS entropy when the object is built (per process, never stored); step
      ``k`` reseeds torch's generator with a hash of ``(secret, stream, k)``;
    - ``secure_mode``: every tensor drawn reseeds the generator with 64 fresh bits of OS entropy, so no seed
      covers more than one tensor of one step, and each draw is the scaled sum of four Gaussians, which hardens the
      floating-point sampler against the precision attack of Mironov (2012), as Opacus does;
    - ``seed`` given (``noise_seed`` of the strategy): as the default but from that seed, hence reproducible. The
      guarantee then holds only while the seed stays secret.

    ``stream`` separates processes (each draws the noise of its own shard and data-parallel replica), so noise is
    independent across coordinates and replicas however the parameters are sharded.
    """

    def __init__(
        self,
        device: torch.device,
        seed: Optional[int] = None,
        stream: tuple[int, ...] = (),
        secure_mode: bool = False,
    ) -> None:
        if secure_mode and seed is not None:
            raise ValueError("secure_mode draws fresh OS entropy for every noise tensor; a seed cannot be combined.")
        self.reproducible = seed is not None
        self.secure_mode = secure_mode
        self._seed = fresh_seed() if seed is None else seed
        self._stream = stream
        self.generator = torch.Generator(device=device)

    def start_step(self, step: int) -> None:
        """Position the generator at the draws of DP step ``step`` (secure mode reseeds per tensor instead)."""
        if not self.secure_mode:
            self.generator.manual_seed(derive_seed(self._seed, "noise", *self._stream, step))

    def sample(self, shape: torch.Size, std: float, device: torch.device) -> torch.Tensor:
        """An fp32 tensor of shape ``shape`` with i.i.d. ``N(0, std^2)`` entries."""
        if not self.secure_mode:
            return torch.normal(0.0, std, shape, generator=self.generator, device=device, dtype=torch.float32)
        self.generator.manual_seed(secrets.randbits(64))
        draws = torch.normal(0.0, std, (4, *shape), generator=self.generator, device=device, dtype=torch.float32)
        return draws.sum(0) / 2.0

    def __repr__(self) -> str:
        source = "secure" if self.secure_mode else "seeded (reproducible)" if self.reproducible else "secret"
        return f"{type(self).__name__}({source})"
