"""`LongShieldStrategy`: DP-SGD (flat or per-layer clipping, noise, Poisson sampling, accounting) as a Lightning
strategy."""

from __future__ import annotations

import os
import sys
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_longshield import dp_dataloaders
from lightning_longshield import preflight as _preflight
from lightning_longshield.activation_checkpointing import remove_activation_checkpointing
from lightning_longshield.callbacks import add_training_callbacks
from lightning_longshield.checkpoints import StrategyCheckpoints, check_checkpoint_options, mark_trained
from lightning_longshield.context_parallel import (
    CONTEXT_PARALLEL,
    DATA_PARALLEL,
    build_all_ranks_mesh,
    build_device_mesh,
    check_shardable,
    resolve_parallel_sizes,
    shard_batch,
)
from lightning_longshield.context_parallel.evaluation import check_evaluation_layout
from lightning_longshield.cpu_allocator import retain_freed_memory
from lightning_longshield.dp_step_loop import DPStepLoop
from lightning_longshield.durable_checkpoints import DurableCheckpointIO
from lightning_longshield.evaluation_split import declare_labelled_records
from lightning_longshield.launcher import GatheringMultiProcessingLauncher
from lightning_longshield.padding import ZeroWeightPadding
from lightning_longshield.parallelize import parallelize, sync_data_parallel_replicas
from lightning_longshield.privacy import DPSGDEngine, PrivacyAccountant
from lightning_longshield.privacy.metric_guard import SampledBatchMetricGuard
from lightning_longshield.privacy.plan import PrivacyArguments, PrivacyPlan
from lightning_longshield.privacy.session import PrivacySession
from lightning_longshield.trainer_checks import (
    check_minimums_within_budget,
    check_no_stray_trainable_tensors,
    check_same_training_data,
    check_trainer_for_dp_sgd,
    planned_fit_steps,
    warn_micro_batch_above_batch,
    warn_validation_on_training_data,
)
from simulate.strategy_config import (
    DEFAULT_BUCKET_MB,
    CheckpointPolicy,
    PerLayerClipping,
    ProjectedNorms,
    StrategyConfig,
)


class LongShieldStrategy(StrategyCheckpoints, DPStepLoop, ModelParallelStrategy):
    """Differentially private training (DP-SGD) of a LightningModule on a (data_parallel, context_parallel) mesh.

    Each context-parallel group shares every batch: sequences are sharded head-tail over it, parameters and optimizer
    state FSDP2-sharded, attention all-gathers K/V, and per-sample gradients are completed by the ``exchange``.
    Data-parallel groups draw disjoint Poisson samples. Every optimizer step is one DP step over one logical batch,
    run in micro-batches: each sample's gradient is clipped to ``max_grad_norm`` (flat, or per layer), the clipped
    sum gets Gaussian noise ``N(0, (noise_multiplier * max_grad_norm)^2)`` once and is divided by the expected
    logical batch size (DataLoader ``batch_size`` x data-parallel size); an Opacus accountant records every step.

    Args (privacy):
        noise_multiplier: sigma; give this or ``target_epsilon`` (both: sigma is checked against the budget).
            Neither: the noise is calibrated to ``target_epsilon=8``. ``0.0`` disables privacy (for tests).
        target_epsilon: privacy budget; training stops before a step would exceed it.
        target_delta: delta of the guarantee (default ``1 / (10 * dataset size)``).
        max_grad_norm: the clipping bound ``C`` of a sample's gradient over all trainable parameters.
        poisson_sampling: ``False`` uses the DataLoader's own batches as logical batches; the accountant still
            assumes Poisson sampling, so the reported epsilon is then not a formal guarantee.
        accountant: ``"prv"`` (default; Opacus's PRV accountant with a bounded grid, tighter) or ``"rdp"``.
        secure_mode: noise from ChaCha20 keyed by fresh OS entropy with Opacus's four-draw Gaussians, instead of
            the default AES-256-CTR keystreams on CPU (cryptographic, Box-Muller) and keyed Philox generators on GPU
            (hardened). Poisson masks are SHAKE-256 either way.
        seed: seeds the global RNGs of every process outside DP steps (initialisation, order of non-private data),
            never the noise, the Poisson sampling or a DP step's dropout: those come from OS entropy drawn at each
            ``fit``, never stored.
        noise_seed: for tests only: reproducible noise and sampling from this seed (a warning says why not to).
        privacy_ledger: the file that records each DP step (fsynced) before it releases, so a resumed run also
            accounts the steps run after its checkpoint (default: ``<default_root_dir>/privacy_ledger.jsonl``).

    Args (layout and clipping, one `simulate.strategy_config.StrategyConfig` that validates them together, documents
    each and is what the planner plans): ``context_parallel_size`` (``None``: all processes), ``micro_batch_size``
    (the memory knob; no privacy effect), ``exchange`` (``"reduce_scatter"`` V2, ``"all_reduce"`` V1,
    ``"output_stationary"``), ``overlap_communication``, ``communication_bucket_mb``, ``activation_checkpointing``
    (V3), ``norms`` (``"materialize"``, ``"ghost"``, ``"mixed"``, ``"hutchinson"``, ``"hutchpp"`` or `ProjectedNorms`),
    ``clipping`` (``"flat"``, ``"per_layer"`` or `PerLayerClipping`) and ``shard_over`` (``"context_parallel"`` or
    ``"all"``).

    Args (checkpoints):
        checkpoint_format: ``"sharded"``: every rank writes and reads its own shards (PyTorch's distributed
            checkpoint engine), a folder that loads at any layout; ``"full"``: one file gathered on rank 0;
            ``"auto"`` (default): one file up to 2^27 (134 M) parameters or with one process, sharded above that
            with several.
        async_checkpoints: sharded saves copy the shards in memory and write them in a background thread while
            training goes on; each is renamed into place once every rank has written it (checked at step starts).

    Args (launch):
        start_method: ``"popen"`` (torchrun-style script relaunch) or a multiprocessing start method.
        preflight: ask the `simulate` planner before the first step whether the run fits: on CUDA one that will not
            stops with a `PreflightMemoryError` (peak, breakdown, a configuration that fits); on CPU it is logged.
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
        exchange: Literal["reduce_scatter", "all_reduce", "output_stationary"] = "reduce_scatter",
        overlap_communication: bool = True,
        communication_bucket_mb: float = DEFAULT_BUCKET_MB,
        activation_checkpointing: CheckpointPolicy = False,
        norms: Union[Literal["materialize", "ghost", "mixed", "hutchinson", "hutchpp"], ProjectedNorms] = "materialize",
        clipping: Union[Literal["flat", "per_layer"], PerLayerClipping] = "flat",
        shard_over: Literal["context_parallel", "all"] = "context_parallel",
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
        privacy_ledger: Optional[Union[str, os.PathLike]] = None,
        checkpoint_format: Literal["auto", "sharded", "full"] = "auto",
        async_checkpoints: bool = False,
    ) -> None:
        super().__init__(save_distributed_checkpoint=False, process_group_backend=process_group_backend,
                         timeout=timeout)
        self.accelerator, self.parallel_devices = accelerator, parallel_devices
        self.cluster_environment = cluster_environment
        self.checkpoint_io = checkpoint_io or DurableCheckpointIO()  # type: ignore[assignment]
        self.precision_plugin = precision_plugin  # type: ignore[assignment]
        self.config = StrategyConfig(
            context_parallel_size=context_parallel_size, micro_batch_size=micro_batch_size, exchange=exchange,
            overlap_communication=overlap_communication, communication_bucket_mb=communication_bucket_mb,
            activation_checkpointing=activation_checkpointing, norms=norms, clipping=clipping, shard_over=shard_over)
        arguments = PrivacyArguments(noise_multiplier, target_epsilon, target_delta, max_grad_norm, accountant)
        self.privacy = PrivacySession(arguments, secure_mode, noise_seed, poisson_sampling, self.config.projected_norms)
        self.seed = seed
        self.preflight = preflight
        self.privacy_ledger = privacy_ledger
        check_checkpoint_options(checkpoint_format, async_checkpoints)
        self.checkpoint_format = checkpoint_format
        self.async_checkpoints = async_checkpoints
        self._start_method = start_method
        self._engine: Optional[DPSGDEngine] = None
        self._padding = ZeroWeightPadding()  # its mesh: FSDP2's with shard_over="all" and data parallelism
        self._metric_guard = SampledBatchMetricGuard()
        self._submeshes: dict[str, DeviceMesh] = {}  # the device mesh's named dimensions, sliced as it is built

    # ------------------------------------------------------------------ topology and launch

    @property
    def data_parallel_size(self) -> int:
        return self._submesh(DATA_PARALLEL).size()

    @property
    def data_parallel_rank(self) -> int:
        return self._submesh(DATA_PARALLEL).get_local_rank()

    @property
    def context_parallel_mesh(self) -> DeviceMesh:
        """The 1-D mesh of this process's context-parallel group (its peers share every batch)."""
        return self._submesh(CONTEXT_PARALLEL)

    def _submesh(self, name: str) -> DeviceMesh:
        """One named dimension of the device mesh, sliced when the mesh is built: a slice takes about 0.25 ms, and
        every micro-batch asks whether the run is context-parallel. Before set-up, `device_mesh`'s error."""
        return self._submeshes[name] if self._submeshes else self.device_mesh[name]

    @property
    def is_context_parallel(self) -> bool:
        return self.context_parallel_mesh.size() > 1

    @override
    def _configure_launcher(self) -> None:
        if self._start_method == "popen":
            return super()._configure_launcher()  # torchrun-style relaunch of the script, unless launched externally
        self._launcher = GatheringMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        excepthook = sys.excepthook
        self._setup_distributed()
        if self.world_size == 1:
            sys.excepthook = excepthook  # one process: tracebacks need no "[rank0]:" prefix on every line
        if self.seed is not None:
            seed_everything(self.seed, verbose=False)
        self._shuffle_seed = dp_dataloaders.shared_shuffle_seed(self.seed, self.broadcast)
        sizes = resolve_parallel_sizes(self.world_size, self.config.context_parallel_size)
        self._device_mesh = build_device_mesh(self.root_device.type, *sizes)
        self._submeshes = {name: self._device_mesh[name] for name in (DATA_PARALLEL, CONTEXT_PARALLEL)}
        sharded_over_all = self.config.shard_over == "all" and sizes[0] > 1
        self._padding.mesh = build_all_ranks_mesh(self.root_device.type, self.world_size) if sharded_over_all else None
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        # Before a hook can build the training DataLoader (as reading trainer.estimated_stepping_batches does).
        trainer = self.lightning_module.trainer
        trainer._accelerator_connector.use_distributed_sampler = False
        if trainer.state.fn == TrainerFn.FITTING:
            stream = (self.data_parallel_rank, self.context_parallel_mesh.get_local_rank())
            self.privacy.open_fit(self.root_device, stream, self.broadcast)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            check_trainer_for_dp_sgd(trainer, self.lightning_module, self.precision_plugin,
                                     self.privacy.poisson_sampling)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if not fitting:
            check_evaluation_layout(self.lightning_module, trainer.state.fn, self.context_parallel_mesh.size(),
                                    self.config.shard_over, self.world_size)
        if fitting:
            if self.root_device.type == "cpu":
                retain_freed_memory()  # per-sample gradients reuse the last micro-batch's pages
            self._engine = self._build_engine()
            # A fresh clipped sum, and a fresh count of the loop's batches: nothing of an earlier fit is carried over.
            self._release_pending, self._released_batch = False, None
            add_training_callbacks(trainer)
            self.setup_optimizers(trainer)
            check_no_stray_trainable_tensors(tensor for optimizer in self.optimizers
                                             for tensor in self._engine.uncaptured(optimizer))
            _optimizers_to_device(self.optimizers, self.root_device)
        self.setup_precision_plugin()

    def _build_engine(self) -> DPSGDEngine:
        """Parallelise the model and wire the exchange of its layout into a fresh DP engine."""
        module, precision = self.lightning_module, self.precision_plugin.precision
        exchange = parallelize(module, self.config, self.context_parallel_mesh, self.root_device, precision,
                               self._padding.mesh, getattr(module, "initialize_materialized", None))
        dp_group = self._submesh(DATA_PARALLEL).get_group() if self.data_parallel_size > 1 else None
        sync_data_parallel_replicas(module, dp_group, sharded_over_all=self.config.shard_over == "all")
        assert self.privacy.noise is not None
        return DPSGDEngine(module, self.max_grad_norm, self.privacy.noise, self.accountant, exchange, dp_group,
                           self.config, projection_key=self.privacy.projection_key)

    @override
    def model_to_device(self) -> None:
        """Move the model to the device, if it is elsewhere (a meta-device model is materialised shard by shard after
        FSDP2 instead)."""
        assert self.model is not None
        tensors = [*self.model.parameters(), *self.model.buffers()]
        if not any(t.is_meta for t in tensors) and any(t.device != self.root_device for t in tensors):
            self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Under context parallelism the model that ``configure_model`` builds goes to the meta device, so no rank
        ever holds the whole model: FSDP2 shards it and each rank allocates and initialises only its own shards."""
        if empty_init is None:
            sharded_over_all = self.config.shard_over == "all" and self.world_size > 1
            empty_init = self._device_mesh is not None and (self.is_context_parallel or sharded_over_all)
        parent = ModelParallelStrategy if empty_init else ParallelStrategy
        with parent.tensor_init_context(self, empty_init):
            yield

    # ------------------------------------------------------------------ data

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Training: Poisson logical batches keyed to the data-parallel rank. Evaluation: a data-parallel split."""
        if not isinstance(dataloader, DataLoader):
            return dataloader
        rank, size, cp = self.data_parallel_rank, self.data_parallel_size, self.context_parallel_mesh.size()
        trainer = self.lightning_module.trainer
        if not trainer.training:
            if trainer.state.fn == TrainerFn.FITTING:  # validation during fit, before or after the training data
                warn_validation_on_training_data(getattr(self, "_training_dataset", None), dataloader)
            return dp_dataloaders.data_parallel_dataloader(dataloader, rank, size, False, cp, self._shuffle_seed)
        self._training_dataset = dataloader.dataset
        warn_validation_on_training_data(dataloader.dataset, trainer.val_dataloaders)
        dataset_size = dp_dataloaders.training_set_size(dataloader)
        split_digest = getattr(dataloader.dataset, "split_digest", None)
        check_same_training_data(dataset_size, dataloader.batch_size, split_digest)
        self.privacy.record_training_data(dataset_size, dataloader.batch_size, split_digest)
        warn_micro_batch_above_batch(self.config.micro_batch_size, dataloader.batch_size)
        if (length := _preflight.public_sequence_length(dataloader.dataset)) is not None:  # else checked per batch
            check_shardable(length, cp)  # before any step, on every rank
        self._padding.use_data(dataloader.dataset, dataloader.collate_fn)
        if self.preflight:
            _preflight.run_preflight(
                module=self.lightning_module, dataset=dataloader.dataset, device=self.root_device,
                world_size=self.world_size, cp=self.context_parallel_mesh.size(),
                precision=str(self.precision_plugin.precision), config=self.config,
            )
        return dp_dataloaders.training_dataloader(dataloader, self.privacy.poisson_key, lambda: self.accountant.steps,
                                                  rank, size, cp, self._shuffle_seed)

    # ------------------------------------------------------------------ privacy

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        dp_dataloaders.key_poisson_sampling(trainer.train_dataloader, self.privacy.poisson_key, self.accountant.steps,
                                            self.privacy.reproducible)
        self._padding.check_source()
        planned_steps = planned_fit_steps(trainer, calibrating=self.privacy.arguments.noise_multiplier is None)
        if self.privacy.start_training(trainer.global_step, planned_steps, self.data_parallel_size):
            trainer.should_stop = True
        if self.privacy.steps_left_in_budget is not None:
            check_minimums_within_budget(trainer, self.privacy.steps_left_in_budget)

    @property
    def accountant(self) -> PrivacyAccountant:
        """The privacy accountant (every released step; survives checkpoints)."""
        return self.privacy.accountant

    @property
    def privacy_plan(self) -> Optional[PrivacyPlan]:
        """The resolved mechanism (noise multiplier, delta, sampling rate, budget) once training has started."""
        return self.privacy.plan

    @property
    def max_grad_norm(self) -> float:
        return self.privacy.max_grad_norm

    @property
    def dp_engine(self) -> DPSGDEngine:
        """The DP-SGD engine of the current fit (per-sample capture, clipping, clipped sum, noise); after `setup`."""
        if self._engine is None:
            raise RuntimeError("The DP engine exists only after the strategy's setup (inside Trainer.fit).")
        return self._engine

    def get_epsilon(self, delta: Optional[float] = None) -> float:
        """Epsilon spent so far at ``delta`` (default: the run's target delta)."""
        return self.privacy.get_epsilon(delta)

    # ------------------------------------------------------------------ context parallelism

    def _shard_sequence(self, batch: Any) -> Any:
        """This rank's head-tail shard of every sequence (with global positions and whole-sequence token counts)."""
        if not self.is_context_parallel:
            return batch
        cp = self.context_parallel_mesh
        return shard_batch(batch, cp.get_local_rank(), cp.size())

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        declare_labelled_records(self.lightning_module.trainer, args[0])
        return super().validation_step(self._shard_sequence(args[0]), *args[1:], **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        declare_labelled_records(self.lightning_module.trainer, args[0])
        return super().test_step(self._shard_sequence(args[0]), *args[1:], **kwargs)

    @override
    def teardown(self) -> None:
        if self.lightning_module is not None and self._fitting():  # also after an error: its steps trained them
            mark_trained(self.lightning_module, self.privacy)
        if self._engine is not None:
            self._engine.remove()
        if self.lightning_module is not None:  # also after a set-up that failed once the blocks were wrapped
            remove_activation_checkpointing(self.lightning_module)
        self.privacy.close_ledger()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("longshield", cls, description="LongShield DP-SGD (relaunches the script)")
        strategy_registry.register("longshield_spawn", cls, description="LongShield DP-SGD, processes spawned",
                                   start_method="spawn")
