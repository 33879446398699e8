"""Gaussian noise for the DP-SGD release, from counter-based generators independent of the global RNG."""

from __future__ import annotations

import torch

from lightning_longshield.privacy.seeding import derive_seed


class GaussianNoise:
    """Draws ``N(0, std^2)`` noise for DP step ``k`` from a generator seeded by ``(seed, stream, k)``.

    ``stream`` separates the shards of one gradient (each context-parallel rank draws its own coordinates), so
    noise is independent across coordinates however the parameters are sharded, and identical across
    data-parallel replicas of a shard (which add it once, after summing their clipped gradients). Being
    counter-based, a resumed run continues with fresh draws from the step it stopped at, under any sharding.

    With ``secure_mode`` (whose seed the strategy takes from the OS CSPRNG) each draw is the scaled sum of four
    Gaussians, which hardens the floating-point sampler against the precision attack of Mironov (2012), as Opacus
    does.
    """

    def __init__(self, device: torch.device, seed: int, stream: int = 0, secure_mode: bool = False) -> None:
        self.seed = seed
        self.stream = stream
        self.secure_mode = secure_mode
        self.generator = torch.Generator(device=device)

    def start_step(self, step: int) -> None:
        """Position the generator at the draws of DP step ``step``."""
        self.generator.manual_seed(derive_seed(self.seed, "noise", self.stream, step))

    def sample(self, shape: torch.Size, std: float, device: torch.device) -> torch.Tensor:
        """An fp32 tensor of shape ``shape`` with i.i.d. ``N(0, std^2)`` entries."""
        if not self.secure_mode:
            return torch.normal(0.0, std, shape, generator=self.generator, device=device, dtype=torch.float32)
        draws = torch.normal(0.0, std, (4, *shape), generator=self.generator, device=device, dtype=torch.float32)
        return draws.sum(0) / 2.0
