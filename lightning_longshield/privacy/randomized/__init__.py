"""Privacy accounting for DP-SGD with randomized clipping (norms from Hutchinson / Hutch++ estimates)."""

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
from lightning_longshield.privacy.randomized.mechanism import Discretization

__all__ = [
    "ESTIMATORS",
    "EXACT_CLIPPING",
    "Discretization",
    "RandomizedClippingAccountant",
    "ScaleEnvelope",
    "calibrate_noise_multiplier",
    "get_epsilon",
    "history_epsilon",
    "scale_envelope",
]
