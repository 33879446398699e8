"""After a DP fit, `CausalLMModule` tests (``test_loss``, ``test_perplexity``, as validation computes them) and
predicts (the logits of each batch's ``input_ids``) on one process."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn

from lightning_longshield import LongShieldStrategy
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
