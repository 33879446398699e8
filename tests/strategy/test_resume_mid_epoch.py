"""Resuming from a checkpoint taken within an epoch: exact with Poisson sampling (each step's sample is drawn on its
own, keyed by its DP step), so Lightning's "dataloader is not resumable" warning is not raised there, and one log
line says why; with the DataLoader's own batches (``poisson_sampling=False``) the warning stays, as it is true."""

from __future__ import annotations

import logging
import warnings

from lightning_longshield import LongShieldStrategy
from lightning_longshield.dp_dataloaders import PoissonDataLoader
from lightning_longshield.privacy.rank_zero import LOGGER_NAME
from tests.support.helpers import RandomTokens, loader, make_module, make_trainer, small_config

DATA = RandomTokens(size=32, seq_len=8)  # batch 4: 8 Poisson steps an epoch, so step 2 is within the first epoch
NOT_RESUMABLE = "your dataloader is not resumable"


def _strategy(poisson_sampling: bool) -> LongShieldStrategy:
    return LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3,
                              poisson_sampling=poisson_sampling)


def _module():
    return make_module(small_config(n_layers=1), optimizer="adamw", learning_rate=1e-2)


def _resume_within_an_epoch(tmp_path, poisson_sampling: bool) -> tuple[list[str], LongShieldStrategy]:
    trainer = make_trainer(_strategy(poisson_sampling), max_steps=2)
    trainer.fit(_module(), loader(DATA, 4))
    trainer.save_checkpoint(tmp_path / "mid-epoch.ckpt")
    resumed = _strategy(poisson_sampling)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(resumed, max_steps=3).fit(_module(), loader(DATA, 4), ckpt_path=tmp_path / "mid-epoch.ckpt")
    assert resumed.accountant.steps == 3
    return [str(w.message) for w in caught], resumed


def test_poisson_sampling_resumes_within_an_epoch_without_lightnings_warning(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        messages, resumed = _resume_within_an_epoch(tmp_path, poisson_sampling=True)
    assert not any(NOT_RESUMABLE in message for message in messages)
    assert isinstance(resumed.lightning_module.trainer.train_dataloader, PoissonDataLoader)
    assert any("Resuming Poisson sampling at DP step 2" in message for message in caplog.messages)


def test_the_dataloaders_own_batches_still_get_lightnings_warning(tmp_path):
    messages, _ = _resume_within_an_epoch(tmp_path, poisson_sampling=False)
    assert any(NOT_RESUMABLE in message for message in messages)


def test_the_loader_state_holds_nothing_secret():
    from lightning_longshield.dp_dataloaders import poisson_dataloader
    from lightning_longshield.privacy.randomness import SecretKey

    key = SecretKey.from_seed(3).derive("sampling")
    poisson = poisson_dataloader(loader(DATA, 4), key, first_draw=5, data_parallel_rank=0, data_parallel_size=1)
    assert poisson.state_dict() == {}
    next(iter(poisson))
    assert poisson.state_dict() == {}
