"""`LongShieldStrategy`: DP-SGD (flat clipping, noise, Poisson sampling, accounting) as a Lightning strategy."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed, seed_everything
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_longshield import preflight as _preflight
from lightning_longshield.batching import batch_size_of, split_into_microbatches
from lightning_longshield.callbacks import PrivacyMonitor
from lightning_longshield.checkpointing import CheckpointPolicy, apply_activation_checkpointing, select_blocks
from lightning_longshield.context_parallel import (
    apply_context_parallel_attention,
    build_device_mesh,
    resolve_parallel_sizes,
    shard_batch,
)
from lightning_longshield.data_loading import data_parallel_dataloader, poisson_dataloader
from lightning_longshield.launcher import GatheringMultiProcessingLauncher
from lightning_longshield.parallelize import gather_policy, materialize_meta_parameters, shard_with_fsdp
from lightning_longshield.privacy import DPSGDEngine, GaussianNoise, PrivacyAccountant
from lightning_longshield.privacy.grad_sample.exchange import (
    AllReduceExchange,
    LocalExchange,
    OutputStationaryExchange,
    ReduceScatterExchange,
)
from lightning_longshield.privacy.plan import PrivacyArguments, PrivacyPlan, resolve_plan
from lightning_longshield.privacy.randomness import (
    CryptographicUniforms,
    SeededUniforms,
    UniformSource,
    derive_seed,
    fresh_seed,
)
from lightning_longshield.privacy.shards import ParamShard

GRAD_SAMPLE_PATTERNS = ("input_stationary", "output_stationary")
CHECKPOINT_KEY = "longshield"


class LongShieldStrategy(ParallelStrategy):
    """Differentially private training (DP-SGD) of a LightningModule on a (data_parallel, context_parallel) mesh.

    With several processes, each context-parallel group shares every batch: sequences are sharded head-tail over
    the group, parameters (and optimizer state) are FSDP2-sharded over it, attention all-gathers K/V, and per-sample
    gradients are completed by the exchange chosen with ``shard_per_sample_grads`` / ``grad_sample_pattern``.
    Data-parallel groups draw disjoint Poisson samples and sum their clipped gradients before the noise.

    Every optimizer step is one DP step over one logical batch: the batch (Poisson-sampled by default) is split
    into micro-batches of ``micro_batch_size``; each sample's gradient over all trainable parameters is clipped to
    norm ``max_grad_norm``; the clipped sum gets Gaussian noise ``N(0, (noise_multiplier * max_grad_norm)^2)`` once,
    is divided by the expected logical batch size (the DataLoader's ``batch_size`` x data-parallel size), and the
    wrapped optimizer steps. An Opacus accountant records every step; `get_epsilon` reports the privacy spent.

    Args:
        context_parallel_size: processes per context-parallel group (``None``: all of them).
        noise_multiplier: sigma; give this or ``target_epsilon`` (both: sigma is checked against the budget).
            Neither: the noise is calibrated to ``target_epsilon=8``. ``0.0`` disables privacy (for tests).
        target_epsilon: privacy budget; training stops before a step would exceed it.
        target_delta: delta of the guarantee (default ``1 / (10 * dataset size)``).
        max_grad_norm: flat clipping bound ``C`` over all trainable parameters.
        micro_batch_size: samples per forward/backward (the memory knob; does not change the privacy).
        poisson_sampling: ``False`` uses the DataLoader's own batches as logical batches; the accountant still
            assumes Poisson sampling, so the reported epsilon is then not a formal guarantee.
        shard_per_sample_grads: ``True`` reduce-scatters per-sample gradients over the CP group (LongShield-V2),
            ``False`` all-reduces them (V1). With one sample per micro-batch both use FSDP2's reduce-scatter.
        grad_sample_pattern: ``"input_stationary"`` (reduce-scatter the local partials) or ``"output_stationary"``
            (linear layers exchange activations and output gradients instead) for V2.
        overlap_communication: overlap the per-sample reduce-scatter with the backward of the next layer.
        activation_checkpointing: DP-safe block-level activation checkpointing (LongShield-V3): ``True`` for every
            block, an int ``k`` for every k-th block, or a callable ``(index, block) -> bool``.
        accountant: ``"prv"`` (default; Opacus's PRV accountant with a bounded grid, tighter) or ``"rdp"``.
        secure_mode: the setting for a real deployment: Poisson masks from a cryptographically secure stream
            (SHAKE-256 keyed by 256 bits of OS entropy) and every noise tensor from a generator reseeded with fresh
            OS entropy, with Opacus's hardened Gaussian sampler (sum of four draws).
        seed: seeds the global RNGs on every process when training starts (model initialisation, dropout, the
            order of non-private data). Never the noise or the Poisson sampler: those always come from secret
            randomness drawn from OS entropy at the start of each ``fit``, which no checkpoint stores.
        noise_seed: opt-in, for tests and debugging only: derive the noise and the Poisson sampling from this seed,
            so that runs are reproducible. The guarantee then holds only while the seed is secret (a warning says
            so). Not with ``secure_mode``.
        start_method: ``"popen"`` (torchrun-style script relaunch) or a multiprocessing start method.
        preflight: before the first step, ask the `simulate` planner whether the run fits the GPU's memory; on CUDA
            a run that will not fit stops with a `PreflightMemoryError` naming the predicted peak, its breakdown and
            a configuration that fits (on CPU the prediction is only logged). ``False`` skips the check.
    """

    strategy_name = "longshield"

    def __init__(
        self,
        context_parallel_size: Optional[int] = None,
        noise_multiplier: Optional[float] = None,
        target_epsilon: Optional[float] = None,
        target_delta: Optional[float] = None,
        max_grad_norm: float = 1.0,
        micro_batch_size: int = 1,
        poisson_sampling: bool = True,
        shard_per_sample_grads: bool = True,
        grad_sample_pattern: Literal["input_stationary", "output_stationary"] = "input_stationary",
        overlap_communication: bool = True,
        activation_checkpointing: CheckpointPolicy = False,
        accountant: Literal["prv", "rdp"] = "prv",
        secure_mode: bool = False,
        seed: Optional[int] = None,
        noise_seed: Optional[int] = None,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        preflight: bool = True,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._privacy_arguments = PrivacyArguments(
            noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            max_grad_norm=max_grad_norm,
            accountant=accountant,
        )
        self._privacy_arguments.validate()
        if context_parallel_size is not None and context_parallel_size < 1:
            raise ValueError(f"context_parallel_size must be >= 1 or None, got {context_parallel_size}.")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}.")
        if grad_sample_pattern not in GRAD_SAMPLE_PATTERNS:
            raise ValueError(f"grad_sample_pattern={grad_sample_pattern!r}; choose one of {GRAD_SAMPLE_PATTERNS}.")
        select_blocks([], activation_checkpointing)  # validates the policy's type and value
        if secure_mode and noise_seed is not None:
            raise ValueError(
                "secure_mode=True draws the noise and the sampling from OS entropy; remove noise_seed (reproducible"
                " noise is for tests) or set secure_mode=False."
            )
        if noise_seed is not None:
            rank_zero_warn(
                f"noise_seed={noise_seed}: the noise and the Poisson sampling are reproducible from this seed. The"
                " privacy guarantee holds only while the seed stays secret: anyone who knows it can subtract the noise"
                " and see which samples each step used. Use it for tests, never for a release."
            )
        self.context_parallel_size = context_parallel_size
        self.micro_batch_size = micro_batch_size
        self.poisson_sampling = poisson_sampling
        self.shard_per_sample_grads = shard_per_sample_grads
        self.grad_sample_pattern = grad_sample_pattern
        self.overlap_communication = overlap_communication
        self.activation_checkpointing = activation_checkpointing
        self.secure_mode = secure_mode
        self.seed = seed
        self.noise_seed = noise_seed
        self.preflight = preflight
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self._num_nodes = 1
        self._device_mesh: Optional[DeviceMesh] = None
        self.accountant = PrivacyAccountant(accountant)
        self.privacy_plan: Optional[PrivacyPlan] = None
        self._engine: Optional[DPSGDEngine] = None
        self._noise: Optional[GaussianNoise] = None
        self._sampling: Optional[UniformSource] = None
        self._warned_metrics: set[str] = set()
        self._train_dataset_size: Optional[int] = None
        self._dataloader_batch_size: Optional[int] = None
        self._restored_state: Optional[dict[str, Any]] = None
        self._steps_left_in_budget: Optional[int] = None
        self._planned_end: float = 0
        self._microbatch_size = 0

    # ------------------------------------------------------------------ topology and launch

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``("data_parallel", "context_parallel")`` mesh (available once processes are initialised)."""
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists only after the strategy's processes are initialised.")
        return self._device_mesh

    @property
    def data_parallel_size(self) -> int:
        return self.device_mesh["data_parallel"].size()

    @property
    def data_parallel_rank(self) -> int:
        return self.device_mesh["data_parallel"].get_local_rank()

    @property
    def context_parallel_mesh(self) -> DeviceMesh:
        """The 1-D mesh of this process's context-parallel group (its peers share every batch)."""
        return self.device_mesh["context_parallel"]

    @property
    def is_context_parallel(self) -> bool:
        return self.context_parallel_mesh.size() > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = _SubprocessScriptLauncher(
                    self.cluster_environment, self.num_processes, self.num_nodes
                )
        else:
            self._launcher = GatheringMultiProcessingLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        if self.seed is not None:
            seed_everything(self.seed, verbose=False)
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        data_parallel_size, context_parallel_size = resolve_parallel_sizes(self.world_size, self.context_parallel_size)
        self._device_mesh = build_device_mesh(self.root_device.type, data_parallel_size, context_parallel_size)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    # ------------------------------------------------------------------ setup and validation

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        # The strategy splits data over data-parallel groups itself (CP peers share batches; Poisson sampling).
        trainer._accelerator_connector.use_distributed_sampler = False
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_trainer_configuration(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            # Fresh secret randomness for every fit. Draws are keyed by the DP step, so with noise_seed a resumed or
            # second fit continues the streams instead of replaying them. Every process draws the noise of its own
            # shard and data-parallel replica; all processes share the Poisson masks.
            self._sampling = self._sampling_randomness()
            stream = (self.data_parallel_rank, self.context_parallel_mesh.get_local_rank())
            noise_seed = None if self.noise_seed is None else derive_seed(self.noise_seed, "noise")
            self._noise = GaussianNoise(self.root_device, noise_seed, stream, self.secure_mode)
            self._engine = self._build_engine()
            if not any(isinstance(cb, PrivacyMonitor) for cb in trainer.callbacks):
                trainer.callbacks.append(PrivacyMonitor())
            self.setup_optimizers(trainer)
            _optimizers_to_device(self.optimizers, self.root_device)
        self.setup_precision_plugin()

    def _build_engine(self) -> DPSGDEngine:
        """Parallelise the model (`_parallelize`) and wire the matching per-sample exchange."""
        module = self.lightning_module
        assert module is not None and self._noise is not None
        shards = self._parallelize(module)
        exchange: Optional[LocalExchange] = None
        cp_group = None
        if shards is not None:
            cp_group = self.context_parallel_mesh.get_group()
            if not self.shard_per_sample_grads:
                exchange = AllReduceExchange(cp_group)
            elif self.grad_sample_pattern == "output_stationary":
                exchange = OutputStationaryExchange(cp_group, shards, self.overlap_communication)
            else:
                exchange = ReduceScatterExchange(cp_group, shards, self.overlap_communication)
        dp_group = self.device_mesh["data_parallel"].get_group() if self.data_parallel_size > 1 else None
        return DPSGDEngine(
            module, self.max_grad_norm, self._noise, self.accountant, exchange, shards, cp_group, dp_group
        )

    def _parallelize(self, module: pl.LightningModule) -> Optional[dict[str, ParamShard]]:
        """Activation checkpointing, then (under CP) CP attention and FSDP2 over the CP group; returns the shards."""
        if self.activation_checkpointing is not False:
            apply_activation_checkpointing(module, self.activation_checkpointing)
        if not self.is_context_parallel:
            return None
        cp_mesh = self.context_parallel_mesh
        apply_context_parallel_attention(module, cp_mesh.get_group())
        output_stationary = self.grad_sample_pattern == "output_stationary"
        mp_policy = gather_policy(self.precision_plugin.precision)
        shards = shard_with_fsdp(module, cp_mesh, shard_linear_inputs=output_stationary, mp_policy=mp_policy)
        materialize_meta_parameters(module, self.root_device, cp_mesh.get_local_rank())
        return shards

    def _check_trainer_configuration(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise ValueError(
                f"{type(self).__name__} owns backward and the optimizer step; set automatic_optimization=True."
            )
        if trainer.gradient_clip_val is not None:
            raise ValueError(
                "gradient_clip_val is set, but DP-SGD clips each sample's gradient itself: remove gradient_clip_val"
                " from the Trainer and set LongShieldStrategy(max_grad_norm=...) instead."
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                "accumulate_grad_batches must be 1: one optimizer step is one DP step over one logical batch. Set"
                " the logical batch with the DataLoader's batch_size and the memory with micro_batch_size."
            )
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None:
            raise ValueError(
                "16-bit mixed precision with a GradScaler is not supported: loss scaling would scale the per-sample"
                " gradients before clipping. Use precision='bf16-mixed' or 'bf16-true' (or 32)."
            )

    def _sampling_randomness(self) -> UniformSource:
        """The Poisson masks' secret stream, identical on every process: fresh OS entropy broadcast from rank 0."""
        if self.noise_seed is not None:
            return SeededUniforms(derive_seed(self.noise_seed, "sampling"))
        if self.secure_mode:
            return CryptographicUniforms(self.broadcast(secrets.token_bytes(32)))
        return SeededUniforms(self.broadcast(fresh_seed()))

    @override
    def model_to_device(self) -> None:
        """Move the model to the device; a model built on the meta device (under CP) is materialised shard by shard
        after FSDP2 has sharded it, instead."""
        assert self.model is not None
        if any(p.is_meta for p in self.model.parameters()):
            return
        self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Under context parallelism the model that ``configure_model`` builds goes to the meta device, so no rank
        ever holds the whole model: FSDP2 shards it and each rank allocates and initialises only its own shards."""
        if empty_init is None:
            empty_init = self._device_mesh is not None and self.is_context_parallel
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    # ------------------------------------------------------------------ data

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Training: Poisson logical batches keyed to the data-parallel rank. Evaluation: a data-parallel split."""
        if not isinstance(dataloader, DataLoader):
            return dataloader
        trainer = self.lightning_module.trainer
        if not trainer.training:
            return data_parallel_dataloader(dataloader, self.data_parallel_rank, self.data_parallel_size)
        size = len(dataloader.dataset)  # type: ignore[arg-type]
        if size == 0:
            raise ValueError("The training dataset is empty; DP-SGD needs at least one sample.")
        if dataloader.batch_size is None:
            raise ValueError(
                "The training DataLoader must set batch_size: it is the expected logical (privacy) batch per"
                " data-parallel group. A custom batch_sampler is replaced by Poisson sampling."
            )
        self._train_dataset_size, self._dataloader_batch_size = size, dataloader.batch_size
        if self.preflight:
            self._check_memory(dataloader.dataset)
        if not self.poisson_sampling:
            return data_parallel_dataloader(dataloader, self.data_parallel_rank, self.data_parallel_size)
        assert self._sampling is not None
        return poisson_dataloader(
            dataloader, self._sampling, self.accountant.steps, self.data_parallel_rank, self.data_parallel_size
        )

    def _check_memory(self, dataset: object) -> None:
        """Pre-flight: ask the planner whether this run fits the device (raises on CUDA if not, logs on CPU)."""
        _preflight.run_preflight(
            module=self.lightning_module,
            dataset=dataset,
            device=self.root_device,
            world_size=self.world_size,
            cp=self.context_parallel_mesh.size(),
            mbs=self.micro_batch_size,
            precision=str(self.precision_plugin.precision),
            shard_per_sample_grads=self.shard_per_sample_grads,
            activation_checkpointing=self.activation_checkpointing,
        )

    # ------------------------------------------------------------------ privacy plan and budget

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        if self._train_dataset_size is None or self._dataloader_batch_size is None:
            raise ValueError("LongShieldStrategy needs a training DataLoader with a sized dataset.")
        arguments = self._privacy_arguments
        if self._restored_state is not None:
            stored = self._restored_state["plan"]
            arguments = replace(
                arguments,
                noise_multiplier=stored["noise_multiplier"],
                target_epsilon=stored["target_epsilon"],
                target_delta=stored["delta"],
            )
        planned_steps = trainer.estimated_stepping_batches - trainer.global_step
        self.privacy_plan, messages = resolve_plan(
            arguments,
            dataset_size=self._train_dataset_size,
            expected_batch_size=self._dataloader_batch_size * self.data_parallel_size,
            planned_steps=planned_steps,
            accountant=self.accountant,
        )
        if not self.poisson_sampling:
            messages.append(
                "poisson_sampling=False: logical batches come from the DataLoader, but the accountant assumes"
                " Poisson sampling, so the reported epsilon is not a formal guarantee."
            )
        for message in messages:
            rank_zero_warn(message)
        rank_zero_info(f"LongShield DP-SGD: {self.privacy_plan.describe()}, max_grad_norm={self.max_grad_norm:g}.")
        self._planned_end = trainer.global_step + planned_steps
        self._steps_left_in_budget = self._budgeted_steps(planned_steps)
        if self._steps_left_in_budget == 0:
            self._stop(trainer, "the privacy budget is already spent")
        elif self._steps_left_in_budget is not None and self._steps_left_in_budget < planned_steps:
            rank_zero_warn(
                f"The privacy budget allows {self._steps_left_in_budget} of the {planned_steps} planned steps;"
                " training will stop there."
            )
        elif self._steps_left_in_budget is not None:
            rank_zero_info(f"The privacy budget (target epsilon) covers all {planned_steps} planned steps.")

    def _budgeted_steps(self, planned_steps: float) -> Optional[int]:
        plan = self.privacy_plan
        assert plan is not None
        if plan.target_epsilon is None:
            return None
        limit = int(min(planned_steps, 10 * plan.planned_steps + 1))
        return self.accountant.steps_within_budget(
            plan.target_epsilon, plan.noise_multiplier, plan.sample_rate, plan.delta, limit
        )

    def _stop(self, trainer: pl.Trainer, reason: str) -> None:
        plan = self.privacy_plan
        assert plan is not None
        trainer.should_stop = True
        rank_zero_warn(
            f"Stopping DP training: {reason} (epsilon={self.get_epsilon():.3f} of target {plan.target_epsilon},"
            f" delta={plan.delta:.3g}, after {self.accountant.steps} DP steps)."
        )

    @property
    def dp_engine(self) -> DPSGDEngine:
        """The DP-SGD engine of the current fit (per-sample capture, clipping, clipped sum, noise); after `setup`."""
        if self._engine is None:
            raise RuntimeError("The DP engine exists only after the strategy's setup (inside Trainer.fit).")
        return self._engine

    @property
    def max_grad_norm(self) -> float:
        return self._privacy_arguments.max_grad_norm

    def get_epsilon(self, delta: Optional[float] = None) -> float:
        """Epsilon spent so far at ``delta`` (default: the run's target delta)."""
        if delta is None:
            if self.privacy_plan is None:
                raise ValueError("No delta yet: pass delta=..., or call after training has started.")
            delta = self.privacy_plan.delta
        return self.accountant.get_epsilon(delta)

    # ------------------------------------------------------------------ one DP step

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._engine is not None
        batch, rest = args[0], args[1:]
        self._engine.begin_logical_batch()
        if batch_size_of(batch) == 0:
            self._microbatch_size = 0
            return torch.zeros((), device=self.root_device, requires_grad=True)
        microbatches = split_into_microbatches(batch, self.micro_batch_size)
        for microbatch in microbatches[:-1]:
            output = self._microbatch_training_step(microbatch, rest, kwargs)
            self.backward(_loss_of(output), None)
        output = self._microbatch_training_step(microbatches[-1], rest, kwargs)
        self._warn_about_sampled_batch_metrics()
        return output

    def _microbatch_training_step(self, microbatch: Any, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._microbatch_size = batch_size_of(microbatch)
        self._engine.prepare_microbatch(self._microbatch_size)  # type: ignore[union-attr]
        return super().training_step(self._shard_sequence(microbatch), *rest, **kwargs)

    def _warn_about_sampled_batch_metrics(self) -> None:
        """Warn (once per metric) that a metric logged in ``training_step`` is outside the privacy guarantee."""
        results = self.lightning_module.trainer._results
        names = {key.split(".", 1)[1] for key in results or {} if key.startswith("training_step.")}
        new = sorted(names - self._warned_metrics)
        if new:
            self._warned_metrics.update(new)
            rank_zero_warn(
                f"training_step logged {new}: computed from the sampled batch without noise, these values are NOT"
                " covered by the differential-privacy guarantee, which protects only the noisy parameters. Log"
                " metrics on held-out data (validation) instead, unless releasing them is acceptable."
            )

    def _shard_sequence(self, batch: Any) -> Any:
        """This rank's head-tail shard of every sequence (with global positions and whole-sequence token counts)."""
        if not self.is_context_parallel:
            return batch
        cp = self.context_parallel_mesh
        return shard_batch(batch, cp.get_local_rank(), cp.size())

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return super().validation_step(self._shard_sequence(args[0]), *args[1:], **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """Back-propagate one micro-batch and fold its clipped per-sample gradients into the logical batch.

        The gradients are folded (and ``.grad`` cleared) before ``on_after_backward`` runs, so no hook ever sees a
        sample's unclipped gradient; ``on_before_optimizer_step`` sees the private one.
        """
        assert self._engine is not None
        size = self._microbatch_size
        if size == 0:
            return closure_loss.detach()
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        # The loss is a mean over samples; scaling by the size makes each sample's gradient its own loss's gradient.
        self.precision_plugin.backward(closure_loss * size, module, optimizer, *args, **kwargs)
        self._engine.accumulate_microbatch(size)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[pl.LightningModule, torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        if self._steps_left_in_budget == 0:
            raise RuntimeError("The privacy budget is spent; refusing to release another private gradient.")

        def closure_then_release() -> Any:
            result = closure()
            self._release_private_gradient()
            return result

        return super().optimizer_step(optimizer, closure_then_release, model, **kwargs)

    def _release_private_gradient(self) -> None:
        plan = self.privacy_plan
        assert plan is not None and self._engine is not None
        self._engine.release(plan.noise_multiplier, plan.sample_rate, plan.expected_batch_size)
        if self._steps_left_in_budget is not None:
            self._steps_left_in_budget -= 1
            trainer = self.lightning_module.trainer
            if self._steps_left_in_budget == 0:
                trainer.should_stop = True
                # Only a stop that cuts the plan short is news; a run whose last planned step uses the budget ends.
                if trainer.global_step + 1 < self._planned_end:
                    self._stop(trainer, "one more step would exceed the privacy budget")

    # ------------------------------------------------------------------ checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full, unsharded state dict (gathered over the CP group when parameters are sharded)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.lightning_module, options=options)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_model_state_dict(self.lightning_module, checkpoint["state_dict"], options=options)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full optimizer state keyed by parameter name, so it loads under any CP size."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.lightning_module, optimizer, options=options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        options = StateDictOptions(full_state_dict=True)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            set_optimizer_state_dict(self.lightning_module, optimizer, state, options=options)

    def _dp_state_dict(self) -> dict[str, Any]:
        """What a resumed run needs: the plan and the accountant's history (hence the step counter). Never the
        noise's or the sampler's secrets: a resumed run draws fresh ones."""
        assert self.privacy_plan is not None
        return {"plan": self.privacy_plan.state_dict(), "accountant": self.accountant.state_dict()}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if self._noise is not None and self.privacy_plan is not None:
            checkpoint[CHECKPOINT_KEY] = self._dp_state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=False)
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is not None and self._noise is not None:
            self.accountant.load_state_dict(state["accountant"])
            self._restored_state = state
        return checkpoint

    # ------------------------------------------------------------------ collectives

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        container = [obj]
        torch.distributed.broadcast_object_list(container, src, group=_group.WORLD)
        return container[0]

    @override
    def reduce(
        self,
        tensor: Union[Tensor, Any],
        group: Optional[Any] = None,
        reduce_op: Optional[Union[ReduceOp, str]] = "mean",
    ) -> Tensor:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def teardown(self) -> None:
        if self._engine is not None:
            self._engine.remove()
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "longshield", cls, description="LongShield DP-SGD with context parallelism (relaunches the script)"
        )
        strategy_registry.register(
            "longshield_spawn", cls, description="LongShield DP-SGD, processes spawned", start_method="spawn"
        )


def _loss_of(output: Any) -> Tensor:
    """The loss tensor of a ``training_step`` output (a tensor or a dict with ``"loss"``)."""
    return output["loss"] if isinstance(output, Mapping) else output
