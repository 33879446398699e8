"""bf16 precisions train, with norms and noise in fp32, and stay close to the fp32 update; fp64 parameters are
refused."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_longshield import LongShieldStrategy, StrategyConfig
from lightning_longshield.privacy import DPSGDEngine, GaussianNoise, PrivacyAccountant
from lightning_longshield.privacy.accumulator import ClippedGradientSum
from lightning_longshield.privacy.randomness import SecretKey
from tests.support.helpers import (
    RandomTokens,
    loader,
    make_module,
    make_trainer,
    reference_dp_sgd,
    samples,
    small_config,
    whole,
)


class RecordGradients(Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.gradient = torch.cat([whole(p.grad).float().flatten() for p in pl_module.model.parameters()])


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("micro_batch_size", [1, 2])
def test_bf16_private_gradient_close_to_fp32_reference(precision, micro_batch_size):
    dataset = RandomTokens(size=8, seq_len=16)
    module = make_module(small_config(), learning_rate=1.0)
    initial = copy.deepcopy(module.model)
    strategy = LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=0.1, micro_batch_size=micro_batch_size,
                                  poisson_sampling=False, seed=0)
    recorder = RecordGradients()
    make_trainer(strategy, max_steps=1, precision=precision, callbacks=[recorder]).fit(module, loader(dataset, 4))
    assert strategy.dp_engine.last_per_sample_norms.dtype == torch.float64
    expected = reference_dp_sgd(initial, [samples(dataset, range(4))], 0.1, 4)
    pairs = zip(initial.parameters(), expected.parameters())
    expected_gradient = torch.cat([(p - q).detach().flatten() for p, q in pairs])
    relative_error = (recorder.gradient - expected_gradient).norm() / expected_gradient.norm()
    assert relative_error < 0.05


def test_sums_and_noise_are_fp32_for_bf16_parameters():
    param = torch.nn.Parameter(torch.zeros(1000, dtype=torch.bfloat16))
    accumulator = ClippedGradientSum({"w": param})
    grad_samples = torch.full((2, 1000), 1e-3, dtype=torch.bfloat16)
    for _ in range(300):  # 300 additions of 2e-3 would stall near 0.5 in bf16 accumulation
        accumulator.add({"w": grad_samples}, torch.ones(2))
    assert accumulator.sums["w"].dtype == torch.float32
    torch.testing.assert_close(accumulator.sums["w"], torch.full((1000,), 0.6), rtol=1e-2, atol=0)
    noise = GaussianNoise(torch.device("cpu"), SecretKey.from_seed(0))
    noise.start_step(0)
    accumulator.release(noise, noise_std=1e-3, expected_batch_size=1.0)
    assert param.grad.dtype == torch.bfloat16 and accumulator.sums == {}
    assert 0.5 < param.grad.float().mean().item() < 0.7


@pytest.mark.parametrize("config", [
    StrategyConfig(), StrategyConfig(clipping="per_layer"), StrategyConfig(norms="ghost"),
    StrategyConfig(norms="mixed"), StrategyConfig(norms="hutchinson"),
], ids=["flat", "per-layer", "ghost", "mixed", "hutchinson"])
def test_fp64_trainable_parameters_are_refused_on_every_path_with_the_fix(config: StrategyConfig):
    """Per-sample norms are fp32 reductions, which torch refuses for fp64 input: every path failed in the first
    micro-batch with torch's "convertible without narrowing". Refused when the engine is built, the model left as
    it was; a frozen fp64 parameter is kept."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.RMSNorm(4), torch.nn.Linear(4, 3))
    model[2].double()

    def engine() -> DPSGDEngine:
        return DPSGDEngine(model, 1.0, GaussianNoise(torch.device("cpu")), PrivacyAccountant("rdp"), config=config,
                           projection_key=SecretKey(b"p" * 32))

    with pytest.raises(ValueError, match=r"2.weight \(torch.float64\); 2.bias \(torch.float64\).*in fp32"):
        engine()
    assert "forward" not in model[0].__dict__  # nothing installed on the model
    model[2].requires_grad_(False)
    engine()
