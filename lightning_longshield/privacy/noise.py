"""Gaussian noise for the DP-SGD release, from a dedicated generator whose state is checkpointed."""

from __future__ import annotations

from typing import Any

import torch


class GaussianNoise:
    """Draws ``N(0, std^2)`` noise from its own generator, independent of the global RNG and of data sampling.

    With ``secure_mode`` (whose seed the strategy takes from the OS CSPRNG) each draw is the scaled sum of four
    Gaussians, which hardens the floating-point sampler against the precision attack of Mironov (2012), as Opacus
    does. Checkpoints restore the generator, so a resumed run continues the stream instead of repeating it.
    """

    def __init__(self, device: torch.device, seed: int, secure_mode: bool = False) -> None:
        self.secure_mode = secure_mode
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(self, shape: torch.Size, std: float, device: torch.device) -> torch.Tensor:
        """An fp32 tensor of shape ``shape`` with i.i.d. ``N(0, std^2)`` entries."""
        if not self.secure_mode:
            return torch.normal(0.0, std, shape, generator=self.generator, device=device, dtype=torch.float32)
        draws = torch.normal(0.0, std, (4, *shape), generator=self.generator, device=device, dtype=torch.float32)
        return draws.sum(0) / 2.0

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
