"""Time of one microbatch per rank and tokens/s/GPU.

``time = compute + DP memory-bound passes + exposed communication`` where

* compute (:mod:`simulate.flops`): matmul and ghost-norm Gram FLOPs at ``MFU_MATMUL``, attention FLOPs at
  ``MFU_ATTENTION``, and the ghost norm's final reduction as ``GHOST_REDUCTION_TIME_RATIO`` times its Gram time;
* DP memory-bound passes (LongShield): per-sample norms, clipping and the fp32 accumulate read the kept
  per-sample gradients (under ZeRO-DP+, those of the layers it materialises) and the accumulator once more at HBM
  bandwidth (per-layer clipping above micro-batch 1 also
  zeroes inf and NaN in them, a read and a write, instead of a host sync per layer); linear weights that go through
  the fused per-layer kernels keep no per-sample gradient, and their two passes are compute (``Flops.fused_clip``) at
  ``FUSED_CLIP_MFU`` of the bf16 peak, or of the CUDA cores' fp32 peak for fp32 inputs;
* communication (:mod:`simulate.comm`): FSDP all-gathers over the GPUs that share the model states
  (`RunConfig.shard_size`), and FSDP's fp32 gradient reduce-scatter every micro-batch (without DP, and for
  LongShield's one-sample micro-batches, whose sample's gradient is FSDP's reduced ``.grad``), are prefetched and
  hidden behind compute except for any excess; the paper's ZeRO-DP+ reduce-scatter of the clipped sum can only hide
  behind the book-keeping einsums; the CP K/V all-gather (forward, recompute) and dK/dV reduce-scatter (backward) sit
  on the attention's critical path; V1's per-sample all-reduce is exposed, V2/V3's reduce-scatter of block ``i``
  hides behind block ``i-1``'s backward.

Steady state per microbatch: what happens once per logical batch is amortised over gradient accumulation and left
out of tokens/s: the optimizer step, and LongShield's reduction of each data-parallel group's fp32 clipped sum over
the groups (an all-reduce, a reduce-scatter with ``shard_over="all"``), reported apart as `StepTime.step_end`.
All constants: :mod:`simulate.calibration`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from simulate import calibration, comm
from simulate.config import RunConfig
from simulate.flops import Flops, book_keeping_materialized_numel, linear_params, microbatch_flops

FP32 = 4


@dataclass(frozen=True)
class StepTime:
    """Seconds per microbatch on one rank, by part."""

    compute: float
    dp_memory_bound: float
    exposed_fsdp: float
    exposed_cp_attention: float
    exposed_per_sample_grads: float
    tokens_per_rank: float
    flops: Flops
    peak_flops: float
    #: Seconds once per optimizer step, not per microbatch: the clipped sum reduced over data-parallel groups.
    step_end: float = 0.0

    @property
    def total(self) -> float:
        return (self.compute + self.dp_memory_bound + self.exposed_fsdp + self.exposed_cp_attention
                + self.exposed_per_sample_grads)

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.tokens_per_rank / self.total

    @property
    def mfu(self) -> float:
        """Achieved useful-FLOP utilisation (every counted FLOP, DP work included)."""
        return self.flops.total / self.total / self.peak_flops


def estimate_step_time(cfg: RunConfig) -> StepTime | None:
    """Per-microbatch time of ``cfg`` on one rank; ``None`` for an infinite GPU count (no finite answer)."""
    if math.isinf(cfg.num_gpus):
        return None
    peak = peak_flops(cfg)
    f = microbatch_flops(cfg)
    mm_rate, attn_rate = peak * calibration.MFU_MATMUL, peak * calibration.MFU_ATTENTION
    fused_peak = cfg.gpu.fp32_flops if cfg.precision.tensor_core_tf32 else cfg.gpu.bf16_flops
    compute = (f.matmul / mm_rate + f.attention / attn_rate
               + f.ghost_norm / mm_rate * (1 + calibration.GHOST_REDUCTION_TIME_RATIO)
               + f.fused_clip / (fused_peak * calibration.FUSED_CLIP_MFU))
    return StepTime(
        compute=compute,
        dp_memory_bound=_dp_memory_bound(cfg),
        exposed_fsdp=_exposed_fsdp(cfg, compute),
        exposed_cp_attention=_cp_attention_comm(cfg),
        exposed_per_sample_grads=_exposed_per_sample_grads(cfg, compute),
        tokens_per_rank=cfg.tokens_per_rank,
        flops=f,
        peak_flops=peak,
        step_end=_step_end_reduction(cfg),
    )


def peak_flops(cfg: RunConfig) -> float:
    """Dense tensor-core peak for the run's matmul precision."""
    return cfg.gpu.tf32_flops if cfg.precision.tensor_core_tf32 else cfg.gpu.bf16_flops


def _dp_memory_bound(cfg: RunConfig) -> float:
    """LongShield's norm and clip-accumulate passes over the kept per-sample gradients (HBM-bound)."""
    kind = cfg.method.per_sample_grads
    a = cfg.precision.activation_bytes
    materialized = book_keeping_materialized_numel(cfg)
    if materialized:  # ZeRO-DP+'s materialised layers: the same passes over their per-sample gradients
        return (2 * cfg.micro_batch_size * materialized * a + 3 * materialized * FP32) / cfg.gpu.hbm_bytes_per_s
    if kind not in ("full", "sharded"):
        return 0.0
    params = cfg.model.num_parameters
    kept = params / cfg.cp_size if kind == "sharded" else params
    accumulator = kept  # each data-parallel group accumulates what its ranks keep
    per_sample = kept - (cfg.trainable.linear_weights if cfg.fused_linear_weights else 0)
    passes = 2 * cfg.micro_batch_size * per_sample * a + 3 * accumulator * FP32  # norm, clip reads; acc r/w + temp
    if cfg.clipping == "per_layer" and cfg.micro_batch_size > 1:
        passes += 2 * cfg.micro_batch_size * per_sample * a  # inf and NaN zeroed in place: no host sync in backward
    return passes / cfg.gpu.hbm_bytes_per_s


def _exposed_fsdp(cfg: RunConfig, compute: float) -> float:
    """FSDP parameter all-gathers (and gradient reduce-scatter) not hidden behind compute."""
    g = cfg.shard_size
    if g <= 1:
        return 0.0
    m, a = cfg.model, cfg.precision.activation_bytes
    link = comm.link_for(cfg.gpu, g)
    blocks = m.n_layers * m.block_numel
    gathers = 2 * blocks * a + m.root_numel * a  # blocks re-gathered for backward, root kept
    gather_time = comm.all_gather(gathers, g, link)
    reduce_time = comm.reduce_scatter(m.num_parameters * cfg.precision.reduce_bytes, g, link)
    if not cfg.method.private or cfg.sample_gradient_is_fsdps:
        return max(0.0, gather_time + reduce_time - compute)
    if cfg.method.retained_norm_pass:  # the clipped sum exists only after the norms: hidden behind BK einsums only
        bk_einsums = 2 * linear_params(cfg) * cfg.tokens_per_rank / (peak_flops(cfg) * calibration.MFU_MATMUL)
        return max(0.0, gather_time - compute) + max(0.0, reduce_time - bk_einsums)
    return max(0.0, gather_time - compute)  # LongShield accumulates locally; no per-microbatch reduce-scatter


def _step_end_reduction(cfg: RunConfig) -> float:
    """LongShield's reduction of the fp32 clipped sums over the data-parallel groups, once per optimizer step: each
    rank's accumulator (its CP shard; the whole model under its ZeRO-DP+) all-reduced, or reduce-scattered where model
    states are sharded over all GPUs (`ClippedGradientSum.release`). The paper's prototypes reduce per microbatch."""
    groups = cfg.data_parallel_size
    if not cfg.method.private or groups <= 1 or cfg.method.retained_norm_pass:
        return 0.0
    accumulator = cfg.trainable.total * FP32 / (1 if cfg.method.whole_clipped_sum else cfg.cp_size)
    link = comm.link_for(cfg.gpu, cfg.num_gpus)
    if cfg.shard_over == "all":
        return comm.reduce_scatter(accumulator, groups, link)
    return comm.all_reduce(accumulator, groups, link)


def _cp_attention_comm(cfg: RunConfig) -> float:
    """All-gather of expanded K/V per layer (again under recompute) and reduce-scatter of dK/dV, not hidden."""
    n = cfg.cp_size
    if n <= 1:
        return 0.0
    m, a = cfg.model, cfg.precision.activation_bytes
    link = comm.link_for(cfg.gpu, n, efficiency=calibration.CP_KV_EXCHANGE_EFFICIENCY)
    gathered = 2 * m.dim * a * cfg.tokens_per_rank * n  # K and V, all heads, whole sequence
    gathers = 2 if cfg.method.activation_checkpointing else 1
    per_layer = gathers * comm.all_gather(gathered, n, link) + comm.reduce_scatter(gathered, n, link)
    return m.n_layers * per_layer


def _exposed_per_sample_grads(cfg: RunConfig, compute: float) -> float:
    """V1: all-reduce of every layer's per-sample gradients, exposed. V2/V3: reduce-scatter of block ``i``
    hidden behind the backward of block ``i-1`` (the head's behind the last block); the embedding's (or the tied
    head's, which the embedding completes) comes last and is exposed."""
    kind, n = cfg.method.per_sample_grads, cfg.cp_size
    if kind not in ("full", "sharded") or n <= 1 or cfg.sample_gradient_is_fsdps:
        return 0.0
    m = cfg.model
    unit = cfg.micro_batch_size * cfg.precision.activation_bytes
    link = comm.link_for(cfg.gpu, n)
    block, vd = unit * m.block_numel, unit * m.embedding_numel
    untied_head = 0.0 if m.tie_embeddings else vd
    if kind == "full":
        return m.n_layers * comm.all_reduce(block, n, link) + comm.all_reduce(vd + untied_head, n, link)
    if not cfg.method.overlap_grad_comm:
        return m.n_layers * comm.reduce_scatter(block, n, link) + comm.reduce_scatter(vd + untied_head, n, link)
    block_backward = compute * 2 / 3 / m.n_layers  # backward share of compute, per block
    overhang = (m.n_layers * max(0.0, comm.reduce_scatter(block, n, link) - block_backward)
                + max(0.0, comm.reduce_scatter(untied_head, n, link) - block_backward))
    return overhang + comm.reduce_scatter(vd, n, link)
