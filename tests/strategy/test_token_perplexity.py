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
