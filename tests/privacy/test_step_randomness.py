"""The model's randomness in DP steps (dropout) is keyed per step from a secret, not the public seed's stream."""

from __future__ import annotations

import random

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, default_collate

from lightning_longshield import LongShieldStrategy
from lightning_longshield.batching import samples_of
from lightning_longshield.privacy.model_randomness import StepRandomness
from lightning_longshield.privacy.plan import PrivacyArguments
from lightning_longshield.privacy.randomness import SecretKey
from lightning_longshield.privacy.session import PrivacySession
from tests.support.helpers import RandomTokens, make_lora_module, make_trainer, small_config


def draws_in_step(randomness: StepRandomness, index: int) -> torch.Tensor:
    with randomness.step(index):
        return torch.rand(8)


def test_pythons_and_numpys_generators_are_keyed_too():
    randomness = StepRandomness(SecretKey.fresh(), torch.device("cpu"))
    random.seed(0)
    np.random.seed(0)
    expected = (random.random(), float(np.random.rand()))
    random.seed(0)
    np.random.seed(0)
    with randomness.step(2):
        inside = (random.random(), float(np.random.rand()))
    assert (random.random(), float(np.random.rand())) == expected  # the seed's streams, not advanced by the step
    assert inside[0] != expected[0] and inside[1] != expected[1]
    with randomness.step(2):
        assert (random.random(), float(np.random.rand())) == inside


def test_a_step_draws_from_its_key_and_leaves_the_outer_stream_as_it_was():
    key = SecretKey.fresh()
    torch.manual_seed(0)
    expected_after = torch.rand(8)
    torch.manual_seed(0)
    inside = draws_in_step(StepRandomness(key, torch.device("cpu")), 3)
    assert torch.equal(torch.rand(8), expected_after)  # the public seed's stream is not advanced by the step
    assert not torch.equal(inside, expected_after)
    assert torch.equal(draws_in_step(StepRandomness(key, torch.device("cpu")), 3), inside)
    assert not torch.equal(draws_in_step(StepRandomness(key, torch.device("cpu")), 4), inside)
    assert not torch.equal(draws_in_step(StepRandomness(SecretKey.fresh(), torch.device("cpu")), 3), inside)


def test_without_noise_seed_each_fit_and_process_keys_its_steps_afresh():
    def opened(noise_seed, stream=(0, 0)) -> StepRandomness:
        session = PrivacySession(PrivacyArguments(1.0, None, 1e-5, 1.0, "rdp"), noise_seed=noise_seed)
        session.open_fit(torch.device("cpu"), stream, lambda value: value)
        assert session.step_randomness is not None
        return session.step_randomness

    torch.manual_seed(0)
    first = draws_in_step(opened(None), 0)
    torch.manual_seed(0)
    assert not torch.equal(draws_in_step(opened(None), 0), first)
    assert torch.equal(draws_in_step(opened(5), 0), draws_in_step(opened(5), 0))
    assert not torch.equal(draws_in_step(opened(5, (0, 1)), 0), draws_in_step(opened(5), 0))


class Indexed(RandomTokens):
    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {**super().__getitem__(index), "index": torch.tensor(index)}


class Releases(Callback):
    """Each step's sampled records and its released (noise-free) gradient."""

    def __init__(self) -> None:
        self.records: list[list[int]] = []
        self.gradients: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.records.append(sorted(batch.pop("index").tolist()))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad.flatten() for p in pl_module.parameters() if p.grad is not None]
        self.gradients.append(torch.cat(grads).clone())


def fit_with_dropout(left_out: int | None) -> Releases:
    """Two noise-free steps without learning, with the same Poisson masks (``noise_seed``); ``left_out`` is dropped
    from the batches it is drawn into (the neighbouring dataset, sampled alike)."""

    def collate(records):
        kept = [record for record in records if int(record["index"]) != left_out]
        return default_collate(kept) if kept else samples_of(default_collate(records), 0, 0)

    releases = Releases()
    strategy = LongShieldStrategy(noise_multiplier=0.0, target_delta=1e-3, accountant="rdp", noise_seed=7, seed=0)
    module = make_lora_module(small_config(n_layers=1), module_kwargs=dict(learning_rate=0.0), dropout=0.5)
    make_trainer(strategy, max_steps=2, callbacks=[releases]).fit(
        module, DataLoader(Indexed(size=32, seq_len=8), batch_size=4, collate_fn=collate))
    return releases


def test_a_record_of_one_step_does_not_change_the_dropout_of_the_next():
    """Dropout draws as many masks as a step's batch has samples: on the public seed's stream, a record drawn at
    step 0 shifted step 1's masks of every other record, moving step 1's release by more than the clipping bound."""
    with_all = fit_with_dropout(None)
    first, second = with_all.records
    left_out = next(index for index in first if index not in second)
    without = fit_with_dropout(left_out)
    assert without.records[1] == second
    assert not torch.equal(with_all.gradients[0], without.gradients[0])  # the record counts in its own step
    assert torch.equal(with_all.gradients[1], without.gradients[1])
