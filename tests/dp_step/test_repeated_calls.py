"""A layer called more than once in one forward: its per-sample gradient is the sum of its calls. Materialised
per-sample gradients are clipped as that sum (equal to a per-sample loop); the paths that would clip or take the norm
of each call apart (book-kept norms of an unshared weight, the fused per-layer kernel) refuse it during backward,
before anything is released."""

from __future__ import annotations

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


def test_materialised_per_sample_gradients_are_the_sum_of_the_calls():
    torch.manual_seed(0)
    model, ids = Twice(), torch.randint(0, 16, (BATCH, 6))
    expected = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for sample in ids:  # the reference: each sample's whole gradient, clipped to CLIP, summed
        model.zero_grad()
        _loss(model, sample[None]).backward()
        norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
        factor = min(1.0, CLIP / float(norm))
        for name, p in model.named_parameters():
            expected[name] += factor * p.grad
    model.zero_grad()
    engine = DPSGDEngine(model, CLIP, GaussianNoise(torch.device("cpu")), PrivacyAccountant("rdp"))
    engine.begin_logical_batch()
    engine.prepare_microbatch(BATCH)
    _loss(model, ids).backward()
    engine.accumulate_microbatch(BATCH)
    engine.release(0.0, 1.0, 1.0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("norms", ["ghost", "mixed", "hutchinson"])
def test_book_kept_norms_refuse_a_repeated_call(norms):
    from lightning_longshield.privacy.randomness import SecretKey

    model = Twice()
    engine = DPSGDEngine(model, CLIP, GaussianNoise(torch.device("cpu")), PrivacyAccountant("rdp"),
                         config=StrategyConfig(norms=norms), projection_key=SecretKey(b"k" * 32))
    engine.begin_logical_batch()
    engine.prepare_microbatch(BATCH)
    ids = torch.randint(0, 16, (BATCH, 6))
    with pytest.raises(RuntimeError, match=r"Linear \(mix.weight\) ran more than once in one forward"):
        _loss(model, ids).backward()


def test_the_fused_kernel_path_refuses_a_repeated_call():
    model = Twice()
    capture = PerSampleGradCapture(model)
    fused = capture.fuse_linear_weights(lambda name, activation, grad_output: None)
    assert "mix.weight" in fused
    capture.start_microbatch(BATCH)
    with pytest.raises(RuntimeError, match="the fused per-layer kernel would clip each call apart"):
        _loss(model, torch.randint(0, 16, (BATCH, 6))).backward()
