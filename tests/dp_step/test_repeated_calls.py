"""A layer called more than once in one forward (a layer reused, an output layer applied per chunk of the loss): its
per-sample gradient is the sum of its calls, on every path. Each call counts as a use, so materialised gradients
are summed, book-keeping takes the norm of the sum (as for a tied weight), per-layer clipping clips the sum once
all uses arrived, and the fused kernel hands such a layer to the summing path; each equals a per-sample loop."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_longshield import StrategyConfig
from lightning_longshield.loss import per_sample_token_loss
from lightning_longshield.privacy import DPSGDEngine, GaussianNoise, PerSampleGradCapture, PrivacyAccountant

CLIP = 0.05
BATCH = 3


class Twice(nn.Module):
    """``mix`` (no bias: a weight-only linear layer, as the fused kernel takes) runs twice in every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.mix = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(torch.tanh(self.mix(self.embed(ids))))))


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return per_sample_token_loss(model(ids), ids).sum()


def _reference(model: nn.Module, ids: torch.Tensor, per_layer: bool) -> dict[str, torch.Tensor]:
    """Each sample's whole gradient (autograd sums the calls), clipped flat to CLIP or each tensor to CLIP / sqrt(L),
    summed over the samples."""
    params = dict(model.named_parameters())
    bound = CLIP / math.sqrt(len(params))
    expected = {name: torch.zeros_like(p) for name, p in params.items()}
    for sample in ids:
        model.zero_grad()
        _loss(model, sample[None]).backward()
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params.values()))
        for name, p in params.items():
            own = float(p.grad.double().norm())
            factor = min(1.0, bound / own) if per_layer else min(1.0, CLIP / norm)
            expected[name] += factor * p.grad
    model.zero_grad()
    return expected


@pytest.mark.parametrize("config", [StrategyConfig(), StrategyConfig(norms="ghost"), StrategyConfig(norms="mixed"),
                                    StrategyConfig(clipping="per_layer")],
                         ids=["materialized", "ghost", "mixed", "per-layer"])
def test_a_repeated_layer_is_clipped_as_the_sum_of_its_calls(config):
    torch.manual_seed(0)
    model, ids = Twice(), torch.randint(0, 16, (BATCH, 6))
    expected = _reference(model, ids, per_layer=config.per_layer is not None)
    engine = DPSGDEngine(model, CLIP, GaussianNoise(torch.device("cpu")), PrivacyAccountant("rdp"), config=config)
    engine.begin_logical_batch()
    engine.prepare_microbatch(BATCH)
    _loss(model, ids).backward()
    engine.accumulate_microbatch(BATCH)
    engine.release(0.0, 1.0, 1.0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_randomized_norms_take_a_repeated_layer_as_one_weight():
    from lightning_longshield.privacy.randomness import SecretKey

    model = Twice()
    engine = DPSGDEngine(model, CLIP, GaussianNoise(torch.device("cpu")), PrivacyAccountant("rdp"),
                         config=StrategyConfig(norms="hutchinson"), projection_key=SecretKey(b"k" * 32))
    engine.begin_logical_batch()
    engine.prepare_microbatch(BATCH)
    _loss(model, torch.randint(0, 16, (BATCH, 6))).backward()
    engine.accumulate_microbatch(BATCH)
    assert engine.capture.bookkeeper.shared >= {"mix.weight"}
    assert engine.last_per_sample_norms is not None and torch.isfinite(engine.last_per_sample_norms).all()


def test_the_fused_kernel_leaves_a_repeated_layer_to_the_summing_path():
    model = Twice()
    capture = PerSampleGradCapture(model)
    handed = []
    assert "mix.weight" in capture.fuse_linear_weights(lambda name, activation, grad_output: handed.append(name))
    capture.start_microbatch(BATCH)
    _loss(model, torch.randint(0, 16, (BATCH, 6))).backward()
    assert "mix.weight" not in handed and capture.uses["mix.weight"] == 2
    assert capture.collect()["mix.weight"].shape == (BATCH, 8, 8)
