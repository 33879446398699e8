"""Worker processes for the multi-process DP training tests: fit, then save the gathered full parameters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from helpers import RandomTokens, loader, make_module, make_trainer, small_config
from lightning_longshield import LongShieldStrategy

DATASET = dict(size=24, seq_len=16)
LOGICAL_BATCH = 4
STEPS = 3


class FullStateAfterEachStep(Callback):
    """The gathered full model state after every step (collective: every rank calls it)."""

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        state = trainer.strategy.lightning_module_state_dict()
        self.states.append({k.removeprefix("model."): v.clone() for k, v in state.items()})


def fit(world_size: int, strategy_kwargs: dict[str, Any], tie_embeddings: bool, max_grad_norm: float):
    strategy = LongShieldStrategy(
        noise_multiplier=0.0, max_grad_norm=max_grad_norm, poisson_sampling=False, seed=0, **strategy_kwargs
    )
    recorder = FullStateAfterEachStep()
    module = make_module(small_config(tie_embeddings=tie_embeddings))
    data_parallel = world_size // strategy_kwargs["context_parallel_size"]
    trainer = make_trainer(strategy, max_steps=STEPS, devices=world_size, callbacks=[recorder])
    trainer.fit(module, loader(RandomTokens(**DATASET), LOGICAL_BATCH // data_parallel))
    return strategy, recorder.states


def train_configurations(rank: int, world_size: int, configurations: list[dict[str, Any]], out_dir: str) -> None:
    """Fit every configuration in turn; rank 0 saves the full states after each step to ``out_dir/<i>.pt``."""
    for index, config in enumerate(configurations):
        strategy, states = fit(world_size, **config)
        held = torch.tensor([float(strategy._engine.last_held_bytes)])
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        if rank == 0:
            torch.save({"states": states, "held_bytes": held.item(), "config": config}, Path(out_dir) / f"{index}.pt")
