"""The clipped-gradient sum of one logical batch and its noisy release."""

from __future__ import annotations

import torch
from torch import nn

from lightning_longshield.privacy.noise import GaussianNoise


class ClippedGradientSum:
    """fp32 running sum of clipped per-sample gradients over the micro-batches of one logical batch.

    `release` adds ``N(0, (sigma C)^2)`` once per coordinate, divides by the expected logical batch size, writes the
    result to ``param.grad`` (in the parameter's dtype) and resets the sum.
    """

    def __init__(self, parameters: list[nn.Parameter]) -> None:
        self.parameters = parameters
        self.sums: dict[nn.Parameter, torch.Tensor] = {}

    def _sum_for(self, param: nn.Parameter) -> torch.Tensor:
        if param not in self.sums:
            self.sums[param] = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
        return self.sums[param]

    def add(self, grad_samples: dict[nn.Parameter, torch.Tensor], factors: torch.Tensor) -> None:
        """Add ``sum_i factors[i] * grad_samples[p][i]`` for every parameter."""
        for param, grad_sample in grad_samples.items():
            clipped = torch.tensordot(factors.to(grad_sample.dtype), grad_sample, dims=1)
            self._sum_for(param).add_(clipped)

    @torch.no_grad()
    def release(self, noise: GaussianNoise, noise_std: float, expected_batch_size: float) -> None:
        """Privatise the sum into ``param.grad`` and start a new logical batch."""
        for param in self.parameters:
            total = self._sum_for(param)
            if noise_std > 0:
                total.add_(noise.sample(total.shape, noise_std, total.device))
            param.grad = (total / expected_batch_size).to(param.dtype)
            total.zero_()
