"""Per-layer clipping: each trainable parameter tensor (a layer, as in Opacus) has its own bound ``C_l``.

The bounds satisfy ``sum_l C_l^2 <= C^2``, so a sample's clipped contribution over all layers still has norm at most
``C``: the noise ``N(0, (sigma C)^2)`` and the accounting are those of flat clipping. A layer's per-sample gradients
are clipped and added to the clipped sum as soon as they are complete, during backward, then freed, so at most about
one layer's (or one reduce-scatter bucket's) per-sample gradients are held at a time. With ``kernel="auto"`` or
``"triton"``, on CUDA at context-parallel size 1, a linear layer's weight skips even that: a fused Triton kernel
(`fused_linear_clip`) computes its per-sample norms and its clipped sum from the layer's inputs and output gradients
without a per-sample gradient in memory. It forms every weight gradient twice, in tiles: on an H100 (1B, T 4096,
micro-batch 2) a step took 1.50x non-DP's to save one layer's per-sample gradients, so it is opt-in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from lightning_longshield.privacy.accumulator import ClippedGradientSum
from lightning_longshield.privacy.clipping import CLIP_MARGIN, clip_factor, clip_factors, per_parameter_squared_norms
from lightning_longshield.privacy.grad_sample.exchange import LocalExchange
from lightning_longshield.privacy.triton_support import triton_runs_on
from simulate.strategy_config import PerLayerClipping, ThresholdSpec

if TYPE_CHECKING:  # the kernels' module imports Triton
    from lightning_longshield.privacy.fused_linear_clip import FusedTiles

# Explicit bounds may exceed C^2 in the sum of squares by this relative amount (decimal rounding of user values);
# the clipping margin (2^-18) of every layer keeps the clipped contribution below C regardless.
SUM_OF_SQUARES_TOLERANCE = 1e-9


def per_layer_thresholds(
    parameters: Mapping[str, nn.Parameter], max_grad_norm: float, spec: ThresholdSpec = "equal"
) -> dict[str, float]:
    """The bound ``C_l`` of every trainable parameter (tied weights appear once, under their first name).

    ``"equal"`` splits ``C`` evenly, ``C / sqrt(L)``; ``"proportional"`` by parameter counts, ``C sqrt(n_l / sum n)``
    (full counts, also for sharded parameters); both give ``sum_l C_l^2 = C^2``. A mapping must name every
    trainable parameter and no other, with ``sum_l C_l^2 <= C^2``.
    """
    PerLayerClipping(thresholds=spec)  # validates the rule or the mapping
    if not parameters:
        raise ValueError("Per-layer clipping needs at least one trainable parameter.")
    if spec == "equal":
        return {name: max_grad_norm / math.sqrt(len(parameters)) for name in parameters}
    if spec == "proportional":
        total = sum(p.numel() for p in parameters.values())
        return {name: max_grad_norm * math.sqrt(p.numel() / total) for name, p in parameters.items()}
    assert isinstance(spec, Mapping)
    missing = [name for name in parameters if name not in spec]
    unknown = [name for name in spec if name not in parameters]
    if missing or unknown:
        raise ValueError(
            "PerLayerClipping(thresholds=...) must give a threshold for every trainable parameter, by its name in"
            f" named_parameters() (a tied weight once, under its first name). Missing: {missing}; not trainable"
            f" parameters: {unknown}."
        )
    squares = sum(float(spec[name]) ** 2 for name in parameters)
    if squares > max_grad_norm**2 * (1 + SUM_OF_SQUARES_TOLERANCE):
        raise ValueError(
            f"The per-layer thresholds have sum of squares {squares:.6g} > max_grad_norm^2 = {max_grad_norm**2:.6g}:"
            " a sample's clipped gradient could exceed max_grad_norm, which the noise is calibrated to. Scale the"
            " thresholds down or raise max_grad_norm."
        )
    return {name: float(spec[name]) for name in parameters}


def use_fused_kernel(kernel: str, device: torch.device, context_parallel: bool) -> bool:
    """Whether per-layer clipping takes linear weights through the fused kernel; ``"triton"`` where it cannot
    run is an error that names the fix."""
    if kernel == "torch":
        return False
    runs = triton_runs_on(device) and not context_parallel
    if kernel == "triton" and not runs:
        why = ("it needs context-parallel size 1 (and no sharding over data-parallel replicas): a shard's tokens give"
               " partial per-sample gradients" if context_parallel else "it needs CUDA and Triton")
        raise ValueError(f"PerLayerClipping(kernel='triton') cannot run here: {why}. Use kernel='auto' (fused where it"
                         " can run) or 'torch'.")
    return runs


class PerLayerClipper:
    """Clips complete per-sample gradients, a group of parameters at a time, each to its own bound, and adds this
    rank's part of them to the clipped sum.

    The squared norms of a group ``(P, B)`` are completed by the exchange in one collective (summed over the
    context-parallel group where the gradients are shards). ``squared_norms`` accumulates each sample's unclipped
    squared norm over the micro-batch's layers (`start_microbatch` resets it).
    """

    def __init__(self, thresholds: dict[str, float], accumulator: ClippedGradientSum, exchange: LocalExchange):
        self.thresholds = thresholds
        self.accumulator = accumulator
        self.exchange = exchange
        self._squared_norms = torch.zeros(0, dtype=torch.float64)
        self._host_squared_norms: list[float] = []  # the part summed on the host (CPU tensors)
        self._threshold_columns: dict[tuple[str, ...], torch.Tensor] = {}  # on the gradients' device, per group

    def start_microbatch(self, batch_size: int, device: torch.device) -> None:
        self._squared_norms = torch.zeros(batch_size, dtype=torch.float64, device=device)
        self._host_squared_norms = [0.0] * batch_size

    @property
    def squared_norms(self) -> torch.Tensor:
        """Each sample's unclipped squared norm (fp64, ``(B,)``) over the layers clipped so far in this micro-batch."""
        if self._squared_norms.device.type == "cpu":  # `clip` sums them on the host there
            return self._squared_norms + torch.tensor(self._host_squared_norms, dtype=torch.float64)
        return self._squared_norms  # no host-to-device copy (a sync) per micro-batch

    @torch.no_grad()
    def clip(self, grad_samples: dict[str, torch.Tensor], in_backward: bool = True) -> None:
        """Clip and add the complete per-sample gradients ``(B, *shape)`` of some parameters; they are consumed.

        On CPU the factors (and the running norms) are computed on the host from the ``P x B`` squared norms, bit
        for bit as `clip_factors` computes them: once per parameter and micro-batch, a dozen tensor ops on a few
        values cost more than the arithmetic. Elsewhere they are tensor ops, with the group's bounds kept on the
        device, and ``in_backward`` the sums read nothing on the host (`ClippedGradientSum.add`'s ``sync_free``):
        after backward (a one-sample micro-batch's ``.grad``, all layers at once) one check is cheaper than zeroing
        inf and NaN in every gradient.
        """
        names = list(grad_samples)
        local = per_parameter_squared_norms(grad_samples.values(), len(self._host_squared_norms))
        squared = self.exchange.complete_squared_norms(local)
        on_host = _factors_on_host(squared)
        dropped: Optional[bool] = None  # whether some factor is 0, where known on the host
        if on_host:
            for row in squared.tolist():
                self._host_squared_norms = [total + value for total, value in zip(self._host_squared_norms, row)]
            host_factors = [[clip_factor(norm, self.thresholds[name]) for norm in row]
                            for name, row in zip(names, squared.sqrt().tolist())]
            dropped = any(factor == 0.0 for row in host_factors for factor in row)
            factors = torch.tensor(host_factors, dtype=torch.float32)
        else:
            self._squared_norms += squared.view(-1) if len(names) == 1 else squared.sum(0)  # one layer: no launch
            factors = clip_factors(squared, self._threshold_column(names, squared))
        parts = self.exchange.local_part(grad_samples)
        # One batched add, a row per layer.
        self.accumulator.add({name: parts[name] for name in names}, factors, sync_free=in_backward and not on_host,
                             dropped=dropped)
        del parts

    def _threshold_column(self, names: list[str], squared: torch.Tensor) -> torch.Tensor:
        """The ``(P, 1)`` bounds of ``names`` on ``squared``'s device, made once per group and device: a fresh
        host-to-device copy at every layer and micro-batch would stall backward on a GPU (a host sync each)."""
        kept = type(squared) is torch.Tensor  # not the fake tensors of a traced step
        column = self._threshold_columns.get(tuple(names)) if kept else None
        if column is None or column.device != squared.device:
            column = squared.new_tensor([self.thresholds[name] for name in names]).unsqueeze(1)
            if kept:
                self._threshold_columns[tuple(names)] = column
        return column

    @torch.no_grad()
    def clip_linear(
        self, name: str, activation: torch.Tensor, grad_output: torch.Tensor, tiles: Optional[FusedTiles] = None
    ) -> None:
        """Clip and add a linear weight's per-sample gradients ``G_i^T A_i`` with the fused kernels (context-parallel
        size 1: the inputs hold every token), never forming them; both kernels with ``tiles`` (default: the
        kernels')."""
        from lightning_longshield.privacy.fused_linear_clip import (
            DEFAULT_TILES,
            add_clipped_linear_sum,
            linear_squared_norms,
        )

        margin = fused_kernel_margin(activation.numel() // (activation.shape[0] * activation.shape[-1]))
        tiles = tiles or DEFAULT_TILES
        squared = linear_squared_norms(activation, grad_output, tiles)
        self._squared_norms += squared
        factors = clip_factors(squared, self.thresholds[name], margin)
        shape = (grad_output.shape[-1], activation.shape[-1])
        add_clipped_linear_sum(self.accumulator.running_sum(name, shape, grad_output.device), activation, grad_output,
                               factors, tiles)


#: Tokens a sample from which the fused kernels' margin would take a quarter or more off the clipping bound.
FUSED_KERNEL_TOKEN_LIMIT = 2**21


def fused_kernel_margin(tokens: int) -> float:
    """The clipping margin of the fused kernels at ``tokens`` tokens a sample: the norm and the sum are two fp32
    reductions over the tokens, each off by at most ``tokens x 2^-24`` relative, so ``2 tokens 2^-24`` (at least
    `CLIP_MARGIN`). It grows with the sequence (1.6% at 2^17 tokens, 12.5% at 2^20, all of the bound at 2^23): from
    `FUSED_KERNEL_TOKEN_LIMIT` on, where it would take a quarter or more off every clipped gradient, the sequence is
    refused with the fix instead of trained on silently."""
    margin = max(CLIP_MARGIN, 2 * tokens * 2.0**-24)
    if tokens >= FUSED_KERNEL_TOKEN_LIMIT:
        raise ValueError(
            f"PerLayerClipping(kernel='triton') clips within a margin of 2 x tokens x 2^-24 of the bound, {margin:.0%}"
            f" at this sequence length (from {FUSED_KERNEL_TOKEN_LIMIT} tokens a sample on): use"
            " PerLayerClipping(kernel='torch'), whose margin does not grow with the sequence."
        )
    return margin


def _factors_on_host(squared: torch.Tensor) -> bool:
    """Whether a group's clip factors are computed on the host: for CPU tensors; not for a GPU's (no sync in
    backward) nor for the fake tensors of a traced step."""
    return type(squared) is torch.Tensor and squared.device.type == "cpu"
