"""DP-SGD building blocks: per-sample gradients, flat or per-layer clipping, noise, Poisson batches and accounting."""

from lightning_longshield.privacy.accountant import PrivacyAccountant
from lightning_longshield.privacy.engine import DPSGDEngine
from lightning_longshield.privacy.epsilon import calibrate_noise_multiplier
from lightning_longshield.privacy.grad_sample import SUPPORTED_LAYER_TYPES, PerSampleGradCapture
from lightning_longshield.privacy.noise import GaussianNoise
from lightning_longshield.privacy.poisson import CollateAllowingEmpty, PoissonBatchSampler

__all__ = [
    "CollateAllowingEmpty",
    "DPSGDEngine",
    "GaussianNoise",
    "PerSampleGradCapture",
    "PoissonBatchSampler",
    "PrivacyAccountant",
    "SUPPORTED_LAYER_TYPES",
    "calibrate_noise_multiplier",
]
