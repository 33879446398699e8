"""What the privacy session refuses, warns and logs."""

from __future__ import annotations

import math

import pytest

from lightning_longshield import LongShieldStrategy
from lightning_longshield.privacy.epsilon import calibrate_noise_multiplier


def test_an_infinite_target_epsilon_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"use noise_multiplier=0\.0 for a non-private run, or a finite target_eps"):
        LongShieldStrategy(target_epsilon=math.inf)
    with pytest.raises(ValueError, match="> 0 and finite"):
        calibrate_noise_multiplier(math.inf, 1e-5, 0.01, 100, "prv")


@pytest.mark.parametrize("value", [math.nan, -1.0, 0.0, -math.inf])
def test_a_target_epsilon_that_is_not_a_positive_number_is_refused(value):
    with pytest.raises(ValueError, match=r"target_epsilon must be > 0 and finite.*noise_multiplier=0\.0"):
        LongShieldStrategy(target_epsilon=value)


@pytest.mark.parametrize(("argument", "value"), [("noise_multiplier", math.inf), ("noise_multiplier", math.nan),
                                                 ("max_grad_norm", math.inf), ("max_grad_norm", math.nan)])
def test_noise_and_clipping_bounds_must_be_finite(argument, value):
    with pytest.raises(ValueError, match=f"{argument} must be >=? 0 and finite"):
        LongShieldStrategy(**{argument: value})
