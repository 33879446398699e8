"""Worker processes for the multi-process DP training tests: fit, then save the gathered full parameters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_longshield import LongShieldStrategy, PerLayerClipping, ProjectedNorms
from tests.support.helpers import (
    CountLiveTensors,
    RandomTokens,
    full_state,
    loader,
    make_lora_module,
    make_module,
    make_trainer,
    small_config,
)

DATASET = dict(size=24, seq_len=16)
LOGICAL_BATCH = 4
STEPS = 3


class FullStateAfterEachStep(Callback):
    """The gathered full model state after every step (collective: every rank calls it)."""

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        state = full_state(trainer.strategy.lightning_module_state_dict())
        self.states.append({k.removeprefix("model."): v.clone() for k, v in state.items()})


def fit(world_size: int, strategy_kwargs: dict[str, Any], tie_embeddings: bool, max_grad_norm: float,
        logical_batch: int = LOGICAL_BATCH, lora: bool = False, module_kwargs: dict[str, Any] | None = None,
        model_config: dict[str, Any] | None = None):
    strategy = LongShieldStrategy(
        noise_multiplier=0.0, max_grad_norm=max_grad_norm, poisson_sampling=False, seed=0, **strategy_kwargs
    )
    recorder = FullStateAfterEachStep()
    config = small_config(tie_embeddings=tie_embeddings, **(model_config or {}))
    module = make_lora_module(config) if lora else make_module(config, **(module_kwargs or {}))
    data_parallel = world_size // strategy_kwargs["context_parallel_size"]
    trainer = make_trainer(strategy, max_steps=STEPS, devices=world_size, callbacks=[recorder])
    trainer.fit(module, loader(RandomTokens(**DATASET), logical_batch // data_parallel))
    return strategy, recorder.states


def train_configurations(
    rank: int, world_size: int, configurations: dict[str, dict[str, Any]], out_dir: str
) -> None:
    """Fit every configuration in turn; rank 0 saves the full states after each step to ``out_dir/<name>.pt``."""
    for name, config in configurations.items():
        strategy, states = fit(world_size, **config)
        held = torch.tensor([float(strategy.dp_engine.last_held_bytes)])
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        if rank == 0:
            torch.save({"states": states, "held_bytes": held.item(), "config": config}, Path(out_dir) / f"{name}.pt")


UNEVEN_BATCH = 3  # micro-batches of 2 and 1: the capture path and the summed-gradient path in one logical batch

UNEVEN_RUNS = {  # name -> (strategy arguments, tied embeddings)
    "v1": (dict(exchange="all_reduce"), False),
    "v2_bucket_0": (dict(communication_bucket_mb=0), False),  # one reduce-scatter per parameter
    "v2_bucket_all": (dict(communication_bucket_mb=1024), False),  # all of them in one bucket
    # per-layer clipping, each layer clipped as its per-sample gradient completes (per parameter, or per bucket)
    "v1_per_layer_checkpointed": (dict(exchange="all_reduce", clipping="per_layer",
                                       activation_checkpointing=True), False),
    "v2_per_layer_bucket_0_tied": (dict(communication_bucket_mb=0, clipping="per_layer"), True),
    "v2_per_layer_checkpointed": (dict(clipping="per_layer", activation_checkpointing=True), False),
    "v2_output_stationary_per_layer_proportional": (dict(exchange="output_stationary",
                                                         clipping=PerLayerClipping(thresholds="proportional")),
                                                    False),
}


RANDOMIZED_RUNS = {  # randomized clipping (fixed noise_seed: the same projections at every CP size)
    "v2_hutchinson_tied": (dict(norms=ProjectedNorms("hutchinson", projection_dim=8), noise_seed=3), True),
    "v1_hutchpp_checkpointed": (dict(norms=ProjectedNorms("hutchpp", projection_dim=9), noise_seed=4,
                                     exchange="all_reduce", activation_checkpointing=True), False),
}
#: Output-stationary V2 with an FFN whose width does not split over CP 2: w2 is sharded along its output features.
UNEVEN_FFN = dict(exchange="output_stationary"), dict(ffn_dim=51)


def uneven_micro_batches(rank: int, world_size: int, out_dir: str) -> None:
    """CP 2, logical batches of 3 at micro-batch size 2: every `UNEVEN_RUNS` and `RANDOMIZED_RUNS` run."""
    for file, runs in (("uneven.pt", UNEVEN_RUNS), ("randomized.pt", RANDOMIZED_RUNS)):
        results = {}
        for name, (kwargs, tied) in runs.items():
            strategy_kwargs = dict(context_parallel_size=world_size, micro_batch_size=2, **kwargs)
            _, results[name] = fit(world_size, strategy_kwargs, tie_embeddings=tied, max_grad_norm=0.05,
                                   logical_batch=UNEVEN_BATCH)
        if rank == 0:
            torch.save(results, Path(out_dir) / file)
    kwargs, model_config = UNEVEN_FFN
    _, states = fit(world_size, dict(context_parallel_size=world_size, micro_batch_size=2, **kwargs),
                    tie_embeddings=False, max_grad_norm=0.05, logical_batch=UNEVEN_BATCH, model_config=model_config)
    if rank == 0:
        torch.save(states, Path(out_dir) / "uneven_ffn.pt")


LORA_RUNS = {  # LoRA adapters (FSDP2 with frozen base weights) through each exchange
    "v1_mbs2": dict(exchange="all_reduce", micro_batch_size=2),
    "v2_checkpointed_mbs2": dict(micro_batch_size=2, activation_checkpointing=True),
    "v2_output_stationary_mbs1": dict(exchange="output_stationary", micro_batch_size=1),
}


def lora_under_cp(rank: int, world_size: int, out_dir: str) -> None:
    """CP ``world_size`` LoRA fine-tuning through V1, V2 with checkpointing, and V2 output-stationary."""
    results = {}
    for name, kwargs in LORA_RUNS.items():
        _, results[name] = fit(world_size, dict(context_parallel_size=world_size, **kwargs), tie_embeddings=False,
                               max_grad_norm=0.05, lora=True)
    if rank == 0:
        torch.save(results, Path(out_dir) / "lora.pt")


def noise_and_epsilon(rank: int, world_size: int, out_dir: str) -> None:
    """Data 2 x CP 2: one pure-noise step (sigma C >> clipped sum) and a short Poisson-sampled run for epsilon."""
    results: dict[str, Any] = {}
    strategy = LongShieldStrategy(context_parallel_size=2, noise_multiplier=1000.0, max_grad_norm=1e-3,
                                  micro_batch_size=2, poisson_sampling=False, seed=11)
    module = make_module(small_config())
    trainer = make_trainer(strategy, max_steps=1, devices=world_size)
    initial = {name: value.detach().float().clone() for name, value in module.model.state_dict().items()}
    trainer.fit(module, loader(RandomTokens(**DATASET), LOGICAL_BATCH // 2))
    final = {k.removeprefix("model."): v for k, v in full_state(strategy.lightning_module_state_dict()).items()}
    # Every rank's own shard of every parameter: data-parallel replicas of a shard must hold identical values.
    local = torch.cat([p.to_local().detach().flatten().float() for p in module.model.parameters()])
    shards = [None] * world_size
    dist.all_gather_object(shards, local)
    if rank == 0:
        results["updates"] = {name: final[name].float() - value for name, value in initial.items()}
        # Rank g * 2 + r holds CP shard r of data-parallel group g.
        results["shards"] = {f"dp{index // 2}_cp{index % 2}": shard for index, shard in enumerate(shards)}
    sigma = 1.1
    strategy = LongShieldStrategy(context_parallel_size=2, noise_multiplier=sigma, accountant="rdp",
                                  target_delta=1e-3, seed=12)
    trainer = make_trainer(strategy, max_steps=3, devices=world_size)
    trainer.fit(make_module(small_config()), loader(RandomTokens(**DATASET), LOGICAL_BATCH // 2))
    results.update(epsilon=strategy.get_epsilon(), history=strategy.accountant.history)
    if rank == 0:
        torch.save(results, Path(out_dir) / "noise.pt")


def save_checkpoint_under_cp(rank: int, world_size: int, path: str, activation_checkpointing: bool = False,
                             checkpoint_format: str = "auto", optimizer: str = "adamw", momentum: float = 0.0,
                             async_checkpoints: bool = False) -> None:
    """CP 2: two Poisson-sampled steps without noise, then a checkpoint (``"auto"``: sharded, as for any run of
    several processes)."""
    strategy = LongShieldStrategy(context_parallel_size=world_size, noise_multiplier=0.0, max_grad_norm=0.05,
                                  micro_batch_size=2, noise_seed=0, activation_checkpointing=activation_checkpointing,
                                  checkpoint_format=checkpoint_format, async_checkpoints=async_checkpoints)
    module = make_module(small_config(), optimizer=optimizer, learning_rate=1e-2, momentum=momentum)
    trainer = make_trainer(strategy, max_steps=2, devices=world_size)
    trainer.fit(module, loader(RandomTokens(**DATASET), LOGICAL_BATCH))
    trainer.save_checkpoint(path)


def restored_state(module: Any, trainer: Any) -> dict[str, Any]:
    """The module's parameters and its optimizer's state keyed by parameter name, whole, on CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    optimizer = trainer.optimizers[0]
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
            "optimizer": get_optimizer_state_dict(module, optimizer, options=options)}


def load_checkpoint_data_parallel(rank: int, world_size: int, path: str, out_dir: str, optimizer: str,
                                  momentum: float) -> None:
    """DP ``world_size`` at CP 1: restore ``path`` (no step left to run) and save rank 0's restored state."""
    strategy = LongShieldStrategy(context_parallel_size=1, noise_multiplier=0.0, max_grad_norm=0.05,
                                  micro_batch_size=2, noise_seed=0)
    module = make_module(small_config(), optimizer=optimizer, learning_rate=1e-2, momentum=momentum)
    trainer = make_trainer(strategy, max_steps=2, devices=world_size)
    trainer.fit(module, loader(RandomTokens(**DATASET), LOGICAL_BATCH), ckpt_path=path)
    assert trainer.global_step == 2
    if rank == 0:
        torch.save(restored_state(module, trainer), Path(out_dir) / "restored.pt")


def context_parallel_errors(rank: int, world_size: int, out_dir: str) -> None:
    """Record the errors for an unshardable sequence length and for a model without replaceable attention, the
    evaluations after a fit (of a module that owns a frozen parameter itself), and a second fit of the same module."""
    messages = {}
    try:
        trainer = make_trainer(LongShieldStrategy(noise_multiplier=1.0, poisson_sampling=False), max_steps=1,
                               devices=world_size)
        trainer.fit(make_module(small_config()), loader(RandomTokens(size=8, seq_len=6), 2))
    except ValueError as error:
        messages["seq_len"] = str(error)
    configured = RandomTokens(size=8, seq_len=8)
    configured.seq_len = 6  # the dataset's public length, checked before any batch is drawn (its batches would pass)
    strategy = LongShieldStrategy(noise_multiplier=1.0, poisson_sampling=False)
    try:
        make_trainer(strategy, max_steps=1, devices=world_size).fit(make_module(small_config()), loader(configured, 2))
    except ValueError as error:
        messages["configured_seq_len"] = (str(error), strategy.accountant.steps)
    module = make_module(small_config())
    for block in module.model.layers:
        del block.attention.attention_fn  # as if the attention were hard-wired and ignored global positions
    try:
        trainer = make_trainer(LongShieldStrategy(noise_multiplier=1.0, poisson_sampling=False), max_steps=1,
                               devices=world_size)
        trainer.fit(module, loader(RandomTokens(size=8, seq_len=8), 2))
    except TypeError as error:
        messages["attention"] = str(error)
    data = loader(RandomTokens(size=8, seq_len=8), 2)
    trainer = make_trainer(LongShieldStrategy(noise_multiplier=1.0, poisson_sampling=False), max_steps=1,
                           devices=world_size)
    try:  # a standalone evaluation: the model is not laid out for context parallelism
        trainer.validate(make_module(small_config()), data, verbose=False)
    except RuntimeError as error:
        messages["validate"] = str(error)
    module = make_module(small_config())
    module.register_parameter("frozen", torch.nn.Parameter(torch.ones(3), requires_grad=False))  # the root's own
    trainer = make_trainer(LongShieldStrategy(noise_multiplier=1.0, poisson_sampling=False), max_steps=1,
                           devices=world_size)
    trainer.fit(module, data)
    messages["validate_after_fit"] = trainer.validate(module, data, verbose=False)[0]["val_loss"]
    module.test_step = module.validation_step  # the usual test step: the validation step on other data
    messages["test_after_fit"] = trainer.test(module, data, verbose=False)[0]["val_loss"]
    try:
        trainer.predict(module, data)
    except RuntimeError as error:
        messages["predict"] = str(error)
    trainer.fit_loop.epoch_loop.max_steps = 2  # training goes on: the module is laid out and sharded already
    trainer.fit(module, data)
    messages["steps_after_second_fit"] = trainer.strategy.accountant.steps
    if rank == 0:
        torch.save(messages, Path(out_dir) / "errors.pt")


def leak_check(rank: int, world_size: int, out_dir: str) -> None:
    """CP 2 with activation checkpointing (V2): live tensors ``after_step_5`` and ``after_step_50``.

    Fixed logical batches: under Poisson sampling two steps hold batches of different sizes, and a step whose batch
    has fewer micro-batches keeps 18 fewer tensors, which is no leak.
    """
    counter = CountLiveTensors((5, 50))
    strategy = LongShieldStrategy(noise_multiplier=1.0, micro_batch_size=2, activation_checkpointing=True, seed=0,
                                  poisson_sampling=False)
    trainer = make_trainer(strategy, max_steps=50, devices=world_size, callbacks=[counter])
    trainer.fit(make_module(small_config(n_layers=2), optimizer="adamw", learning_rate=1e-3),
                loader(RandomTokens(size=64), 4))
    counts = {f"after_step_{step}": count for step, count in counter.counts.items()}
    torch.save(counts, Path(out_dir) / f"leak{rank}.pt")


def fit_bf16(rank: int, world_size: int, out_dir: str) -> None:
    """CP 2, bf16-mixed (bf16 FSDP gathers), V2 micro-batch 2, without (``"v2"``) and with (``"v3"``) activation
    checkpointing."""
    results = {}
    for name, activation_checkpointing in (("v2", False), ("v3", True)):
        strategy = LongShieldStrategy(context_parallel_size=world_size, noise_multiplier=0.0, max_grad_norm=0.05,
                                      micro_batch_size=2, poisson_sampling=False, seed=0,
                                      activation_checkpointing=activation_checkpointing)
        recorder = FullStateAfterEachStep()
        trainer = make_trainer(strategy, max_steps=1, devices=world_size, precision="bf16-mixed",
                               callbacks=[recorder])
        trainer.fit(make_module(small_config()), loader(RandomTokens(**DATASET), LOGICAL_BATCH))
        results[name] = recorder.states[0]
    if rank == 0:
        torch.save(results, Path(out_dir) / "bf16.pt")


class InitialShards(Callback):
    """This rank's local shards and the gathered full state when training starts (before any update)."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.local = {name: p.to_local().detach().clone() for name, p in pl_module.model.named_parameters()}
        self.buffers = {name: b.detach().clone() for name, b in pl_module.model.named_buffers()}
        state = full_state(trainer.strategy.lightning_module_state_dict())
        self.full = {k.removeprefix("model."): v.clone() for k, v in state.items()}


class RandomProjection(nn.Module):
    """A fixed random buffer drawn in ``init_weights``, which FSDP2 leaves whole on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("projection", torch.empty(4, 4))

    def init_weights(self) -> None:
        nn.init.normal_(self.projection)


def meta_initialisation(rank: int, world_size: int, out_dir: str) -> None:
    """CP 2, a model built in configure_model (not before fit): twice with seed=0, once with seed=1."""
    from lightning_longshield import CausalLMModule

    class WithRandomProjection(CausalLMModule):
        def configure_model(self) -> None:
            super().configure_model()
            if not hasattr(self.model, "random_projection"):
                self.model.random_projection = RandomProjection()

    results = {}
    for run, seed in (("first", 0), ("again", 0), ("other", 1)):
        torch.manual_seed(1000 + rank + len(results))  # the strategy's seed alone must decide the init
        module = WithRandomProjection(small_config(), optimizer="sgd", learning_rate=0.0)
        recorder = InitialShards()
        strategy = LongShieldStrategy(context_parallel_size=world_size, noise_multiplier=0.0, micro_batch_size=2,
                                      poisson_sampling=False, seed=seed)
        make_trainer(strategy, max_steps=1, devices=world_size, callbacks=[recorder]).fit(
            module, loader(RandomTokens(**DATASET), LOGICAL_BATCH)
        )
        results[run] = {"local": recorder.local, "full": recorder.full, "buffers": recorder.buffers}
    torch.save(results, Path(out_dir) / f"meta{rank}.pt")


SHARDED_OVER_ALL = {  # FSDP2 over every rank of a 4-process mesh; name -> (fit kwargs, logical batch)
    "all_dp2xcp2_v2_mbs1_untied": dict(strategy_kwargs=dict(context_parallel_size=2, micro_batch_size=1,
                                                            shard_over="all"), tie_embeddings=False),
    "all_dp2xcp2_v2_mixed_mbs2_tied": dict(strategy_kwargs=dict(context_parallel_size=2, micro_batch_size=2,
                                                                shard_over="all", norms="mixed"),
                                           tie_embeddings=True),
    "all_dp2xcp2_v1_checkpointed_mbs2_untied": dict(
        strategy_kwargs=dict(context_parallel_size=2, micro_batch_size=2, shard_over="all",
                             exchange="all_reduce", activation_checkpointing=True), tie_embeddings=False),
    # the paper's ZeRO-DP+: data parallelism only, FSDP2 over all ranks, mixed ghost norms with book-keeping
    "zero_dp_plus_dp4_mbs2_untied": dict(strategy_kwargs=dict(context_parallel_size=1, micro_batch_size=2,
                                                              shard_over="all", norms="mixed"),
                                         tie_embeddings=False, logical_batch=2 * LOGICAL_BATCH),
}


def sharded_over_all(rank: int, world_size: int, out_dir: str, max_grad_norm: float) -> None:
    """Every `SHARDED_OVER_ALL` run (states after each step, local shard sizes), then one pure-noise step of data 2
    x CP 2 sharded over all ranks (sigma C >> the clipped sum): its update is the noise."""
    results: dict[str, Any] = {}
    for name, config in SHARDED_OVER_ALL.items():
        strategy, states = fit(world_size, max_grad_norm=max_grad_norm, **config)
        local = sum(p.to_local().numel() for p in strategy.lightning_module.model.parameters())
        results[name] = {"states": states, "local_numel": local, "config": config}
    strategy = LongShieldStrategy(context_parallel_size=2, noise_multiplier=1000.0, max_grad_norm=1e-3,
                                  micro_batch_size=2, poisson_sampling=False, seed=11, shard_over="all")
    module = make_module(small_config())
    initial = {name: value.detach().float().clone() for name, value in module.model.state_dict().items()}
    make_trainer(strategy, max_steps=1, devices=world_size).fit(module, loader(RandomTokens(**DATASET),
                                                                               LOGICAL_BATCH // 2))
    final = {k.removeprefix("model."): v for k, v in full_state(strategy.lightning_module_state_dict()).items()}
    if rank == 0:  # the full state is gathered on rank 0
        results["noise_updates"] = {name: final[name].float() - value for name, value in initial.items()}
        torch.save(results, Path(out_dir) / "sharded_over_all.pt")
