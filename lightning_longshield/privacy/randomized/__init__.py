"""DP-SGD with randomized clipping: per-sample norms from Hutchinson / Hutch++ estimates, and their accounting."""

from lightning_longshield.privacy.randomized.accountant import (
    RandomizedClippingAccountant,
    calibrate_noise_multiplier,
    get_epsilon,
    history_epsilon,
)
from lightning_longshield.privacy.randomized.envelope import (
    ESTIMATORS,
    EXACT_CLIPPING,
    ScaleEnvelope,
    scale_envelope,
)
from lightning_longshield.privacy.randomized.estimator import (
    RandomizedNorms,
    estimate_squared_norms,
    residual_projections,
)
from lightning_longshield.privacy.randomized.mechanism import Discretization

__all__ = [
    "ESTIMATORS",
    "EXACT_CLIPPING",
    "Discretization",
    "RandomizedClippingAccountant",
    "RandomizedNorms",
    "ScaleEnvelope",
    "calibrate_noise_multiplier",
    "estimate_squared_norms",
    "get_epsilon",
    "history_epsilon",
    "residual_projections",
    "scale_envelope",
]
