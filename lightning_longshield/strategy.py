"""`LongShieldStrategy`: DP-SGD (flat or per-layer clipping, noise, Poisson sampling, accounting) as a Lightning
strategy."""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_longshield import preflight as _preflight
from lightning_longshield.activation_checkpointing import CheckpointPolicy
from lightning_longshield.batching import batch_size_of, split_into_microbatches
from lightning_longshield.callbacks import PrivacyMonitor
from lightning_longshield.context_parallel import (
    CONTEXT_PARALLEL,
    DATA_PARALLEL,
    build_all_ranks_mesh,
    build_device_mesh,
    resolve_parallel_sizes,
    shard_batch,
)
from lightning_longshield.dp_dataloaders import data_parallel_dataloader, training_dataloader
from lightning_longshield.full_state_checkpoints import FullStateCheckpoints
from lightning_longshield.launcher import GatheringMultiProcessingLauncher
from lightning_longshield.parallelize import DPParallelism, parallelize
from lightning_longshield.privacy import DPSGDEngine, PrivacyAccountant
from lightning_longshield.privacy.grad_sample.exchange import DEFAULT_BUCKET_BYTES
from lightning_longshield.privacy.metric_guard import SampledBatchMetricGuard
from lightning_longshield.privacy.per_layer import Clipping, PerLayerKernel, ThresholdSpec
from lightning_longshield.privacy.plan import PrivacyArguments, PrivacyPlan
from lightning_longshield.privacy.session import PrivacySession
from lightning_longshield.trainer_checks import check_trainer_for_dp_sgd

CHECKPOINT_KEY = "longshield"


@contextmanager
def _logging_discarded(module: pl.LightningModule) -> Generator[None, None, None]:
    """``module.log`` and ``module.log_dict`` do nothing inside (instance attributes shadow the methods)."""
    names = ("log", "log_dict")
    saved = {name: module.__dict__[name] for name in names if name in module.__dict__}
    for name in names:
        module.__dict__[name] = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for name in names:
            del module.__dict__[name]
        module.__dict__.update(saved)


class LongShieldStrategy(FullStateCheckpoints, ModelParallelStrategy):
    """Differentially private training (DP-SGD) of a LightningModule on a (data_parallel, context_parallel) mesh.

    With several processes, each context-parallel group shares every batch: sequences are sharded head-tail over
    the group, parameters (and optimizer state) are FSDP2-sharded over it, attention all-gathers K/V, and per-sample
    gradients are completed by the exchange chosen with ``shard_per_sample_grads`` / ``grad_sample_pattern``.
    Data-parallel groups draw disjoint Poisson samples and sum their clipped gradients before the noise.

    Every optimizer step is one DP step over one logical batch: the batch (Poisson-sampled by default) is split
    into micro-batches of ``micro_batch_size``; each sample's gradient over all trainable parameters is clipped to
    norm ``max_grad_norm`` (with ``clipping="per_layer"``: each parameter's part to its own share of it); the clipped
    sum gets Gaussian noise ``N(0, (noise_multiplier * max_grad_norm)^2)`` once, is divided by the expected logical
    batch size (the DataLoader's ``batch_size`` x data-parallel size), and the wrapped optimizer steps. An Opacus
    accountant records every step; `get_epsilon` reports the privacy spent.

    Args:
        context_parallel_size: processes per context-parallel group (``None``: all of them).
        noise_multiplier: sigma; give this or ``target_epsilon`` (both: sigma is checked against the budget).
            Neither: the noise is calibrated to ``target_epsilon=8``. ``0.0`` disables privacy (for tests).
        target_epsilon: privacy budget; training stops before a step would exceed it.
        target_delta: delta of the guarantee (default ``1 / (10 * dataset size)``).
        max_grad_norm: the clipping bound ``C`` of a sample's gradient over all trainable parameters.
        micro_batch_size: samples per forward/backward (the memory knob; does not change the privacy).
        poisson_sampling: ``False`` uses the DataLoader's own batches as logical batches; the accountant still
            assumes Poisson sampling, so the reported epsilon is then not a formal guarantee.
        shard_per_sample_grads: ``True`` reduce-scatters per-sample gradients over the CP group (LongShield-V2),
            ``False`` all-reduces them (V1). With one sample per micro-batch both use FSDP2's reduce-scatter.
        grad_sample_pattern: ``"input_stationary"`` (reduce-scatter the local partials) or ``"output_stationary"``
            (linear layers exchange activations and output gradients instead) for V2.
        overlap_communication: overlap the per-sample reduce-scatter with the backward of the next layer.
        communication_bucket_mb: V2 reduce-scatters per-sample gradients in buckets of at least this size (small
            parameters travel together); ``0`` sends one collective per parameter. Exact either way.
        activation_checkpointing: DP-safe block-level activation checkpointing (LongShield-V3): ``True`` for every
            block, an int ``k`` for every k-th block, or a callable ``(index, block) -> bool``.
        per_sample: how linear and embedding weights get per-sample norms and clipped sums. ``"materialize"``
            (default): per-sample gradients ``(MBS, *shape)``, the right choice for long sequences. ``"ghost"``: norms
            from two ``T x T`` Gram matrices per sample (an embedding's from its token ids) and book-keeping: the
            clipped sum is one matmul per layer over the kept (output gradient, input), in the same backward.
            ``"mixed"``: per weight the cheaper of the two (ghost and book-keeping when ``T (in + out) < in x out``:
            (G, A) are smaller than the gradient; else the per-sample gradient). Norm layers and biases always
            materialise (vectors). The same DP-SGD step either way.
        shard_over: ``"context_parallel"`` (default): FSDP2 shards model states over each CP group and data-parallel
            groups hold replicas. ``"all"``: over every rank (data-parallel x context-parallel, TorchTitan's
            ``dp_shard_cp``): parameters, AdamW moments and the released gradient are ``1/world`` per rank; clipped
            sums are reduce-scattered over the data-parallel group once per step and each rank adds the noise of
            its own chunk. Every micro-batch then takes the per-sample path (FSDP2's one-sample ``.grad`` would
            mix replicas' samples). FSDP2's collectives then span every rank, so a data-parallel group whose
            Poisson batch has fewer micro-batches than another's (or none) runs zero-weight padding micro-batches
            until all have run as many: they issue the same collectives and add exactly zero to the clipped sum.
            With CP 1 and ``per_sample="mixed"`` this is the paper's ZeRO-DP+ baseline.
        clipping: ``"flat"`` (default): each sample's whole gradient is clipped to ``max_grad_norm``. ``"per_layer"``:
            each trainable parameter tensor (a layer, as in Opacus; a tied weight once) is clipped to its own bound
            ``C_l`` as soon as its per-sample gradients are complete in backward, then added to the clipped sum and
            freed, so about one layer's (or one reduce-scatter bucket's) per-sample gradients are held at a time. The
            bounds satisfy ``sum C_l^2 <= max_grad_norm^2``: noise and accounting are unchanged. Needs
            ``per_sample="materialize"``.
        per_layer_thresholds: with ``clipping="per_layer"``: ``"equal"`` (default, ``C / sqrt(L)`` for ``L``
            trainable parameters), ``"proportional"`` (``C sqrt(n_l / sum n)`` for parameter counts ``n_l``) or a
            mapping ``{name: C_l}`` over every trainable parameter, named as in the LightningModule's
            ``named_parameters()``, with ``sum C_l^2 <= max_grad_norm^2``.
        per_layer_kernel: with ``clipping="per_layer"``, how linear weights are clipped: ``"auto"`` (default) by a
            fused Triton kernel that never writes their per-sample gradients to memory (FlashDP) where it runs (CUDA
            with Triton, context-parallel size 1), else as ``"torch"`` (per-sample gradients materialised one layer at
            a time); ``"triton"`` requires the kernel.
        norm_estimator: ``"exact"`` (default) or randomized clipping (DP-SGD-RC): ``"hutchinson"`` / ``"hutchpp"``
            estimate each sample's squared norm over linear (and tied) weights with ``projection_dim`` Gaussian
            projections of its (input, output gradient) factors, ``O(k (T + d + p))`` memory per layer, drawn fresh
            and secret every step (shared by the step's micro-batches, so a sample's factor never depends on which
            others were drawn); embedding and norm weights keep exact norms; the clipped sum is book-kept in
            the same backward. The clip factor is then random, so the step is accounted by its own accountant
            (`lightning_longshield.privacy.randomized`, which also calibrates ``target_epsilon``); it needs slightly
            more noise than exact clipping for the same epsilon.
        projection_dim: ``k``, the projections per linear layer of a randomized estimator (default 32; Hutch++
            spends ``k // 3`` of them on its head and accounts the other ``k - k // 3``).
        accountant: ``"prv"`` (default; Opacus's PRV accountant with a bounded grid, tighter) or ``"rdp"``.
        secure_mode: for a real deployment: each noise tensor a ChaCha20 keystream keyed by 256 fresh bits of OS
            entropy (cryptographic), turned into Gaussians with Opacus's four-draw hardening (hardened, not proven
            against floating-point attacks). By default the noise comes from torch's generators with their whole
            state keyed per step (fast; not a cryptographic generator). Poisson masks are SHAKE-256 in both modes.
        seed: seeds the global RNGs of every process (initialisation, dropout, order of non-private data), never
            the noise or the Poisson sampling: those come from OS entropy drawn at each ``fit``, never stored.
        noise_seed: opt-in, for tests only: reproducible noise and Poisson sampling from this seed; the guarantee
            then holds only while the seed is secret (a warning says so). Not with ``secure_mode``.
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
        shard_per_sample_grads: bool = True,
        grad_sample_pattern: Literal["input_stationary", "output_stationary"] = "input_stationary",
        overlap_communication: bool = True,
        communication_bucket_mb: float = DEFAULT_BUCKET_BYTES / 2**20,
        activation_checkpointing: CheckpointPolicy = False,
        per_sample: Literal["materialize", "ghost", "mixed"] = "materialize",
        shard_over: Literal["context_parallel", "all"] = "context_parallel",
        clipping: Clipping = "flat",
        per_layer_thresholds: Optional[ThresholdSpec] = None,
        per_layer_kernel: PerLayerKernel = "auto",
        norm_estimator: Literal["exact", "hutchinson", "hutchpp"] = "exact",
        projection_dim: int = 32,
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
        super().__init__(save_distributed_checkpoint=False, process_group_backend=process_group_backend,
                         timeout=timeout)
        self.accelerator, self.parallel_devices = accelerator, parallel_devices
        self.cluster_environment = cluster_environment
        self.checkpoint_io, self.precision_plugin = checkpoint_io, precision_plugin  # type: ignore[assignment]
        self.parallelism = DPParallelism(
            context_parallel_size, shard_per_sample_grads, grad_sample_pattern, overlap_communication,
            communication_bucket_mb, activation_checkpointing, per_sample, shard_over, clipping, per_layer_thresholds,
            per_layer_kernel, norm_estimator, projection_dim,
        )
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}.")
        arguments = PrivacyArguments(noise_multiplier, target_epsilon, target_delta, max_grad_norm, accountant)
        self.privacy = PrivacySession(arguments, secure_mode, noise_seed, poisson_sampling, norm_estimator,
                                      projection_dim)
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.preflight = preflight
        self._start_method = start_method
        self._engine: Optional[DPSGDEngine] = None
        self._all_ranks_mesh: Optional[DeviceMesh] = None  # FSDP2's mesh with shard_over="all" and data parallelism
        self._metric_guard = SampledBatchMetricGuard()
        # How to build a padding micro-batch (`_padding_microbatch`): the training data's (dataset, collate_fn), and
        # the one-sample batch made from them, on the device.
        self._padding_source: Optional[tuple[Any, Callable[[list[Any]], Any]]] = None
        self._padding_batch: Any = None

    # ------------------------------------------------------------------ topology and launch

    @property
    def data_parallel_size(self) -> int:
        return self.device_mesh[DATA_PARALLEL].size()

    @property
    def data_parallel_rank(self) -> int:
        return self.device_mesh[DATA_PARALLEL].get_local_rank()

    @property
    def context_parallel_mesh(self) -> DeviceMesh:
        """The 1-D mesh of this process's context-parallel group (its peers share every batch)."""
        return self.device_mesh[CONTEXT_PARALLEL]

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
        sizes = resolve_parallel_sizes(self.world_size, self.parallelism.context_parallel_size)
        self._device_mesh = build_device_mesh(self.root_device.type, *sizes)
        self._all_ranks_mesh = None
        if self.parallelism.shard_over == "all" and sizes[0] > 1:
            self._all_ranks_mesh = build_all_ranks_mesh(self.root_device.type, self.world_size)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        # The strategy splits data over data-parallel groups itself (CP peers share batches; Poisson sampling).
        trainer._accelerator_connector.use_distributed_sampler = False
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            check_trainer_for_dp_sgd(trainer, self.lightning_module, self.precision_plugin)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            stream = (self.data_parallel_rank, self.context_parallel_mesh.get_local_rank())
            self.privacy.open_fit(self.root_device, stream, self.broadcast)
            self._engine = self._build_engine()
            if not any(isinstance(cb, PrivacyMonitor) for cb in trainer.callbacks):
                trainer.callbacks.append(PrivacyMonitor())
            self.setup_optimizers(trainer)
            _optimizers_to_device(self.optimizers, self.root_device)
        self.setup_precision_plugin()

    def _build_engine(self) -> DPSGDEngine:
        """Parallelise the model and wire the exchange of its layout into a fresh DP engine."""
        module, precision = self.lightning_module, self.precision_plugin.precision
        exchange = parallelize(module, self.parallelism, self.context_parallel_mesh, self.root_device, precision,
                               self._all_ranks_mesh)
        dp_group = self.device_mesh[DATA_PARALLEL].get_group() if self.data_parallel_size > 1 else None
        assert self.privacy.noise is not None
        return DPSGDEngine(module, self.max_grad_norm, self.privacy.noise, self.accountant, exchange, dp_group,
                           per_sample=self.parallelism.per_sample, clipping=self.parallelism.clipping,
                           thresholds=self.parallelism.per_layer_thresholds,
                           per_layer_kernel=self.parallelism.per_layer_kernel,
                           norm_estimator=self.parallelism.norm_estimator,
                           projection_dim=self.parallelism.projection_dim,
                           projection_key=self.privacy.projection_key)

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
            sharded_over_all = self.parallelism.shard_over == "all" and self.world_size > 1
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
        rank, size = self.data_parallel_rank, self.data_parallel_size
        if not self.lightning_module.trainer.training:
            return data_parallel_dataloader(dataloader, rank, size)
        self.privacy.record_training_data(len(dataloader.dataset), dataloader.batch_size)  # type: ignore[arg-type]
        self._padding_source, self._padding_batch = (dataloader.dataset, dataloader.collate_fn), None
        if self.preflight:
            _preflight.run_preflight(
                module=self.lightning_module, dataset=dataloader.dataset, device=self.root_device,
                world_size=self.world_size, cp=self.context_parallel_mesh.size(), mbs=self.micro_batch_size,
                precision=str(self.precision_plugin.precision), parallelism=self.parallelism,
            )
        sampling = self.privacy.sampling if self.privacy.poisson_sampling else None
        return training_dataloader(dataloader, sampling, self.accountant.steps, rank, size)

    # ------------------------------------------------------------------ privacy

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        planned_steps = trainer.estimated_stepping_batches - trainer.global_step
        if self.privacy.start_training(trainer.global_step, planned_steps, self.data_parallel_size):
            trainer.should_stop = True

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

    # ------------------------------------------------------------------ one DP step

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """One DP step's forward and backward: every micro-batch of the logical batch is run and back-propagated here
        (the one path into backward), its clipped per-sample gradients folded into the clipped sum. Returns the last
        micro-batch's output with its loss detached: Lightning's closure finds nothing left to back-propagate. With
        FSDP2 over every rank, padding micro-batches follow (`_padding_microbatches`)."""
        batch, rest = args[0], args[1:]
        self.dp_engine.begin_logical_batch()
        microbatches = split_into_microbatches(batch, self.micro_batch_size)
        padding = self._padding_microbatches(len(microbatches))
        for microbatch in microbatches:
            output = self._microbatch_step(microbatch, rest, kwargs)
        for _ in range(padding):
            self._padding_step(self._padding_microbatch(batch), rest, kwargs)
        if not microbatches:
            return torch.zeros((), device=self.root_device)
        self._metric_guard.check(self.lightning_module.trainer._results or {})
        return output

    def _microbatch_step(self, microbatch: Any, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        size = batch_size_of(microbatch)
        self.dp_engine.prepare_microbatch(size)
        output = super().training_step(self._shard_sequence(microbatch), *rest, **kwargs)
        loss = output["loss"] if isinstance(output, Mapping) else output
        self._backward_microbatch(loss, size)
        return {**output, "loss": loss.detach()} if isinstance(output, Mapping) else loss.detach()

    def _padding_microbatches(self, count: int) -> int:
        """How many zero-weight micro-batches this rank runs after its ``count`` own ones.

        With FSDP2 over every rank (``shard_over="all"`` and data parallelism) each micro-batch's forward and backward
        all-gather and reduce-scatter over every rank, but Poisson sampling gives each data-parallel group its own
        number of samples (possibly none): every rank runs as many micro-batches as the group with the most (one
        all-reduce of a count per step). Elsewhere FSDP2 and every per-micro-batch collective stay within a
        context-parallel group, whose ranks share each batch: no padding.
        """
        if self._all_ranks_mesh is None:
            return 0
        most = torch.tensor([count], dtype=torch.int64, device=self.root_device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self._all_ranks_mesh.get_group())
        return int(most.item()) - count

    def _padding_step(self, microbatch: Any, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """One zero-weight micro-batch: the forward and backward of a one-sample batch issue every collective of a
        real micro-batch, in the same order, while its contribution to the clipped sum is exactly zero (the engine's
        ``padding``, and a loss weighted by 0). What ``training_step`` logs for it is dropped, and no backward hook
        sees it: nothing about the padding sample is logged or released."""
        self.dp_engine.prepare_microbatch(1, padding=True)
        with _logging_discarded(self.lightning_module):
            output = super().training_step(self._shard_sequence(microbatch), *rest, **kwargs)
        loss = output["loss"] if isinstance(output, Mapping) else output
        self.precision_plugin.backward(loss * 0.0, self.lightning_module, None)
        self.dp_engine.accumulate_microbatch(1)

    def _padding_microbatch(self, batch: Any) -> Any:
        """The one-sample batch of padding micro-batches: the training set's first sample, collated and moved to the
        device like any batch (kept for the fit), or, for training data that is not a `DataLoader`, the first sample
        of this step's batch. Its values never reach the clipped sum."""
        if self._padding_batch is None:
            if self._padding_source is not None:
                dataset, collate = self._padding_source
                self._padding_batch = self.batch_to_device(collate([dataset[0]]))
            elif batch_size_of(batch) > 0:
                return apply_to_collection(batch, torch.Tensor, lambda t: t[:1] if t.dim() else t)
            else:
                raise RuntimeError(
                    "A padding micro-batch is needed (shard_over='all': every rank runs as many micro-batches as the"
                    " data-parallel group with the most samples) but this group's batch is empty and the training data"
                    " is not a DataLoader with a map-style dataset to take its shapes from. Use a DataLoader, or"
                    " shard_over='context_parallel'."
                )
        return self._padding_batch

    def _backward_microbatch(self, loss: Tensor, size: int) -> None:
        """Back-propagate one micro-batch and fold its clipped per-sample gradients into the logical batch.

        The gradients are folded (and ``.grad`` cleared) before ``on_after_backward`` runs, so no hook ever sees a
        sample's unclipped gradient; ``on_before_optimizer_step`` sees the private one.
        """
        module = self.lightning_module
        self.pre_backward(loss)
        loss = self.precision_plugin.pre_backward(loss, module)
        # The loss is a mean over samples; scaling by the size makes each sample's gradient its own loss's gradient.
        self.precision_plugin.backward(loss * size, module, None)
        self.dp_engine.accumulate_microbatch(size)
        loss = self.precision_plugin.post_backward(loss, module)
        self.post_backward(loss)

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
        """Lightning's closure calls this after `training_step`, which has already back-propagated every micro-batch
        of the logical batch: nothing is left to do."""
        return closure_loss

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[pl.LightningModule, torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        self.privacy.check_release_allowed()

        def closure_then_release() -> Any:
            result = closure()
            plan = self.privacy.plan
            assert plan is not None
            self.dp_engine.release(plan.noise_multiplier, plan.sample_rate, plan.expected_batch_size)
            trainer = self.lightning_module.trainer
            if self.privacy.released(trainer.global_step):
                trainer.should_stop = True
            return result

        return super().optimizer_step(optimizer, closure_then_release, model, **kwargs)

    # ------------------------------------------------------------------ checkpoints

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        state = self.privacy.state_dict()
        if state is not None:
            checkpoint[CHECKPOINT_KEY] = state
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """One full checkpoint file (not the sharded folder of `ModelParallelStrategy`), and the privacy state."""
        checkpoint = ParallelStrategy.load_checkpoint(self, checkpoint_path, weights_only=False)
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is not None and self.privacy.noise is not None:
            self.privacy.load_state_dict(state)
        return checkpoint

    @override
    def teardown(self) -> None:
        if self._engine is not None:
            self._engine.remove()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "longshield", cls, description="LongShield DP-SGD with context parallelism (relaunches the script)"
        )
        strategy_registry.register(
            "longshield_spawn", cls, description="LongShield DP-SGD, processes spawned", start_method="spawn"
        )
