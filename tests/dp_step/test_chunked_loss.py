"""The chunked loss (`loss_chunk_tokens`): the output head and the cross-entropy over chunks of positions give the
same per-sample losses and gradients as the whole logits, and the same DP step: the head's per-sample gradient is
the sum over its chunks, whether materialised, book-kept or clipped per layer."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torchmetrics.text import Perplexity

from lightning_longshield import LongShieldStrategy, ProjectedNorms
from lightning_longshield.loss import IGNORE_INDEX, chunked_per_sample_token_loss, per_sample_token_loss
from lightning_longshield.privacy.grad_sample.exchange import LocalExchange
from lightning_longshield.privacy.observer import DPStepObserver
from tests.support.helpers import (
    RandomTokens,
    assert_models_close,
    loader,
    make_lora_module,
    make_module,
    make_trainer,
    small_config,
)

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


def _fit(loss_chunk_tokens, tie_embeddings: bool, lora: bool = False, lora_targets=None,
         **strategy_kwargs) -> nn.Module:
    config = small_config(tie_embeddings=tie_embeddings)
    targets = {} if lora_targets is None else dict(target_modules=lora_targets)
    module = (make_lora_module(config, module_kwargs=dict(loss_chunk_tokens=loss_chunk_tokens), **targets) if lora
              else make_module(config, loss_chunk_tokens=loss_chunk_tokens))
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


@pytest.mark.filterwarnings("ignore:noise_seed")  # the projections of both runs drawn alike
@pytest.mark.parametrize("settings", [dict(norms="ghost"), dict(norms="mixed"), dict(clipping="per_layer"),
                                      dict(norms=ProjectedNorms("hutchinson", projection_dim=4), noise_seed=5)],
                         ids=["ghost", "mixed", "per-layer", "randomized"])
@pytest.mark.parametrize("tie_embeddings", [False, True], ids=["untied", "tied"])
def test_book_kept_norms_and_per_layer_clipping_sum_the_chunks(settings, tie_embeddings):
    """The head runs once per chunk: book-keeping takes the norm of the sum of its uses (as for a tied weight),
    per-layer clipping clips the head once all its chunks have arrived, and randomized norms project that sum."""
    settings = dict(micro_batch_size=2, **settings)
    assert_models_close(_fit(5, tie_embeddings, **settings), _fit(None, tie_embeddings, **settings))


@pytest.mark.parametrize("targets", [None, ["wq", "output"]], ids=["blocks", "blocks-and-head"])
def test_lora_adapters_take_the_same_step_chunked(targets, monkeypatch):
    """LoRA: the head (frozen, or adapted: PEFT's wrapper of the linear head) still runs per chunk; the adapters'
    per-sample gradients flow through every chunk."""
    from lightning_longshield import module as module_file

    chunked_calls = []
    chunked = module_file.chunked_token_loss_sums
    monkeypatch.setattr(module_file, "chunked_token_loss_sums", lambda *a: chunked_calls.append(1) or chunked(*a))
    settings = dict(micro_batch_size=2, lora_targets=targets)
    chunked_model = _fit(5, False, lora=True, **settings)
    assert chunked_calls  # the chunked loss ran
    assert_models_close(chunked_model, _fit(None, False, lora=True, **settings))


@pytest.mark.parametrize("chunk", [None, 5])
def test_validation_loss_and_perplexity_equal_the_whole_logits(chunk):
    """Validation runs chunked too: ``val_loss`` and ``val_perplexity`` (from token-loss sums) equal the whole logits'
    loss and torchmetrics' `Perplexity` of them. ``val_loss`` is the mean over the samples with a labelled token:
    sample 3 has none, and counted as a loss of 0 it pulled the mean down."""
    module = make_module(small_config(), loss_chunk_tokens=chunk)
    dataset = RandomTokens(size=6, seq_len=16)
    trainer = make_trainer(LongShieldStrategy(noise_multiplier=0.0, poisson_sampling=False, seed=0), max_steps=1)
    logged = trainer.validate(module, loader(dataset, 3), verbose=False)[0]
    batches = list(loader(dataset, 3))
    reference = Perplexity(ignore_index=IGNORE_INDEX)
    losses = []
    with torch.no_grad():
        for batch in batches:
            logits = module.model(batch["input_ids"])
            labelled = (batch["labels"] != IGNORE_INDEX).any(dim=1)
            losses.append(per_sample_token_loss(logits, batch["labels"])[labelled])
            reference.update(logits, batch["labels"])
    assert len(torch.cat(losses)) == 5
    assert logged["val_loss"] == pytest.approx(torch.cat(losses).mean().item(), rel=1e-6)
    assert logged["val_perplexity"] == pytest.approx(reference.compute().item(), rel=1e-5)


@pytest.mark.parametrize("value", [0, -3, 2.5, "whole", True])
def test_a_bad_chunk_size_is_refused(value):
    with pytest.raises(ValueError, match="loss_chunk_tokens must be 'auto', None .* or a positive integer"):
        make_module(small_config(), loss_chunk_tokens=value)


def test_a_chunks_head_gradient_is_added_into_the_running_sum_not_formed_beside_it():
    """From the second chunk on, the head's outer products go straight into the sum of the chunks before them: one
    ``(B, vocab, dim)`` tensor in backward, not two (the planner counts one at CP 1)."""
    formed = []

    class Formed(DPStepObserver):
        def per_sample_gradient(self, grad_sample: torch.Tensor) -> None:
            formed.append(tuple(grad_sample.shape))

    torch.manual_seed(0)
    head = nn.Linear(4, 6, bias=False)
    exchange = LocalExchange()
    exchange.observer = Formed()
    exchange.start_microbatch(2)
    exchange.count_uses({"head": 3})
    chunks = [(torch.randn(2, 5, 4), torch.randn(2, 5, 6)) for _ in range(3)]
    for activation, grad_output in chunks:
        exchange.receive(head, activation, grad_output, lambda layer, param: "head")
    expected = sum(torch.einsum("btp,btd->bpd", grad_output, activation) for activation, grad_output in chunks)
    torch.testing.assert_close(exchange.finish()["head"], expected)
    assert formed == [(2, 6, 4)]


@pytest.mark.parametrize("norms", ["materialize", "mixed"])
def test_a_materialised_heads_chunks_form_one_per_sample_tensor(norms, monkeypatch):
    """``"mixed"`` materialises the head at long sequences through the book-keeper, which formed each chunk's
    ``(B, vocab, dim)`` tensor and added it; the exchange now adds every chunk after the first in place."""
    formed = collections.Counter()
    store = LocalExchange.store

    def counted(self, name, grad_sample):
        formed[name] += 1
        return store(self, name, grad_sample)

    monkeypatch.setattr(LocalExchange, "store", counted)
    strategy = LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=CLIP, poisson_sampling=False, seed=0,
                                  micro_batch_size=2, norms=norms)
    module = make_module(small_config(), loss_chunk_tokens=16)
    make_trainer(strategy, max_steps=1).fit(module, loader(RandomTokens(size=4, seq_len=64), 4))
    assert strategy.dp_engine.per_sample_methods()["model.output.weight"] == "materialize"
    assert formed["model.output.weight"] == 2  # one per micro-batch, not one per chunk (4 chunks each)
