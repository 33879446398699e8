"""Epsilon equals Opacus's accountant for the same (sigma, q, steps); calibration lands on the target; budget stops."""

from __future__ import annotations

import math

import pytest
from opacus.accountants import create_accountant

from lightning_longshield import LongShieldStrategy
from lightning_longshield.privacy import PrivacyAccountant
from tests.support.helpers import RandomTokens, loader, make_module, make_trainer, small_config

DATASET, BATCH = 32, 4


def fit(strategy: LongShieldStrategy, max_steps: int):
    trainer = make_trainer(strategy, max_steps=max_steps)
    trainer.fit(make_module(small_config(n_layers=1)), loader(RandomTokens(size=DATASET, seq_len=8), BATCH))
    return trainer


@pytest.mark.parametrize("mechanism", ["prv", "rdp"])
def test_epsilon_matches_opacus(mechanism):
    sigma, steps, delta = 1.1, 5, 1e-4
    strategy = LongShieldStrategy(noise_multiplier=sigma, accountant=mechanism, target_delta=delta, seed=0)
    trainer = fit(strategy, steps)
    assert trainer.global_step == steps
    reference = create_accountant(mechanism)
    for _ in range(steps):
        reference.step(noise_multiplier=sigma, sample_rate=BATCH / DATASET)
    assert strategy.get_epsilon() == pytest.approx(reference.get_epsilon(delta=delta), rel=1e-9)
    assert strategy.get_epsilon(delta=1e-6) == pytest.approx(reference.get_epsilon(delta=1e-6), rel=1e-9)


@pytest.mark.parametrize("mechanism", ["prv", "rdp"])
def test_calibration_lands_on_target(mechanism):
    target, steps = 3.0, 6
    strategy = LongShieldStrategy(target_epsilon=target, accountant=mechanism, seed=0)
    fit(strategy, steps)
    epsilon = strategy.get_epsilon()
    assert target - 0.05 <= epsilon <= target
    assert strategy.privacy_plan.delta == pytest.approx(1 / (10 * DATASET))
    reference = create_accountant(mechanism)
    for _ in range(steps):
        reference.step(noise_multiplier=strategy.privacy_plan.noise_multiplier, sample_rate=BATCH / DATASET)
    assert epsilon == pytest.approx(reference.get_epsilon(delta=strategy.privacy_plan.delta), rel=1e-9)


def test_epsilon_is_in_the_progress_bar_and_the_logged_metrics():
    strategy = LongShieldStrategy(noise_multiplier=1.1, accountant="rdp", target_delta=1e-4, seed=0)
    trainer = fit(strategy, 3)
    assert trainer.progress_bar_metrics["epsilon"] == pytest.approx(strategy.get_epsilon(), rel=1e-6)
    assert trainer.callback_metrics["epsilon"].item() == pytest.approx(strategy.get_epsilon(), rel=1e-6)


def test_default_is_target_epsilon_8_and_is_announced(recwarn):
    strategy = LongShieldStrategy(accountant="rdp", seed=0)
    fit(strategy, 2)
    assert strategy.privacy_plan.target_epsilon == 8.0
    assert 7.9 <= strategy.get_epsilon() <= 8.0
    assert any("target_epsilon=8" in str(w.message) for w in recwarn)


def test_noise_zero_means_infinite_epsilon():
    strategy = LongShieldStrategy(noise_multiplier=0.0, seed=0)
    fit(strategy, 1)
    assert math.isinf(strategy.get_epsilon())


def test_training_stops_at_budget(recwarn):
    """With fixed noise and a budget, training stops cleanly at the last step that keeps epsilon within the target."""
    sigma, target, delta, q = 1.5, 2.0, 1e-4, BATCH / DATASET
    budget_steps = PrivacyAccountant("rdp").steps_within_budget(target, sigma, q, delta, limit=1000)
    assert 1 < budget_steps < 40
    strategy = LongShieldStrategy(noise_multiplier=sigma, target_epsilon=target, target_delta=delta,
                                  accountant="rdp", seed=0)
    trainer = fit(strategy, budget_steps + 10)
    assert trainer.global_step == budget_steps
    assert strategy.get_epsilon() <= target
    assert strategy.accountant.epsilon_after(1, sigma, q, delta) > target
    messages = [str(w.message) for w in recwarn]
    assert any(f"allows {budget_steps} of the {budget_steps + 10} planned steps" in m for m in messages)
    assert any("Stopping DP training" in m for m in messages)


def test_delta_must_be_below_one_over_dataset_size():
    with pytest.raises(ValueError, match="target_delta"):
        fit(LongShieldStrategy(noise_multiplier=1.0, target_delta=1 / DATASET), 1)


def test_steps_within_budget_is_the_exact_boundary():
    accountant = PrivacyAccountant("rdp")
    k = accountant.steps_within_budget(2.0, 0.9, 0.05, 1e-5, limit=10_000)
    assert accountant.epsilon_after(k, 0.9, 0.05, 1e-5) <= 2.0 < accountant.epsilon_after(k + 1, 0.9, 0.05, 1e-5)


# ----------------------------------------------------------------------------------------------- bounded PRV


def test_bounded_prv_equals_opacus_within_its_grid_and_never_exceeds_rdp():
    from lightning_longshield.privacy.epsilon import epsilon, prv_epsilon, rdp_epsilon

    for history in ([(0.8, 0.01, 1000)], [(1.0, 0.01, 100), (2.0, 0.02, 50)]):
        reference = create_accountant("prv")
        reference.history = list(history)
        assert epsilon(history, 1e-5, "prv") == pytest.approx(reference.get_epsilon(delta=1e-5), rel=1e-12)
    # Far outside Opacus's comfortable range: still a finite upper bound, at most the RDP bound.
    hard = [(0.5, 0.05, 100_000)]
    bounded = epsilon(hard, 1e-6, "prv")
    assert math.isfinite(bounded) and bounded <= rdp_epsilon(hard, 1e-6)
    # A coarser grid can only loosen the certified bound, never tighten it below the fine one.
    history = [(1.0, 0.02, 2000)]
    assert prv_epsilon(history, 1e-5, max_points=2**16) >= prv_epsilon(history, 1e-5) - 1e-9


@pytest.mark.parametrize(
    "sigma, q, steps",
    [(0.3, 0.5, 100_000), (0.3, 1e-5, 100_000), (20.0, 0.5, 100_000), (1.0, 1e-3, 100_000)],
)
def test_epsilon_answers_quickly_across_the_documented_range(sigma, q, steps):
    """A regression guard, not a benchmark (benchmarks/accounting_speed.py measures): before the grid cap some of
    these took minutes and gigabytes. The limit is generous for a loaded 2-core machine."""
    import time

    from lightning_longshield.privacy.epsilon import epsilon

    start = time.perf_counter()
    value = epsilon([(sigma, q, steps)], 1e-6, "prv")
    assert time.perf_counter() - start < 30
    assert value > 0 and math.isfinite(value)


def test_calibration_answers_quickly_and_meets_the_target():
    import time

    from lightning_longshield.privacy.epsilon import calibrate_noise_multiplier, epsilon

    start = time.perf_counter()
    sigma = calibrate_noise_multiplier(1.0, 1e-6, 0.01, 10_000, "prv")
    assert time.perf_counter() - start < 60
    assert 0.99 <= epsilon([(sigma, 0.01, 10_000)], 1e-6, "prv") <= 1.0


def test_full_batches_are_accounted_as_the_gaussian_mechanism_they_are():
    """At q = 1 Opacus's PRV variable takes log(1 - q) and failed, and the PRV accountant fell back to RDP's looser
    bound (16.86 instead of 15.78 at sigma 1.1, 10 steps, delta 1e-5), so calibration added noise. Ten Gaussian steps
    are one Gaussian mechanism: its exact delta at the returned epsilon is delta, and Opacus's PRV at q just below 1
    agrees within its own error."""
    from opacus.accountants import PRVAccountant
    from scipy.special import ndtr

    from lightning_longshield.privacy.epsilon import calibrate_noise_multiplier, epsilon

    delta = 1e-5
    spent = epsilon([(1.1, 1.0, 6), (1.1, 1.0, 4)], delta, "prv")
    mu = math.sqrt(10) / 1.1
    exact_delta = ndtr(mu / 2 - spent / mu) - math.exp(spent) * ndtr(-mu / 2 - spent / mu)
    assert delta * (1 - 1e-6) <= exact_delta <= delta
    opacus = PRVAccountant()
    opacus.history = [(1.1, 1 - 1e-6, 10)]
    assert abs(opacus.get_epsilon(delta) - spent) < 0.02 and spent < epsilon([(1.1, 1.0, 10)], delta, "rdp")
    sigma = calibrate_noise_multiplier(8.0, delta, 1.0, 10, "prv")
    assert 7.9 <= epsilon([(sigma, 1.0, 10)], delta, "prv") <= 8.0


@pytest.mark.parametrize("delta", [0.0, 1.0, 2.0, -1e-5])
def test_a_delta_outside_zero_one_is_refused(delta):
    """0 divided in PRV's grid, and 0.5 or 2 gave negative epsilons."""
    from lightning_longshield.privacy.epsilon import epsilon

    for mechanism in ("prv", "rdp"):
        with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
            epsilon([(1.0, 0.01, 100)], delta, mechanism)
