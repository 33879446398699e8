"""After a DP fit, `CausalLMModule` tests (``test_loss``, ``test_perplexity``, as validation computes them) and
predicts (the logits of each batch's ``input_ids``) on one process."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn

from lightning_longshield import CausalLMModule, LongShieldStrategy
from lightning_longshield.context_parallel.evaluation import check_evaluation_layout
from tests.support.helpers import RandomTokens, loader, make_module, make_trainer, small_config


def test_test_and_predict_after_a_dp_fit():
    data = RandomTokens(size=16, seq_len=8)
    module = make_module(small_config(n_layers=1))
    trainer = make_trainer(LongShieldStrategy(noise_multiplier=1.0, target_delta=1e-3), max_steps=1)
    trainer.fit(module, loader(data, 4))

    (tested,) = trainer.test(module, loader(data, 4), verbose=False)
    (validated,) = trainer.validate(module, loader(data, 4), verbose=False)
    assert tested["test_loss"] == validated["val_loss"]
    assert math.isclose(tested["test_perplexity"], validated["val_perplexity"], rel_tol=1e-6)

    predictions = trainer.predict(module, loader(data, 4))
    batch = next(iter(loader(data, 4)))
    with torch.no_grad():
        expected = module(batch["input_ids"])
    assert len(predictions) == 4 and predictions[0].shape == (4, 8, module.config.vocab_size)
    torch.testing.assert_close(predictions[0], expected)


def test_predict_on_several_processes_is_refused_with_the_fix():
    """Over data-parallel groups each process predicted its part of the records, padded with repeats, and nothing
    gathered them (and Lightning's index wrapper made the split refuse a plain DataLoader with another cause)."""
    module = make_module(small_config())
    with pytest.raises(RuntimeError, match="on 2 processes would return each data-parallel group's part of the"):
        check_evaluation_layout(module, TrainerFn.PREDICTING, 1, "context_parallel", processes=2)
    check_evaluation_layout(module, TrainerFn.VALIDATING, 1, "context_parallel", processes=2)
    check_evaluation_layout(module, TrainerFn.PREDICTING, 1, "context_parallel", processes=1)


class TokenMeanModule(CausalLMModule):
    """A module of one's own: the token mean of its batch's loss, logged without ``batch_size``."""

    def validation_step(self, batch, batch_idx):
        logits = self(batch["input_ids"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        self.log("own_val_loss", loss)


def test_an_own_modules_validation_weighs_the_records_with_a_label():
    """Split over data-parallel groups, an evaluation set's padding repeats have every label ignored, and Lightning
    counted them in a batch's size, weighing the real records of a padded batch twice. What an evaluation step logs
    without batch_size now weighs as its records with a label, as `CausalLMModule`'s own; record 3 of `RandomTokens`
    has no label, standing in for a repeat."""
    module = make_module(small_config(), optimizer="sgd")
    module.__class__ = TokenMeanModule
    data = RandomTokens(size=6, seq_len=8)
    trainer = make_trainer(LongShieldStrategy(noise_multiplier=1.0), max_steps=1)
    (result,) = trainer.validate(module, loader(data, 2))
    losses, weights = [], [2, 1, 2]  # batches (0, 1), (2, 3), (4, 5)
    with torch.no_grad():
        for start in (0, 2, 4):
            batch = {key: torch.stack([data[i][key] for i in (start, start + 1)]) for key in ("input_ids", "labels")}
            logits = module(batch["input_ids"])
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item())
    expected = sum(loss * weight for loss, weight in zip(losses, weights)) / sum(weights)
    assert result["own_val_loss"] == pytest.approx(expected, rel=1e-5)
