"""An empirical membership test: can an adversary who knows the initial model, the other records and the canary
tell from the released gradient whether the canary was in the training set?

The canary's input tokens appear in no other record, so only the canary (and the noise) moves those embedding
rows; the adversary scores each release by its projection onto the canary's gradient there. With the learning rate
0 every DP step is an independent one-step run of the mechanism on the same data (q = 1: every record is in every
logical batch), so one fit per world gives many trials. Default settings throughout: the noise comes from OS
entropy and the public ``seed`` fixes the model, as an adversary would know it.
"""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import Dataset

from lightning_longshield import CausalLMModule, LongShieldStrategy
from lightning_longshield.privacy.epsilon import calibrate_noise_multiplier
from tests.support.helpers import make_trainer, small_config

TRIALS, CLIP, DELTA, SEQ = 48, 0.1, 1e-5, 8
CANARY_TOKENS = torch.tensor([60, 61, 62, 63, 60, 61, 62, 63])


class Records(Dataset):
    def __init__(self, with_canary: bool) -> None:
        generator = torch.Generator().manual_seed(0)
        rows = [torch.randint(0, 60, (SEQ + 1,), generator=generator) for _ in range(4)]
        if with_canary:
            rows.append(torch.cat([CANARY_TOKENS, torch.tensor([0])]))
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index][:-1], "labels": self.rows[index][1:]}


class RecordCanaryRows(Callback):
    def __init__(self) -> None:
        self.releases: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.releases.append(pl_module.model.tok_embeddings.weight.grad[60:64].detach().flatten().clone())


def releases(noise_multiplier: float, with_canary: bool) -> tuple[torch.Tensor, CausalLMModule]:
    data = Records(with_canary)
    module = CausalLMModule(small_config(n_layers=1), optimizer="sgd", learning_rate=0.0)
    strategy = LongShieldStrategy(noise_multiplier=noise_multiplier, max_grad_norm=CLIP, micro_batch_size=len(data),
                                  target_delta=DELTA, seed=0)
    recorder = RecordCanaryRows()
    make_trainer(strategy, max_steps=TRIALS, callbacks=[recorder]).fit(
        module, torch.utils.data.DataLoader(data, batch_size=len(data))
    )
    return torch.stack(recorder.releases), module


def canary_direction(module: CausalLMModule) -> torch.Tensor:
    """What the adversary computes from the public initial model: the canary's gradient on its private rows."""
    sample = Records(with_canary=True)[4]
    module.zero_grad()
    loss = torch.nn.functional.cross_entropy(module(sample["input_ids"][None])[0], sample["labels"])
    loss.backward()
    direction = module.model.tok_embeddings.weight.grad[60:64].flatten().clone()
    module.zero_grad()
    return direction / direction.norm()


def auc(positives: torch.Tensor, negatives: torch.Tensor) -> float:
    """Probability that a release with the canary scores above one without (Mann-Whitney)."""
    return (positives[:, None] > negatives[None, :]).double().mean().item()


def attack_auc(noise_multiplier: float) -> float:
    inside, module = releases(noise_multiplier, with_canary=True)
    outside, _ = releases(noise_multiplier, with_canary=False)
    direction = canary_direction(module)  # learning rate 0: the model is still the public initial one
    return auc(inside @ direction, outside @ direction)


@pytest.mark.slow
def test_canary_membership_is_plain_at_huge_epsilon_and_near_chance_at_epsilon_one():
    huge = attack_auc(1e-4)
    sigma_one = calibrate_noise_multiplier(1.0, DELTA, 1.0, 1, "prv")  # one step of the mechanism spends epsilon 1
    near_chance = attack_auc(sigma_one)
    assert huge == 1.0
    # (epsilon, delta)-DP bounds any test's AUC by about e^eps / (1 + e^eps) = 0.73 at epsilon 1; this attack's
    # expected AUC is lower still. With 48 x 48 trials the AUC's standard error is about 0.06.
    assert near_chance < math.e / (1 + math.e) + 0.1, near_chance
    assert abs(near_chance - 0.5) < 0.25
