"""The noise of one DP step: N(0, (sigma C)^2) per coordinate of the summed gradient, divided by the batch size."""

from __future__ import annotations

import copy

import pytest
import torch
from scipy import stats

from helpers import RandomTokens, loader, make_module, make_trainer, small_config
from lightning_longshield import LongShieldStrategy

SIGMA, CLIP, BATCH = 1.3, 0.7, 4


def one_step_update(noise_multiplier: float, seed: int) -> torch.Tensor:
    """Flattened parameter change of one SGD(lr=1) DP step on fixed data and a fixed initial model."""
    module = make_module(small_config())
    initial = torch.cat([p.detach().flatten().clone() for p in module.parameters()])
    strategy = LongShieldStrategy(
        noise_multiplier=noise_multiplier, max_grad_norm=CLIP, micro_batch_size=2, poisson_sampling=False, seed=seed
    )
    make_trainer(strategy, max_steps=1).fit(module, loader(RandomTokens(size=8), BATCH))
    return torch.cat([p.detach().flatten() for p in module.parameters()]) - initial


@pytest.fixture(scope="module")
def updates():
    return {
        "clean": one_step_update(0.0, seed=0),
        "seed0": one_step_update(SIGMA, seed=0),
        "seed1": one_step_update(SIGMA, seed=1),
        "seed0_again": one_step_update(SIGMA, seed=0),
    }


def test_noise_has_std_sigma_c_over_b(updates):
    noise = -(updates["seed0"] - updates["clean"])  # update = -(clipped_sum + noise) / B
    expected_std = SIGMA * CLIP / BATCH
    n = noise.numel()
    assert n > 10_000
    # Sample std of n Gaussians has relative standard error 1/sqrt(2n) (~0.5% here); allow 5 of them.
    assert abs(noise.std().item() / expected_std - 1) < 5 / (2 * n) ** 0.5
    assert abs(noise.mean().item()) < 5 * expected_std / n**0.5
    assert stats.kstest((noise / expected_std).numpy(), "norm").pvalue > 1e-3


def test_noise_is_fresh_across_seeds_and_reproducible_per_seed(updates):
    noise0 = updates["seed0"] - updates["clean"]
    noise1 = updates["seed1"] - updates["clean"]
    correlation = torch.corrcoef(torch.stack([noise0, noise1]))[0, 1].item()
    assert abs(correlation) < 5 / noise0.numel() ** 0.5
    torch.testing.assert_close(updates["seed0"], updates["seed0_again"])


def test_noise_is_drawn_once_per_step_not_per_microbatch():
    """Same noise variance whatever the micro-batch size: noise goes on the logical batch's sum only."""
    deltas = {}
    for micro_batch_size in (1, 4):
        module = make_module(small_config())
        initial = copy.deepcopy(module.state_dict())
        strategy = LongShieldStrategy(noise_multiplier=1000.0, max_grad_norm=1e-3, micro_batch_size=micro_batch_size,
                                      poisson_sampling=False, seed=3)
        make_trainer(strategy, max_steps=1).fit(module, loader(RandomTokens(size=8), BATCH))
        deltas[micro_batch_size] = torch.cat([(v - initial[k]).flatten() for k, v in module.state_dict().items()])
    # The clipped sum has norm <= B * C = 4e-3 over all coordinates, so the update is noise (std 0.25) to
    # within 1e-3 per coordinate: same seed, same noise, whatever the micro-batching.
    torch.testing.assert_close(deltas[1], deltas[4], rtol=0, atol=2e-3)
    assert abs(deltas[1].std().item() / (1000.0 * 1e-3 / BATCH) - 1) < 0.05
