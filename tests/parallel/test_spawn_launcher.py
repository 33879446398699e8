"""Lightning's spawn launcher: a CP 2 run started from this process returns the full trained weights here, and rank
0's privacy state (plan, accountant history), so that epsilon and the guarantee read here as on rank 0."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_longshield import LongShieldStrategy
from tests.support.helpers import (
    RandomTokens,
    loader,
    make_module,
    make_trainer,
    reference_dp_sgd,
    samples,
    small_config,
)


class RecordRankZeroPrivacy(L.Callback):
    """Writes rank 0's privacy plan, history and guarantee at the end of training to ``path`` (a worker's view, for
    the main process to compare with)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            privacy = trainer.strategy.privacy
            self.path.write_text(json.dumps({"plan": privacy.plan.state_dict(), "history": privacy.accountant.history,
                                             "guarantee": privacy.describe_guarantee()}))


@pytest.mark.slow
def test_spawned_context_parallel_run_returns_full_weights_and_the_privacy_state(tmp_path):
    dataset = RandomTokens(size=8, seq_len=16)
    module = make_module(small_config())
    initial = copy.deepcopy(module.model)
    strategy = LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=0.05, micro_batch_size=2,
                                  poisson_sampling=False, seed=0, start_method="spawn")
    record = tmp_path / "rank0.json"
    trainer = make_trainer(strategy, max_steps=1, devices=2, callbacks=[RecordRankZeroPrivacy(record)])
    trainer.fit(module, loader(dataset, 4))
    expected = reference_dp_sgd(initial, [samples(dataset, range(4))], 0.05, 4)
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(module.model.state_dict()[name], value, rtol=1e-4, atol=1e-6)

    # Before, the main process's strategy had no plan (get_epsilon raised "No delta yet") and no step.
    rank_zero = json.loads(record.read_text())
    assert strategy.privacy_plan.state_dict() == rank_zero["plan"]
    assert strategy.accountant.history == [tuple(run) for run in rank_zero["history"]] == [(0.0, 4 / 8, 1)]
    assert strategy.get_epsilon() == float("inf")
    assert strategy.privacy.describe_guarantee() == rank_zero["guarantee"]
    assert "after 1 step" in rank_zero["guarantee"]
    # Lightning refuses a second fit of a spawn Trainer; the strategy's teardown kept that error, not its own
    with pytest.raises(NotImplementedError, match="creating a new Trainer instance"):
        trainer.fit(module, loader(dataset, 4))
