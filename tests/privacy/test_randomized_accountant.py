"""Randomized-clipping accountant: Gaussian limits, monotonicity, the envelope against Monte Carlo, calibration."""

from __future__ import annotations

import math

import numpy as np
import pytest
from opacus.accountants import PRVAccountant, RDPAccountant
from scipy import integrate
from scipy.special import ndtr

from lightning_longshield.privacy.accountant import PrivacyAccountant
from lightning_longshield.privacy.epsilon import calibrate_noise_multiplier as calibrate_exact_clipping
from lightning_longshield.privacy.plan import PrivacyArguments
from lightning_longshield.privacy.randomized import (
    Discretization,
    RandomizedClippingAccountant,
    calibrate_noise_multiplier,
    get_epsilon,
    scale_envelope,
)
from lightning_longshield.privacy.randomized.mechanism import step_pld
from lightning_longshield.privacy.session import PrivacySession
from simulate.strategy_config import ProjectedNorms

COARSE = Discretization(loss_step=5e-3, scale_ratio=1e-2)
DELTA = 1e-5


def opacus_epsilons(sigma: float, q: float, steps: int, delta: float) -> tuple[float, float]:
    """Opacus's PRV upper bound (``eps_error = 0.01``) and its RDP epsilon for the plain subsampled Gaussian."""
    prv, rdp = PRVAccountant(), RDPAccountant()
    prv.history = [(sigma, q, steps)]
    rdp.history = [(sigma, q, steps)]
    return prv.get_epsilon(delta), rdp.get_epsilon(delta)


@pytest.mark.parametrize(
    "sigma, q, steps, delta", [(1.0, 0.01, 1000, 1e-5), (2.0, 0.05, 500, 1e-6), (1.1, 0.125, 5, 1e-4)]
)
def test_exact_scale_and_many_projections_reproduce_the_gaussian(sigma, q, steps, delta):
    prv, rdp = opacus_epsilons(sigma, q, steps, delta)
    for estimator, projections in (("exact", None), ("hutchinson", 10**8)):
        ours = get_epsilon(sigma, q, steps, delta, projections, estimator)
        assert ours == pytest.approx(prv, rel=0.01)
        # Opacus's PRV answer is its estimate + 0.01; its lower bound is the estimate - 0.01.
        assert ours >= prv - 0.021
        assert ours <= rdp


@pytest.mark.parametrize("sigma", [2.0, 1.0])
def test_small_sampling_rates_reproduce_the_gaussian(sigma):
    """At q = 0.001 one step's loss has a standard deviation of about 5e-4 (sigma 2): the loss grid is sized from
    it. A fixed step of 2e-3 spread every step's loss over 10^4 compositions and reported 0.355 at sigma 2 (above
    Opacus's RDP epsilon, 0.245) and 0.656 at sigma 1."""
    q, steps, delta = 0.001, 10_000, 1e-6
    prv, rdp = opacus_epsilons(sigma, q, steps, delta)
    for estimator, projections in (("exact", None), ("hutchinson", 10**8)):
        ours = get_epsilon(sigma, q, steps, delta, projections, estimator)
        assert prv - 0.021 <= ours <= prv * 1.03  # Opacus's bound is its estimate + 0.01, its lower bound - 0.01
        assert ours <= rdp


@pytest.mark.parametrize("projections", [None, 32])
@pytest.mark.parametrize("remove", [True, False])
def test_one_step_delta_bounds_the_continuous_mixture(remove, projections):
    """Against the hockey-stick divergence of one step (closed form), integrated over the envelope's ``Z``."""
    sigma, q = 1.0, 0.05
    envelope = scale_envelope("hutchinson" if projections else "exact", projections)
    pld = step_pld(sigma, q, envelope, remove, Discretization(), 1e-12)

    def delta_given(z: float, eps: float) -> float:
        mu = z / sigma
        if remove:  # A = (1-q) N(0,1) + q N(mu,1), B = N(0,1); loss > eps iff x > x_eps
            x = (math.log((math.expm1(eps) + q) / q) + mu * mu / 2) / mu
            return (1 - q) * ndtr(-x) + q * ndtr(mu - x) - math.exp(eps) * ndtr(-x)
        if eps >= -math.log1p(-q):
            return 0.0
        x = (math.log((math.expm1(-eps) + q) / q) + mu * mu / 2) / mu  # A = N(0,1); loss > eps iff x < x_eps
        return ndtr(x) - math.exp(eps) * ((1 - q) * ndtr(x) + q * ndtr(x - mu))

    def density(z: float) -> float:  # d/dz P(chi2(k) >= k / z^2)
        k, y = projections, projections / z**2
        return math.exp((k / 2 - 1) * math.log(y) - y / 2 - (k / 2) * math.log(2) - math.lgamma(k / 2)) * 2 * y / z

    for eps in (0.0, 0.01, 0.02, 0.04, 0.1, 0.5):
        exact = float(envelope.cdf(1.0)) * delta_given(1.0, eps)
        if projections:
            spread, _ = integrate.quad(
                lambda z, eps=eps: delta_given(z, eps) * density(z), 1.0, 6.0, epsabs=1e-14, epsrel=1e-10
            )
            exact += spread
        # Above the exact value, by at most the rounding of Z (relative 2e-3) and the grid's second-order error.
        assert exact <= pld.delta(eps) <= exact * (1.01 if projections else 1.0001) + 1e-10


@pytest.mark.parametrize("remove", [True, False])
def test_a_full_batch_step_with_few_projections_puts_what_lies_beyond_the_losses_kept_at_infinity(remove):
    """At q = 1 a component of a heavy-tailed scale (few projections) can lie wholly above the largest loss the grid
    keeps: its band came out empty and the step failed with "negative dimensions are not allowed"."""
    envelope = scale_envelope("hutchinson", 4)
    pld = step_pld(1.0, 1.0, envelope, remove, COARSE, 1e-12)
    exact = step_pld(1.0, 1.0, scale_envelope("exact", None), remove, COARSE, 1e-12)
    assert pld.infinity_mass > exact.infinity_mass
    assert pld.delta(1.0) >= exact.delta(1.0)


def test_a_calibration_far_above_exact_clippings_noise_is_warned_about(monkeypatch):
    """Where the accountant's bound costs far more noise than exact clipping (its floating-point allowance grows
    with the steps and can approach delta), the calibrated multiplier is said to be so, with the ways out."""
    from lightning_longshield.privacy.randomized import accountant

    exact = calibrate_exact_clipping(2.0, DELTA, 0.01, 100, "prv")
    monkeypatch.setattr(accountant, "history_epsilon",  # epsilon as the allowance makes it: finite from 3x on
                        lambda history, *_: 1.0 if history[0][0] >= 3 * exact else math.inf)
    with pytest.warns(UserWarning, match=r"3\.\d+x the .* exact clipping needs.*target_delta \(1e-05\)"):
        sigma = calibrate_noise_multiplier(2.0, DELTA, 0.01, 100, 32)
    assert sigma >= 3 * exact


def test_epsilon_is_monotone():
    def eps(sigma=1.0, q=0.01, steps=1000, k=32):
        return get_epsilon(sigma, q, steps, DELTA, k, "hutchinson" if k else "exact", discretization=COARSE)

    by_k = [eps(k=k) for k in (16, 32, 64, 256, 10**6, None)]
    assert all(a > b for a, b in zip(by_k, by_k[1:]))
    by_sigma = [eps(sigma=sigma) for sigma in (0.9, 1.0, 1.2, 1.5)]
    assert all(a > b for a, b in zip(by_sigma, by_sigma[1:]))
    by_steps = [eps(steps=steps) for steps in (100, 300, 1000)]
    assert all(a < b for a, b in zip(by_steps, by_steps[1:]))
    by_q = [eps(q=q) for q in (0.005, 0.01, 0.02)]
    assert all(a < b for a, b in zip(by_q, by_q[1:]))


# ----------------------------------------------------------------------------- the envelope against Monte Carlo

SAMPLES = 12000
DKW = math.sqrt(math.log(2 / 1e-6) / (2 * SAMPLES))  # sup |empirical - true CDF| exceeds this w.p. < 1e-6
Z_POINTS = np.linspace(0.3, 4.0, 75)


def matrix_with_spectrum(eigenvalues: np.ndarray, rng: np.random.Generator, d: int = 48, p: int = 40) -> np.ndarray:
    """A ``d x p`` per-sample gradient ``A^T G`` whose Gram matrix has ``eigenvalues`` (randomly rotated)."""
    rank = len(eigenvalues)
    left, _ = np.linalg.qr(rng.standard_normal((d, rank)))
    right, _ = np.linalg.qr(rng.standard_normal((p, rank)))
    return left @ np.diag(np.sqrt(eigenvalues)) @ right.T


def hutchinson_scales(gradient: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """``||A^T G||_F / ||(A^T G) P||_F`` with ``P`` of ``N(0, 1/k)`` entries, as the clipping computes it."""
    projections = rng.standard_normal((SAMPLES, gradient.shape[1], k)) / math.sqrt(k)
    estimates = np.square(gradient @ projections).sum(axis=(1, 2))
    return np.linalg.norm(gradient) / np.sqrt(estimates)


def hutch_plus_plus_scales(gradient: np.ndarray, k: int, sketch: int, rng: np.random.Generator) -> np.ndarray:
    """Hutch++: the head ``||M Q||^2`` on ``Q = orth(M^T M S)``, Hutchinson with ``k`` projections on the rest."""
    gram = gradient.T @ gradient
    scales = np.empty(SAMPLES)
    for i in range(SAMPLES):
        basis, _ = np.linalg.qr(gram @ rng.standard_normal((gram.shape[0], sketch)))
        projections = rng.standard_normal((gram.shape[0], k)) / math.sqrt(k)
        residual = projections - basis @ (basis.T @ projections)
        estimate = np.square(gradient @ basis).sum() + np.square(gradient @ residual).sum()
        scales[i] = np.linalg.norm(gradient) / math.sqrt(estimate)
    return scales


def empirical_cdf(samples: np.ndarray, points: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.sort(samples), points, side="right") / len(samples)


SPECTRA = {
    "one-hot": lambda rng: np.array([1.0]),
    "equal-4": lambda rng: np.full(4, 0.25),
    "equal-32": lambda rng: np.full(32, 1 / 32),
    "dirichlet-1": lambda rng: rng.dirichlet(np.ones(16)),
    "dirichlet-0.2": lambda rng: rng.dirichlet(np.full(32, 0.2)),
}


@pytest.mark.parametrize("k", [8, 32])
@pytest.mark.parametrize("spectrum", list(SPECTRA))
def test_envelope_lies_below_monte_carlo_cdfs(spectrum, k):
    rng = np.random.default_rng([list(SPECTRA).index(spectrum), k])
    envelope = scale_envelope("hutchinson", k).cdf(Z_POINTS)
    scales = hutchinson_scales(matrix_with_spectrum(SPECTRA[spectrum](rng), rng), k, rng)
    observed = empirical_cdf(scales, Z_POINTS)
    assert np.all(envelope <= observed + DKW)
    if spectrum == "one-hot":  # the envelope is attained above 1: it is not just a loose bound
        assert np.all(np.abs(envelope - observed)[Z_POINTS >= 1] <= DKW)


def test_envelope_lies_below_a_random_layer_and_hutch_plus_plus():
    rng = np.random.default_rng(7)
    layer = rng.standard_normal((64, 24)).T @ (rng.standard_normal((64, 40)) * np.linspace(0.2, 3, 40))
    envelope = scale_envelope("hutchinson", 8).cdf(Z_POINTS)
    assert np.all(envelope <= empirical_cdf(hutchinson_scales(layer, 8, rng), Z_POINTS) + DKW)
    # Hutch++ on a spectrum its 4-column head cannot capture: the residual's Hutchinson part drives Z.
    plus_envelope = scale_envelope("hutch++", 8).cdf(Z_POINTS)
    for eigenvalues in (np.full(32, 1 / 32), rng.dirichlet(np.full(32, 0.5))):
        gradient = matrix_with_spectrum(eigenvalues, rng)
        scales = hutch_plus_plus_scales(gradient, 8, 4, rng)
        assert np.all(plus_envelope <= empirical_cdf(scales, Z_POINTS) + DKW)


# ----------------------------------------------------------------------------- the summary's claims and the target


def test_hutch_and_hutch_plus_plus_envelopes_nearly_coincide_for_large_d():
    """Both are dimension-free and coincide; a finite-d Hutchinson envelope could only differ below ``z = 1``,
    and there the mass of Hutchinson's best case (equal weights) vanishes as ``d`` grows."""
    points = np.linspace(0.5, 4, 50)
    hutch, plus = scale_envelope("hutchinson", 32), scale_envelope("hutch++", 32)
    assert np.array_equal(hutch.cdf(points), plus.cdf(points))
    rng = np.random.default_rng(3)
    below = 0.95
    small_d = empirical_cdf(hutchinson_scales(matrix_with_spectrum(np.ones(1), rng), 32, rng), below)
    large_d = empirical_cdf(
        hutchinson_scales(matrix_with_spectrum(np.full(40, 1 / 40), rng, d=48, p=40), 32, rng), below
    )
    assert small_d > 0.2 and large_d < 0.02


def test_hutch_needs_slightly_more_noise_than_exact_clipping_at_epsilon_0_7():
    exact = calibrate_exact_clipping(0.7, DELTA, 0.01, 1000, "prv")
    hutch = calibrate_noise_multiplier(0.7, DELTA, 0.01, 1000, 32, "hutchinson")
    assert 1.0 < hutch / exact <= 1.10  # the summary's table: 4.354 / 4.073 = 1.069
    assert get_epsilon(hutch, 0.01, 1000, DELTA, 32) <= 0.7


def test_calibrated_noise_is_never_below_exact_clipping_at_epsilon_2():
    """Epsilon 2, delta 1e-5, q 0.01, 1000 steps, k 32: never below the exact-clipping sigma, and calibrated to
    epsilon 2 (the measured ratio, 1.13, is checked against the 1.10 target below)."""
    exact = calibrate_exact_clipping(2.0, DELTA, 0.01, 1000, "prv")
    for estimator in ("hutchinson", "hutch++"):
        sigma = calibrate_noise_multiplier(2.0, DELTA, 0.01, 1000, 32, estimator)
        assert exact <= sigma
        assert 1.99 <= get_epsilon(sigma, 0.01, 1000, DELTA, 32, estimator) <= 2.0


@pytest.mark.xfail(strict=True, reason="measured 1.132x at epsilon 2 with k 32 (1.069x at epsilon 0.7, as the"
                   " summary's table): the Z-revealed analysis costs more as sigma shrinks; k 64 gives 1.062x")
def test_noise_within_ten_percent_of_exact_clipping_at_epsilon_2():
    exact = calibrate_exact_clipping(2.0, DELTA, 0.01, 1000, "prv")
    assert calibrate_noise_multiplier(2.0, DELTA, 0.01, 1000, 32, "hutchinson") <= 1.10 * exact


# ----------------------------------------------------------------------------- the accountant object


def test_accountant_records_history_and_answers_like_the_functions():
    accountant = RandomizedClippingAccountant("hutchinson", 32, discretization=COARSE)
    assert accountant.get_epsilon(DELTA) == 0.0
    for _ in range(300):
        accountant.step(1.0, 0.01)
    accountant.step(1.2, 0.01)
    assert accountant.history == [(1.0, 0.01, 300), (1.2, 0.01, 1)]
    assert accountant.steps == 301
    single = get_epsilon(1.0, 0.01, 300, DELTA, 32, discretization=COARSE)
    assert accountant.get_epsilon(DELTA) > single
    assert accountant.epsilon_after(0, 1.0, 0.01, DELTA) == accountant.get_epsilon(DELTA)
    budget = accountant.steps_within_budget(2.0, 1.0, 0.01, DELTA, limit=2000)
    assert (
        accountant.epsilon_after(budget, 1.0, 0.01, DELTA)
        <= 2.0
        < accountant.epsilon_after(budget + 1, 1.0, 0.01, DELTA)
    )

    restored = RandomizedClippingAccountant("hutchinson", 32, discretization=COARSE)
    restored.load_state_dict(accountant.state_dict())
    assert restored.get_epsilon(DELTA) == accountant.get_epsilon(DELTA)
    with pytest.raises(ValueError, match=r"norms=ProjectedNorms\('hutchinson', projection_dim=32\)"):
        RandomizedClippingAccountant("hutchinson", 16).load_state_dict(accountant.state_dict())
    # each error names arguments that resume the checkpoint (the exact run's once named accountant='randomized-prv')
    with pytest.raises(ValueError, match=r"norms=ProjectedNorms\('hutchinson', projection_dim=32\)"):
        PrivacyAccountant("prv").load_state_dict(accountant.state_dict())
    # norms="hutchpp" accounts the residual projections (k - k // 3 of k): the hint names the estimator and k
    residual = RandomizedClippingAccountant("hutch++", 32 - 32 // 3)
    with pytest.raises(ValueError, match=r"norms=ProjectedNorms\('hutchpp', projection_dim=32\)"):
        PrivacyAccountant("prv").load_state_dict(residual.state_dict())
    followed = PrivacySession(PrivacyArguments(1.0, None, DELTA, 1.0, "prv"),
                              projected_norms=ProjectedNorms("hutchpp", projection_dim=32))
    followed.accountant.load_state_dict(residual.state_dict())
    exact = PrivacyAccountant("rdp")
    exact.step(1.0, 0.01)
    with pytest.raises(ValueError, match=r"exact norms .*'mixed'\) and accountant='rdp'"):
        RandomizedClippingAccountant("hutchinson", 32).load_state_dict(exact.state_dict())
    zero_noise = RandomizedClippingAccountant("hutch++", 32)
    zero_noise.step(0.0, 0.01)
    assert math.isinf(zero_noise.get_epsilon(DELTA))
