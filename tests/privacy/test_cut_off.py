"""What the noise's floating-point cut-off adds to delta (`privacy.cut_off`), against independent references: the
largest values the samplers can form, a Monte Carlo estimate of the two-term tail, and the one-term bound's two
limiting shifts (all on one coordinate, spread evenly)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from lightning_longshield.privacy import cut_off
from lightning_longshield.privacy.cut_off import (
    COORDINATES,
    KEYSTREAM_TAIL,
    PHILOX_TAIL,
    SECURE_TAIL,
    NoiseTail,
    cut_off_delta,
    per_step_cut_off_delta,
)
from lightning_longshield.privacy.keystream_normals import box_muller


def test_the_keystream_tail_is_the_largest_value_its_sampler_forms():
    """The radius word and its fine word zero: u = 2^-62, the largest radius, on the cosine of angle 0."""
    zeros = torch.zeros(1, dtype=torch.int32)
    largest = box_muller(torch.tensor([0, 0], dtype=torch.int32), 1.0, lambda count: zeros)[0].item()
    assert largest == pytest.approx(KEYSTREAM_TAIL.cut_off, rel=1e-6)
    assert PHILOX_TAIL.cut_off == pytest.approx(math.sqrt(-2 * math.log(2.0**-33)))  # cuRAND's (0 + 1/2) 2^-32


def test_the_secure_tail_is_two_normals_whose_sum_reaches_its_samplers_largest_value():
    """``secure_mode``'s four draws are two radii, each pair ``r (cos t + sin t)``: largest at 1 - u = 2^-53 and
    t = pi / 4 (53-bit v = 2^50), where the coordinate is ``2 sqrt(2) r / 2 = sqrt(2) r``: two normals cut off at r."""
    from lightning_longshield.privacy.chacha20 import hardened_gaussians

    bits = torch.tensor([2**53 - 1, 2**50, 2**53 - 1, 2**50], dtype=torch.int64)
    largest = hardened_gaussians(bits).item()
    assert SECURE_TAIL.terms == 2
    assert largest == pytest.approx(SECURE_TAIL.cut_off * math.sqrt(SECURE_TAIL.terms), rel=1e-9)


def test_the_two_term_tail_matches_monte_carlo():
    """Normals cut off at 2 (where a Monte Carlo estimate is cheap), two summed: P(x + y > 2 c - margin)."""
    rng = np.random.default_rng(0)
    x, y = (draws[np.abs(draws) <= 2.0][:1_000_000] for draws in rng.standard_normal((2, 1_200_000)))
    for margin in (0.5, 1.5):
        estimate = np.mean(x + y > 4.0 - margin)
        assert cut_off._pair_tail(2.0, margin) == pytest.approx(estimate, rel=5 / math.sqrt(estimate * 1e6))


@pytest.mark.parametrize("noise_multiplier", [0.3, 0.5, 1.0])
def test_the_one_term_bound_covers_a_shift_on_one_coordinate_and_one_spread_evenly(noise_multiplier):
    """All of 1 / sigma on one coordinate: Q(c - 1 / sigma); spread evenly over all coordinates: their number times
    the probability of each one's sliver below the cut-off (scipy's normal)."""
    c, shift = KEYSTREAM_TAIL.cut_off, 1 / noise_multiplier
    bound = per_step_cut_off_delta(KEYSTREAM_TAIL, noise_multiplier)
    one = stats.norm.sf(c - shift)
    each = shift / math.sqrt(COORDINATES)
    even = COORDINATES * stats.norm.pdf(c) * each  # the sliver [c - each, c], each tiny
    assert bound >= max(one, even) and bound < 100 * max(one, even)


def test_the_cost_falls_with_noise_and_grows_with_steps_sampled():
    for tail in (KEYSTREAM_TAIL, PHILOX_TAIL, SECURE_TAIL):
        costs = [per_step_cut_off_delta(tail, sigma) for sigma in (0.2, 0.3, 0.5, 1.0, 2.0)]
        assert all(later < earlier for earlier, later in zip(costs, costs[1:]))
    per_step = per_step_cut_off_delta(PHILOX_TAIL, 0.3)
    assert cut_off_delta(PHILOX_TAIL, 0.3, 0.01, 500) == pytest.approx(5 * per_step)
    assert per_step_cut_off_delta(NoiseTail(1, 3.0), 0.25) == 1.0  # one sample's shift reaches past the cut-off
    with pytest.raises(ValueError, match="positive"):
        per_step_cut_off_delta(KEYSTREAM_TAIL, 0.0)
