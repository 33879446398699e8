"""Per-sample gradients: supported layer types, the capture (each layer's forward replaced) and its autograd nodes."""

from lightning_longshield.privacy.grad_sample.capture import PerSampleGradCapture
from lightning_longshield.privacy.grad_sample.layers import SUPPORTED_LAYER_TYPES, check_supported_layers

__all__ = ["PerSampleGradCapture", "SUPPORTED_LAYER_TYPES", "check_supported_layers"]
