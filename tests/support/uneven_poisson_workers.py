"""Worker processes for Poisson-sampled runs whose data-parallel groups draw different numbers of samples (one of
them none in some steps), with FSDP2 over every rank (``shard_over="all"``, ZeRO-DP+) and over the context-parallel
group (the default)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_longshield import LongShieldStrategy
from tests.support.helpers import RandomTokens, full_state, loader, make_module, make_trainer, small_config

DATASET = dict(size=8, seq_len=16)
GROUP_BATCH = 1  # DataLoader batch_size: expected logical batch 2 over 2 groups, Poisson rate 2 / 8
STEPS = 4
NOISE_SEED = 1  # its draws give the groups (1, 1), (1, 0), (2, 1), (1, 0) samples: checked in `fit_uneven_groups`
CLIP = 0.05
#: A gloo collective that some rank never joins fails after this long (the runs take a few seconds each).
COLLECTIVE_TIMEOUT = timedelta(seconds=45)

RUNS = {  # name -> strategy arguments (data 2 x context 1, two processes)
    "default_mixed_mbs1": dict(norms="mixed", micro_batch_size=1),  # FSDP2 over each (one-rank) CP group
    "all_mixed_mbs1": dict(shard_over="all", norms="mixed", micro_batch_size=1),  # ZeRO-DP+
    "all_per_layer_mbs2": dict(shard_over="all", clipping="per_layer", micro_batch_size=2),
}


class RecordBatchesAndStates(Callback):
    """This rank's batch before each step and the gathered full state after it (a collective on every rank)."""

    def __init__(self) -> None:
        self.batches: list[dict[str, torch.Tensor]] = []
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append({key: batch[key].detach().clone() for key in ("input_ids", "labels")})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        state = full_state(trainer.strategy.lightning_module_state_dict())
        self.states.append({k.removeprefix("model."): v.clone() for k, v in state.items()})


def fit_uneven_groups(rank: int, world_size: int, out_dir: str, runs: Optional[dict[str, dict]] = None) -> None:
    """Every run of ``runs`` (default `RUNS`; data 2 x context 1 unless a run names ``context_parallel_size``) for
    `STEPS` Poisson steps without noise (SGD, lr 1); rank 0 saves the states after each step, each data-parallel
    group's batches and the steps released. Fails if the draws are not uneven with an empty group."""
    results: dict[str, Any] = {}
    for name, kwargs in (runs or RUNS).items():
        kwargs = {"context_parallel_size": 1, **kwargs}
        strategy = LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=CLIP, noise_seed=NOISE_SEED, seed=0,
                                      **kwargs)
        recorder = RecordBatchesAndStates()
        trainer = make_trainer(strategy, max_steps=STEPS, devices=world_size, callbacks=[recorder])
        trainer.fit(make_module(small_config()), loader(RandomTokens(**DATASET), GROUP_BATCH))
        batches: list[Any] = [None] * world_size
        dist.all_gather_object(batches, recorder.batches)
        batches = batches[:: kwargs["context_parallel_size"]]  # one rank of each data-parallel group
        sizes = [tuple(len(group[step]["input_ids"]) for group in batches) for step in range(STEPS)]
        assert any(len(set(step)) > 1 for step in sizes), f"{name}: the groups drew equal counts {sizes}"
        assert any(min(step) == 0 < max(step) for step in sizes), f"{name}: no group drew zero alone: {sizes}"
        results[name] = dict(states=recorder.states, batches=batches, sizes=sizes, steps=strategy.accountant.steps,
                             global_step=trainer.global_step)
    if rank == 0:
        torch.save(results, Path(out_dir) / "uneven_poisson.pt")
