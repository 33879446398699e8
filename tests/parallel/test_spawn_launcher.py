"""Lightning's spawn launcher: a CP 2 run started from this process returns the full trained weights here."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_longshield import LongShieldStrategy
from tests.support.helpers import (
    RandomTokens,
    loader,
    make_module,
    make_trainer,
    reference_dp_sgd,
    samples,
    small_config,
)


@pytest.mark.slow
def test_spawned_context_parallel_run_returns_full_weights():
    dataset = RandomTokens(size=8, seq_len=16)
    module = make_module(small_config())
    initial = copy.deepcopy(module.model)
    strategy = LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=0.05, micro_batch_size=2,
                                  poisson_sampling=False, seed=0, start_method="spawn")
    make_trainer(strategy, max_steps=1, devices=2).fit(module, loader(dataset, 4))
    expected = reference_dp_sgd(initial, [samples(dataset, range(4))], 0.05, 4)
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(module.model.state_dict()[name], value, rtol=1e-4, atol=1e-6)
