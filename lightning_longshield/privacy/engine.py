"""DP-SGD mechanics of one logical batch: per-sample gradients, flat clipping, clipped sum, noisy release."""

from __future__ import annotations

import torch
from torch import nn

from lightning_longshield.privacy.accountant import PrivacyAccountant
from lightning_longshield.privacy.accumulator import ClippedGradientSum
from lightning_longshield.privacy.clipping import clip_factors, per_sample_squared_norms
from lightning_longshield.privacy.grad_sample import PerSampleGradCapture
from lightning_longshield.privacy.noise import GaussianNoise


class DPSGDEngine:
    """Owns the per-sample-gradient capture of a model and turns micro-batch backwards into one private gradient.

    Per micro-batch: `prepare_microbatch` before forward, `accumulate_microbatch` after backward (clip each sample
    to norm ``max_grad_norm`` and add to the fp32 sum). Per logical batch: `release` adds Gaussian noise with std
    ``noise_multiplier * max_grad_norm``, divides by the expected logical batch size, fills ``param.grad`` and
    records the step with the accountant.
    """

    def __init__(self, model: nn.Module, max_grad_norm: float, noise: GaussianNoise, accountant: PrivacyAccountant):
        self.capture = PerSampleGradCapture(model)
        self.accumulator = ClippedGradientSum(self.capture.parameters)
        self.max_grad_norm = max_grad_norm
        self.noise = noise
        self.accountant = accountant
        self.last_per_sample_norms: torch.Tensor | None = None

    def begin_logical_batch(self) -> None:
        """Drop the previous step's gradients: until `release`, ``.grad`` only ever holds one micro-batch's."""
        for param in self.capture.parameters:
            param.grad = None

    def prepare_microbatch(self, batch_size: int) -> None:
        """Capture per-sample gradients only when the micro-batch holds more than one sample."""
        self.capture.enabled = batch_size > 1

    def accumulate_microbatch(self, batch_size: int) -> None:
        """Clip the per-sample gradients of the last backward and add them to the logical batch's sum."""
        grad_samples = self.capture.collect()
        self.capture.enabled = False
        squared_norms = per_sample_squared_norms(grad_samples.values(), batch_size)
        self.accumulator.add(grad_samples, clip_factors(squared_norms, self.max_grad_norm))
        self.last_per_sample_norms = squared_norms.sqrt()

    def release(self, noise_multiplier: float, sample_rate: float, expected_batch_size: float) -> None:
        """Write the private gradient of the logical batch to ``param.grad`` and account for the step."""
        self.accumulator.release(self.noise, noise_multiplier * self.max_grad_norm, expected_batch_size)
        self.accountant.step(noise_multiplier, sample_rate)

    def remove(self) -> None:
        self.capture.remove()
