"""The noise of one DP step: N(0, (sigma C)^2) per coordinate of the summed gradient, divided by the batch size,
drawn from secret randomness (a public ``seed`` fixes the model's initialisation, never the noise)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from scipy import stats

from lightning_longshield import CausalLMModule, LongShieldStrategy
from lightning_longshield.privacy import GaussianNoise
from lightning_longshield.privacy.keystream_normals import BLOCK_VALUES
from tests.support.helpers import (
    RandomTokens,
    flat_parameters,
    full_state,
    loader,
    make_module,
    make_trainer,
    small_config,
)

SIGMA, CLIP, BATCH = 1.3, 0.7, 4


class RecordInitialParameters(Callback):
    def on_train_start(self, trainer, pl_module):
        self.initial = flat_parameters(pl_module)


def one_step(noise_multiplier: float, **strategy_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(initial parameters, parameter change) of one SGD(lr=1) DP step on fixed data.

    The model is built inside ``fit`` (after the strategy seeds the global RNGs), and the global RNG is disturbed
    before each run, so equal initial parameters can only come from the strategy's ``seed``.
    """
    torch.manual_seed(torch.seed())
    module = CausalLMModule(small_config(), optimizer="sgd", learning_rate=1.0)
    strategy = LongShieldStrategy(
        noise_multiplier=noise_multiplier, max_grad_norm=CLIP, micro_batch_size=2, poisson_sampling=False,
        **strategy_kwargs,
    )
    recorder = RecordInitialParameters()
    make_trainer(strategy, max_steps=1, callbacks=[recorder]).fit(module, loader(RandomTokens(size=8), BATCH))
    final = flat_parameters(module)
    return recorder.initial, final - recorder.initial


@pytest.fixture(scope="module")
def runs():
    return {
        "clean": one_step(0.0, seed=0),
        "seed0": one_step(SIGMA, seed=0),
        "seed0_again": one_step(SIGMA, seed=0),
        "noise_seed0": one_step(SIGMA, seed=0, noise_seed=0),
        "noise_seed0_again": one_step(SIGMA, seed=0, noise_seed=0),
        "noise_seed1": one_step(SIGMA, seed=0, noise_seed=1),
    }


def noise_of(runs, name: str) -> torch.Tensor:
    return -(runs[name][1] - runs["clean"][1])  # update = -(clipped_sum + noise) / B


def test_noise_has_std_sigma_c_over_b(runs):
    noise = noise_of(runs, "noise_seed0")  # a fixed draw, so the statistical checks below cannot flake
    expected_std = SIGMA * CLIP / BATCH
    n = noise.numel()
    assert n > 10_000
    # Sample std of n Gaussians has relative standard error 1/sqrt(2n) (~0.5% here); allow 5 of them.
    assert abs(noise.std().item() / expected_std - 1) < 5 / (2 * n) ** 0.5
    assert abs(noise.mean().item()) < 5 * expected_std / n**0.5
    assert stats.kstest((noise / expected_std).numpy(), "norm").pvalue > 1e-3


def test_public_seed_fixes_the_initialisation_but_not_the_noise(runs):
    """Two runs with seed=0 start from the same model and release independent noise: the difference of their
    updates has norm sqrt(2) sigma C sqrt(d) / B (two independent draws), not 0."""
    (initial, update), (initial_again, update_again) = runs["seed0"], runs["seed0_again"]
    torch.testing.assert_close(initial, initial_again, rtol=0, atol=0)
    torch.testing.assert_close(initial, runs["clean"][0], rtol=0, atol=0)
    d = update.numel()
    expected = 2**0.5 * SIGMA * CLIP * d**0.5 / BATCH
    assert abs((update - update_again).norm().item() / expected - 1) < 0.05
    correlation = torch.corrcoef(torch.stack([noise_of(runs, "seed0"), noise_of(runs, "seed0_again")]))[0, 1]
    assert abs(correlation.item()) < 5 / d**0.5


def test_noise_seed_is_the_explicit_reproducible_mode(runs):
    torch.testing.assert_close(runs["noise_seed0"][1], runs["noise_seed0_again"][1], rtol=0, atol=0)
    noise0, noise1 = noise_of(runs, "noise_seed0"), noise_of(runs, "noise_seed1")
    correlation = torch.corrcoef(torch.stack([noise0, noise1]))[0, 1].item()
    assert abs(correlation) < 5 / noise0.numel() ** 0.5


def test_noise_seed_warns_that_the_seed_must_stay_secret():
    with pytest.warns(UserWarning, match="holds only while the seed stays secret"):
        LongShieldStrategy(noise_multiplier=1.0, noise_seed=0)


def test_noise_is_drawn_once_per_step_not_per_microbatch():
    """Same noise variance whatever the micro-batch size: noise goes on the logical batch's sum only."""
    deltas = {}
    for micro_batch_size in (1, 4):
        module = make_module(small_config())
        initial = full_state(module)
        strategy = LongShieldStrategy(noise_multiplier=1000.0, max_grad_norm=1e-3, micro_batch_size=micro_batch_size,
                                      poisson_sampling=False, noise_seed=3)
        make_trainer(strategy, max_steps=1).fit(module, loader(RandomTokens(size=8), BATCH))
        deltas[micro_batch_size] = torch.cat([(v - initial[k]).flatten() for k, v in full_state(module).items()])
    # The clipped sum has norm <= B * C = 4e-3 over all coordinates, so the update is noise (std 0.25) to
    # within 1e-3 per coordinate: same noise seed, same noise, whatever the micro-batching.
    torch.testing.assert_close(deltas[1], deltas[4], rtol=0, atol=2e-3)
    assert abs(deltas[1].std().item() / (1000.0 * 1e-3 / BATCH) - 1) < 0.05


@pytest.mark.parametrize("secure_mode", [False, True], ids=["default", "secure"])
def test_noise_sources_draw_the_requested_gaussian_and_never_repeat(secure_mode):
    """Default (per-process secret) and secure (fresh OS entropy per tensor) sources: N(0, std^2), and two
    sources, or two steps of one, never repeat a draw."""
    std, shape = 0.37, (200_000,)
    noises = [GaussianNoise(torch.device("cpu"), secure_mode=secure_mode) for _ in range(2)]
    draws = []
    for noise in noises:
        for step in (0, 1):
            noise.start_step(step)
            draws.append(noise.sample(torch.Size(shape), std, torch.device("cpu")))
    for draw in draws:
        assert draw.dtype == torch.float32
        assert abs(draw.std().item() / std - 1) < 5 / (2 * draw.numel()) ** 0.5
    # One Kolmogorov-Smirnov test over all draws (fresh OS entropy each run): one chance in 1000 to flake, not 4.
    assert stats.kstest((torch.cat(draws) / std).numpy(), "norm").pvalue > 1e-3
    correlations = torch.corrcoef(torch.stack(draws))
    off_diagonal = correlations[~torch.eye(len(draws), dtype=torch.bool)]
    assert off_diagonal.abs().max().item() < 5 / shape[0] ** 0.5


def test_secure_mode_and_noise_seed_are_exclusive():
    with pytest.raises(ValueError, match="remove noise_seed"):
        LongShieldStrategy(noise_multiplier=1.0, secure_mode=True, noise_seed=0)


@pytest.mark.parametrize("numel", [7, 100_003, BLOCK_VALUES + 3])
def test_the_release_adds_noise_in_place_on_cpu_with_the_draws_of_a_whole_tensor(numel):
    """On CPU the noise is formed a block at a time and added to the sum in place: the values are those of one draw
    of the whole tensor added to the scaled sum (the same stream, the same distribution), and no tensor of noise is
    allocated."""
    from lightning_longshield.privacy.randomness import SecretKey

    total = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    expected_noise, in_place = (GaussianNoise(torch.device("cpu"), SecretKey.from_seed(5)) for _ in range(2))
    expected_noise.start_step(2)
    in_place.start_step(2)
    expected = expected_noise.sample(total.shape, 0.5, torch.device("cpu")).add_(total, alpha=0.25)
    storage = total.data_ptr()
    result = in_place.add_to_scaled(total, 0.25, 0.5)
    assert result.data_ptr() == storage
    torch.testing.assert_close(result, expected, rtol=0, atol=1e-6)
    residual = (result - 0.25 * torch.randn(numel, generator=torch.Generator().manual_seed(1))) / 0.5
    if numel > 1000:
        assert stats.kstest(residual.numpy(), "norm").pvalue > 1e-4
