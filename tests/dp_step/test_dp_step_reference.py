"""DP-SGD updates equal an independent per-sample-loop reference (noise 0, SGD lr 1)."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_longshield import LongShieldStrategy
from tests.support.helpers import (
    RandomTokens,
    assert_models_close,
    full_state,
    loader,
    make_module,
    make_trainer,
    reference_dp_sgd,
    samples,
    small_config,
)

BATCH = 4


class SnapshotAfterFirstStep(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            self.model = full_state(pl_module.model)


@pytest.mark.parametrize("micro_batch_size", [1, 2])
@pytest.mark.parametrize("max_grad_norm", [0.05, 1e6], ids=["clipping", "no-clipping"])
@pytest.mark.parametrize("tie_embeddings", [False, True], ids=["untied", "tied"])
def test_updates_match_per_sample_loop(micro_batch_size, max_grad_norm, tie_embeddings):
    dataset = RandomTokens(size=16, seq_len=16)
    module = make_module(small_config(tie_embeddings=tie_embeddings))
    initial = copy.deepcopy(module.model)
    strategy = LongShieldStrategy(
        noise_multiplier=0.0, max_grad_norm=max_grad_norm, micro_batch_size=micro_batch_size,
        poisson_sampling=False, seed=0,
    )
    snapshot = SnapshotAfterFirstStep()
    make_trainer(strategy, max_steps=3, callbacks=[snapshot]).fit(module, loader(dataset, BATCH))

    batches = [samples(dataset, range(k * BATCH, (k + 1) * BATCH)) for k in range(3)]
    assert_models_close(snapshot.model, reference_dp_sgd(initial, batches[:1], max_grad_norm, BATCH))
    assert_models_close(module.model, reference_dp_sgd(initial, batches, max_grad_norm, BATCH))


def test_clipping_is_active_in_clipping_case():
    """Guard against a vacuous test: the small bound really clips every sample, the large one none."""
    dataset = RandomTokens(size=4, seq_len=16, ignore=False)
    module = make_module(small_config())
    strategy = LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=0.05, micro_batch_size=4,
                                  poisson_sampling=False, seed=0)
    make_trainer(strategy, max_steps=1).fit(module, loader(dataset, 4))
    norms = strategy.dp_engine.last_per_sample_norms
    assert norms.dtype == torch.float64 and norms.shape == (4,)
    assert (norms > 0.05).all() and (norms < 1e6).all()


def test_untouched_parameters_raise_clear_error():
    """A parameter used outside its module (functional weight sharing) would get a summed gradient: refused."""
    class SneakyTie(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(64, 8)
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, ids, position_ids=None):
            return self.proj(self.embed(ids)) @ self.embed.weight.T

    module = make_module(small_config())
    module.model = SneakyTie()
    strategy = LongShieldStrategy(noise_multiplier=0.0, micro_batch_size=2, poisson_sampling=False, seed=0)
    with pytest.raises(RuntimeError, match="outside a supported layer"):
        make_trainer(strategy, max_steps=1).fit(module, loader(RandomTokens(size=4, seq_len=8), 2))
