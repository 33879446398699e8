"""The chunked loss (`loss_chunk_tokens`): the output head and the cross-entropy over chunks of positions give the
same per-sample losses and gradients as the whole logits, and the same DP step: the head's per-sample gradient is
the sum over its chunks, whether materialised, book-kept or clipped per layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_longshield import LongShieldStrategy
from lightning_longshield.loss import IGNORE_INDEX, chunked_per_sample_token_loss, per_sample_token_loss
from tests.support.helpers import RandomTokens, assert_models_close, loader, make_module, make_trainer, small_config

BATCH, STEPS, CLIP = 4, 2, 0.05


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])  # T = 16: one token, uneven chunks, exactly T, more than T
def test_losses_and_gradients_equal_the_whole_logits(chunk):
    torch.manual_seed(0)
    head = nn.Linear(8, 32)
    hidden = torch.randn(3, 16, 8, requires_grad=True)
    labels = torch.randint(0, 32, (3, 16))
    labels[1, ::3] = IGNORE_INDEX
    labels[2] = IGNORE_INDEX  # a sample with no labelled token: loss 0, gradient 0
    counts = torch.tensor([16, 20, 1])  # as a shard of a longer sequence passes them
    for token_counts in (None, counts):
        expected = per_sample_token_loss(head(hidden), labels, token_counts)
        grads = torch.autograd.grad(expected.sum() * 3, [hidden, *head.parameters()])
        chunked = chunked_per_sample_token_loss(hidden, head, labels, token_counts, chunk)
        torch.testing.assert_close(chunked, expected)
        for actual, reference in zip(torch.autograd.grad(chunked.sum() * 3, [hidden, *head.parameters()]), grads):
            torch.testing.assert_close(actual, reference)


def _fit(loss_chunk_tokens, tie_embeddings: bool, **strategy_kwargs) -> nn.Module:
    module = make_module(small_config(tie_embeddings=tie_embeddings), loss_chunk_tokens=loss_chunk_tokens)
    strategy = LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=CLIP, poisson_sampling=False, seed=0,
                                  **strategy_kwargs)
    make_trainer(strategy, max_steps=STEPS).fit(module, loader(RandomTokens(size=BATCH * STEPS, seq_len=16), BATCH))
    return module.model


@pytest.mark.parametrize("tie_embeddings", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("micro_batch_size, activation_checkpointing", [(1, False), (2, False), (2, True)],
                         ids=["mbs1", "mbs2", "mbs2-checkpointed"])
def test_the_dp_step_equals_the_unchunked_one(micro_batch_size, activation_checkpointing, tie_embeddings):
    settings = dict(micro_batch_size=micro_batch_size, activation_checkpointing=activation_checkpointing)
    assert_models_close(_fit(5, tie_embeddings, **settings), _fit(None, tie_embeddings, **settings))


@pytest.mark.parametrize("settings", [dict(norms="ghost"), dict(norms="mixed"), dict(clipping="per_layer")],
                         ids=["ghost", "mixed", "per-layer"])
@pytest.mark.parametrize("tie_embeddings", [False, True], ids=["untied", "tied"])
def test_book_kept_norms_and_per_layer_clipping_sum_the_chunks(settings, tie_embeddings):
    """The head runs once per chunk: book-keeping takes the norm of the sum of its uses (as for a tied weight) and
    per-layer clipping clips the head once all its chunks have arrived."""
    settings = dict(micro_batch_size=2, **settings)
    assert_models_close(_fit(5, tie_embeddings, **settings), _fit(None, tie_embeddings, **settings))


def test_a_bad_chunk_size_is_refused():
    with pytest.raises(ValueError, match="loss_chunk_tokens must be a positive integer"):
        make_module(small_config(), loss_chunk_tokens=0)
