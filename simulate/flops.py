"""FLOPs of one microbatch on one rank, by kind of kernel.

* Linear layers: forward ``2 p d`` per token and layer, backward ``2 p d`` for the input gradient and ``2 p d``
  for the weight gradient. A per-sample gradient ``einsum(BTp,BTd->Bpd)`` costs what the weight gradient costs
  and replaces it (LongShield), so grad-sample DP adds no matmul FLOPs.
* Attention (flash, causal): forward ``2 T d`` per token and layer (``QK^T`` and ``PV``, halved by the mask),
  backward 2.5x forward (five GEMMs against two). Context parallelism splits it evenly (load-balanced chunks).
* Activation checkpointing recomputes each block's forward once more.
* ZeRO-DP+ (book-keeping): the weight gradient becomes the clipped-sum einsum over book-kept tensors (same cost);
  ghost layers add the two Gram matrices ``2 B T^2 (p + d)``. In the paper's prototype (``retained_norm_pass``,
  Bu et al.'s rule ``2 T^2 < p d``) grad-sample layers add their per-sample einsum (formed for the norm, then
  book-kept); in LongShield's (rule ``T (p + d) < p d``; every layer under ``norms="ghost"``) their per-sample
  gradient replaces the weight gradient.
  The embedding is a lookup and is left out.
* Fused per-layer clipping (`RunConfig.fused_linear_weights`): a linear weight's per-sample gradient is formed twice,
  tile by tile in registers (once for the norm, once for the clipped sum, as in FlashDP), so its ``2 p d`` per token
  moves out of the matmuls into ``fused_clip``'s ``4 p d``.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulate.config import RunConfig
from simulate.memory import book_keeps, uses_ghost_norm

ATTENTION_BACKWARD_RATIO = 2.5


@dataclass(frozen=True)
class Flops:
    """FLOPs per rank per microbatch."""

    matmul: float  # linear layers, forward + backward (+ recompute, + grad-sample einsums)
    attention: float  # flash attention, forward + backward (+ recompute)
    ghost_norm: float  # Gram matrices of ghost-norm layers (ZeRO-DP+)
    fused_clip: float = 0.0  # the fused per-layer clipping kernels' two passes over the linear weights' gradients

    @property
    def total(self) -> float:
        return self.matmul + self.attention + self.ghost_norm + self.fused_clip


def linear_params(cfg: RunConfig) -> int:
    """Weights that go through a matmul: every block projection and the output head."""
    m = cfg.model
    return m.n_layers * sum(lin.numel for lin in m.block_linears()) + m.embedding_numel


def attention_forward_flops(cfg: RunConfig) -> float:
    """Causal flash-attention forward FLOPs on one rank: ``2 T^2 d`` per sample and layer, split over CP."""
    m = cfg.model
    return cfg.micro_batch_size * 2 * cfg.seq_len**2 * m.dim * m.n_layers / cfg.cp_size


def microbatch_flops(cfg: RunConfig) -> Flops:
    """FLOPs of one microbatch (forward, backward, recompute, DP extras) on one rank."""
    t = cfg.tokens_per_rank
    lin_forward = 2 * linear_params(cfg) * t
    attn_forward = attention_forward_flops(cfg)
    matmul = 3 * lin_forward
    attention = (1 + ATTENTION_BACKWARD_RATIO) * attn_forward
    if cfg.method.activation_checkpointing:
        matmul += lin_forward - 2 * cfg.model.embedding_numel * t  # the head is not checkpointed
        attention += attn_forward
    if cfg.loss_chunk is not None:  # the chunked loss runs the head's forward again in backward
        matmul += 2 * cfg.model.embedding_numel * t
    ghost = 0.0
    if cfg.method.per_sample_grads == "ghost":
        prototype = cfg.method.retained_norm_pass
        for numel, fan_sum in _ghost_layers(cfg):
            if uses_ghost_norm(cfg.seq_len, numel) if prototype else book_keeps(cfg, fan_sum, numel):
                ghost += 2 * cfg.micro_batch_size * cfg.seq_len**2 * fan_sum
            elif prototype:
                matmul += 2 * numel * t
    fused = 0.0
    if cfg.fused_linear_weights:
        weight_gradients = 2 * cfg.trainable.linear_weights * t
        matmul -= weight_gradients
        fused = 2 * weight_gradients
    return Flops(matmul=matmul, attention=attention, ghost_norm=ghost, fused_clip=fused)


def book_keeping_materialized_numel(cfg: RunConfig) -> int:
    """Elements of one sample's gradient that LongShield's ZeRO-DP+ materialises (its rule ``T (p + d) >= p d``:
    the layers whose per-sample gradient is cheaper than their Gram matrices); 0 for other methods."""
    if cfg.method.per_sample_grads != "ghost" or cfg.method.retained_norm_pass:
        return 0
    return sum(numel for numel, fan_sum in _ghost_layers(cfg) if not book_keeps(cfg, fan_sum, numel))


def _ghost_layers(cfg: RunConfig) -> list[tuple[int, int]]:
    """(p d, p + d) of every linear layer ZeRO-DP+ takes a per-sample norm of."""
    m = cfg.model
    out = [(lin.numel, lin.in_features + lin.out_features) for lin in m.block_linears()] * m.n_layers
    out.extend((lin.numel, lin.in_features + lin.out_features) for lin in m.head_linears())
    return out
