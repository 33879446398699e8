"""`TokenPerplexity` over token-loss sums: no labelled token gives no score."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_longshield.token_perplexity import TokenPerplexity


def test_perplexity_is_the_exponent_of_the_mean_token_loss():
    metric = TokenPerplexity()
    metric.update(torch.tensor(3.0), torch.tensor(2))
    metric.update(torch.tensor(1.0), torch.tensor(2))
    assert metric.compute().item() == pytest.approx(math.exp(1.0))


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric TokenPerplexity was called before")
def test_no_labelled_token_gives_nan_not_a_perfect_score():
    """With no update, or only ignored labels, it returned exp(0) = 1.0, the best perplexity there is."""
    metric = TokenPerplexity()
    assert math.isnan(metric.compute().item())
    metric.update(torch.tensor(0.0), torch.tensor(0))
    assert math.isnan(metric.compute().item())


def test_the_loss_sum_stays_fp64_in_a_bf16_true_module():
    """Lightning converts a bf16-true module with ``.to(torch.bfloat16)``, which torchmetrics does not guard: the sum
    was kept in bf16, and 200 batches of loss 3 a token gave a perplexity of 35.25. Its device still follows."""
    from lightning.pytorch.plugins.precision import HalfPrecision

    holder = torch.nn.Module()
    holder.perplexity, holder.layer = TokenPerplexity(), torch.nn.Linear(2, 2)
    holder = HalfPrecision("bf16-true").convert_module(holder)
    assert holder.layer.weight.dtype == torch.bfloat16 and holder.perplexity.loss_sum.dtype == torch.float64
    for _ in range(200):
        holder.perplexity.update(torch.tensor(24576.0), torch.tensor(8192))
    assert holder.perplexity.compute().item() == pytest.approx(math.exp(3.0))
    holder.perplexity.reset()
    assert holder.perplexity.loss_sum.dtype == torch.float64
    holder.to("meta")
    assert holder.perplexity.loss_sum.device.type == "meta"
