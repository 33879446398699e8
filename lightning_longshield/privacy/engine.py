"""DP-SGD mechanics of one logical batch: per-sample gradients, flat or per-layer clipping, clipped sum, noisy
release."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_longshield.privacy.accountant import PrivacyAccountant
from lightning_longshield.privacy.accumulator import ClippedGradientSum
from lightning_longshield.privacy.clipping import check_clippable_dtypes, clip_factors, per_sample_squared_norms
from lightning_longshield.privacy.grad_sample import PerSampleGradCapture
from lightning_longshield.privacy.grad_sample.exchange import LocalExchange
from lightning_longshield.privacy.noise import GaussianNoise
from lightning_longshield.privacy.observer import DPStepObserver
from lightning_longshield.privacy.per_layer import PerLayerClipper, per_layer_thresholds, use_fused_kernel
from lightning_longshield.privacy.randomized.estimator import RandomizedNorms
from lightning_longshield.privacy.randomness import SecretKey
from simulate.strategy_config import StrategyConfig


class DPSGDEngine:
    """Owns the per-sample-gradient capture of a model and turns micro-batch backwards into one private gradient.

    Per micro-batch: `prepare_microbatch` before forward, `accumulate_microbatch` after backward (per-sample squared
    norms of the gradients this rank holds, completed by the exchange so every rank clips with the same norm; then
    this rank's part is added to the fp32 sum). Per logical batch: `release` adds the data-parallel groups' sums and
    Gaussian noise with std ``noise_multiplier * max_grad_norm``, divides by the expected logical batch size, fills
    ``param.grad`` and records the step with the accountant.

    The ``exchange`` (default: no context parallelism) decides everything that depends on the parallel layout.
    ``config`` (`simulate.strategy_config.StrategyConfig`, validated there) chooses the rest. Its ``norms`` say how
    linear and embedding weights get per-sample norms and clipped sums: ``"materialize"``, ``"ghost"``, ``"mixed"``
    (see `lightning_longshield.privacy.grad_sample.bookkeeping`).

    With per-layer clipping (``config.per_layer``) every trainable parameter has its own bound (see
    `lightning_longshield.privacy.per_layer`): the exchange hands each parameter's per-sample gradients to a
    `PerLayerClipper` as soon as they are complete, during backward, and the clipped sum takes them there; a
    one-sample micro-batch's ``.grad`` is clipped layer by layer after backward. ``last_per_sample_norms`` is then
    each sample's unclipped norm over all layers, ``last_held_bytes`` the most per-sample gradient bytes held at once.
    Its ``kernel`` (`lightning_longshield.privacy.per_layer.use_fused_kernel`) may send linear weights through the
    fused Triton kernel instead, which holds none of theirs (``fused_weights`` names them).

    Projected norms (``config.projected_norms``, randomized clipping, flat): linear and embedding weights are
    book-kept as under ``norms="ghost"``; the norms of linear (and tied) weights are estimated with Gaussian
    projections keyed by ``projection_key``, the DP step and the parameter: fresh at every step, shared by all
    micro-batches and processes of the step, so no sample's factor depends on which other samples were drawn.
    Embeddings' and other parameters' norms are exact. The clipped sum is then formed by book-keeping, in the same
    backward; a one-sample micro-batch is book-kept too (never clipped with its exact norm while the others get
    estimates).
    """

    def __init__(
        self,
        model: nn.Module,
        max_grad_norm: float,
        noise: GaussianNoise,
        accountant: PrivacyAccountant,
        exchange: Optional[LocalExchange] = None,
        data_parallel_group: Optional[dist.ProcessGroup] = None,
        config: Optional[StrategyConfig] = None,
        projection_key: Optional[SecretKey] = None,
    ):
        check_clippable_dtypes(model.named_parameters())  # before the capture changes the model
        config = config if config is not None else StrategyConfig()
        self.norm_estimate: Optional[RandomizedNorms] = None
        projected = config.projected_norms
        if projected is not None:
            if projection_key is None:
                raise ValueError(f"norms={config.norms!r} needs projection_key (the strategy's secret).")
            self.norm_estimate = RandomizedNorms(projected.estimator, projected.projection_dim)
        self.projection_key = projection_key
        self.capture = PerSampleGradCapture(model, exchange, config.per_sample, self.norm_estimate)
        self.exchange = self.capture.exchange
        if self.norm_estimate is not None:
            self.exchange.always_capture = True
        replica_shards = {name: shard for name, shard in self.exchange.shards.items() if shard.replicas > 1}
        self.accumulator = ClippedGradientSum(self.capture.parameters, data_parallel_group, replica_shards)
        self.max_grad_norm = max_grad_norm
        self.noise = noise
        self.accountant = accountant
        self.last_per_sample_norms: Optional[torch.Tensor] = None
        self.last_held_bytes = 0
        self.last_bookkept_bytes = 0
        self.padding = False  # the current micro-batch is padding: its contribution is exactly zero
        self.observer = DPStepObserver()
        self.per_layer: Optional[PerLayerClipper] = None
        self.fused_weights: list[str] = []
        if config.per_layer is not None:
            bounds = per_layer_thresholds(self.capture.parameters, max_grad_norm, config.per_layer.thresholds)
            self.per_layer = PerLayerClipper(bounds, self.accumulator, self.exchange)
            self.exchange.deliver_each_parameter(self._clip_layers, self.capture.uses)
            context_parallel = type(self.exchange) is not LocalExchange or bool(self.exchange.shards)
            if use_fused_kernel(config.per_layer.kernel, self.device, context_parallel):
                self.fused_weights = self.capture.fuse_linear_weights(self._clip_linear)

    @property
    def device(self) -> torch.device:
        """Where the model's trainable parameters (and so the per-sample work) live."""
        return next(iter(self.capture.parameters.values())).device

    def observe(self, observer: DPStepObserver) -> None:
        """Announce this engine's step events to ``observer`` (replacing the previous one)."""
        self.observer = observer
        self.exchange.observer = observer

    def begin_logical_batch(self) -> None:
        """Drop the previous step's gradients: until `release`, ``.grad`` only ever holds one micro-batch's."""
        self.capture.check_trainable_unchanged()
        for param in self.capture.parameters.values():
            param.grad = None
        if self.norm_estimate is not None:
            assert self.projection_key is not None
            self.norm_estimate.start_step(self.projection_key, self.accountant.steps)

    def prepare_microbatch(self, batch_size: int, padding: bool = False) -> None:
        """Before a micro-batch's forward: the exchange decides whether its backward needs per-sample capture.

        ``padding``: a zero-weight micro-batch, run only so that this rank issues the collectives of one more
        micro-batch (FSDP2 over every rank while its data-parallel group drew fewer samples than another). Its
        backward takes the same path as a real one (every collective, in the same order), but its contribution to
        the clipped sum is exactly zero: its clip factors are 0 (flat clipping; the sums drop inf and NaN at factor
        0) or its per-sample gradients are zeroed before clipping (per-layer), and ``last_per_sample_norms`` keeps
        the last real micro-batch's norms.
        """
        self.padding = padding
        self.observer.microbatch_started()
        self.capture.start_microbatch(batch_size)
        if self.per_layer is not None:
            self.per_layer.start_microbatch(batch_size, self.device)

    def accumulate_microbatch(self, batch_size: int) -> None:
        """Clip the per-sample gradients of the last backward and add them to the logical batch's sum."""
        if self.per_layer is not None:
            self._accumulate_per_layer()
            return
        bookkeeper = self.capture.bookkeeper if self.capture.enabled else None
        grad_samples = self.capture.collect()
        self.observer.microbatch_gradients(grad_samples.values())
        self.last_held_bytes = sum(g.numel() * g.element_size() for g in grad_samples.values())
        device = self.device
        if grad_samples:
            local_norms = per_sample_squared_norms(grad_samples.values(), batch_size)
        else:  # every trainable weight was book-kept
            local_norms = torch.zeros(batch_size, dtype=torch.float64, device=device)
        squared_norms = self.exchange.complete_squared_norms(local_norms)
        rounding = None
        if bookkeeper is not None:
            self.last_bookkept_bytes = bookkeeper.held_bytes()
            bookkept = bookkeeper.squared_norms(batch_size, device)
            squared_norms, rounding = squared_norms + bookkept.squared, bookkept.rounding
        # fp64: book-kept sums scale in fp64; the materialised path rounds them to fp32 toward zero.
        factors = clip_factors(squared_norms, self.max_grad_norm, rounding=rounding, dtype=torch.float64)
        if self.padding:
            factors = torch.zeros_like(factors)
        self.accumulator.add(self.exchange.local_part(grad_samples), factors)
        if bookkeeper is not None:
            self.accumulator.add_sums(bookkeeper.clipped_sums(factors))
        self.observer.clipped_sums(self.accumulator.sums.values())
        if not self.padding:
            self.last_per_sample_norms = squared_norms.sqrt()

    def _accumulate_per_layer(self) -> None:
        """Per-layer clipping: the captured layers were clipped during backward; a one-sample micro-batch's ``.grad``
        (nothing captured) is clipped here, layer by layer."""
        grad_samples = self.capture.collect()
        if grad_samples:
            self.last_held_bytes = sum(g.numel() * g.element_size() for g in grad_samples.values())
            self._clip_layers(grad_samples, in_backward=False)
        else:
            self.last_held_bytes = self.exchange.peak_held_bytes
        assert self.per_layer is not None
        if not self.padding:
            self.last_per_sample_norms = self.per_layer.squared_norms.sqrt()

    def _clip_layers(self, grad_samples: dict[str, torch.Tensor], in_backward: bool = True) -> None:
        assert self.per_layer is not None
        self.observer.microbatch_gradients(grad_samples.values())
        if self.padding:  # norms 0, factors 1: adds exactly zero, through every collective of a real micro-batch
            for grad in grad_samples.values():
                grad.zero_()
        self.per_layer.clip(grad_samples, in_backward)
        self.observer.clipped_sums(self.accumulator.sums.values())

    def _clip_linear(self, name: str, activation: torch.Tensor, grad_output: torch.Tensor) -> None:
        assert self.per_layer is not None
        self.per_layer.clip_linear(name, activation, torch.zeros_like(grad_output) if self.padding else grad_output)

    def per_sample_methods(self) -> dict[str, str]:
        """How each trainable parameter got its per-sample norm in the last captured micro-batch: ``"ghost"`` (Gram
        matrices or token ids, book-kept clipped sum) or ``"materialize"`` (a per-sample gradient)."""
        chosen = self.capture.bookkeeper.choices if self.capture.bookkeeper is not None else {}
        return {name: chosen.get(name, "materialize") for name in self.capture.parameters}

    def uncaptured(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The tensors of ``optimizer`` that the capture does not know (not among the module's trainable parameters
        at the step's start): whatever gradient they hold is raw, neither clipped nor noised."""
        captured = {id(param) for param in self.capture.parameters.values()}
        return [tensor for group in optimizer.param_groups for tensor in group["params"] if id(tensor) not in captured]

    def release(self, noise_multiplier: float, sample_rate: float, expected_batch_size: float) -> None:
        """Write the private gradient of the logical batch to ``param.grad`` and account for the step."""
        self.noise.start_step(self.accountant.steps)
        self.accumulator.release(self.noise, noise_multiplier * self.max_grad_norm, expected_batch_size)
        self.accountant.step(noise_multiplier, sample_rate)

    def remove(self) -> None:
        self.capture.remove()
