"""Per-rank peak memory of one training step, by method, with a breakdown.

The step is walked phase by phase (loss forward, loss backward, output projection backward, each block's
backward from the top, the embedding at the end of backward, ZeRO-DP+'s book-keeping) and the memory alive in
each phase is summed by category; the peak is the largest phase. What is alive where:

* model states: fp32 master parameters and AdamW's two fp32 moments (FSDP2-sharded over all GPUs), fp32
  gradients (non-DP, ZeRO-DP+; sharded over all GPUs) or LongShield's fp32 clipped-sum accumulator (per
  data-parallel group: 1/N of the model, or all of it in the paper's V1 prototype, ``whole_clipped_sum``);
* FSDP buffers: the root group (embedding, final norm, output) stays unsharded from forward through backward,
  two blocks are unsharded at a time (current + prefetched), and non-DP backward holds the current block's
  unsharded gradient (compute dtype + fp32 reduce-scatter copy) and the head's unsharded gradient;
* activations: :mod:`simulate.layers` tensor by tensor; under activation checkpointing only block inputs, plus
  one recomputed block during its backward; plus the backward working set of the block being differentiated;
* logits and the fp32 cross entropy (:mod:`simulate.layers`);
* per-sample gradients ``(MBS, *param.shape)``, in the compute dtype, growing layer by layer during backward:
  full on every CP rank under V1, ``1/N`` under V2/V3 plus the in-flight unreduced partials. With one sample per
  micro-batch, V2/V3 keep no per-sample buffer: the sample's gradient is FSDP's fp32 gradient shard, reduce-scattered
  from the unsharded gradients of the block being differentiated, as without DP. (V1 is the paper's: full per-sample
  gradients on every CP rank at any micro-batch size; LongShield's strategy takes the V2 path at micro-batch 1.)
* ZeRO-DP+ as the paper ran it (Opacus FSDP ghost clipping, ``retained_norm_pass``): its norm pass retains the
  autograd graph (``retain_graph=True``), so no activation is freed; book-keeping keeps every linear layer's output
  gradient until the clipping factors are known, then forms one layer's clipped sum at a time; the norm of the
  layer being differentiated needs either its per-sample gradient (grad sample) or the two ``(MBS, T, T)`` Gram
  matrices (ghost norm, when ``2 T^2 < p d``);
* ZeRO-DP+ as LongShield runs it (one backward): each weight keeps, until the clipping factors are known, either
  its book-kept output gradient and input (``(G, A)``, when ``T (p + d) < p d``; an input shared by several
  projections once) or its per-sample gradient; a tied weight follows its output head; the clip forms one
  book-kept layer's fp32 clipped sum at a time. The accumulator is the whole model (CP 1);
* communication: the gathered dK/dV being reduce-scattered over CP (the gathered K/V themselves are saved
  activations);
* context-parallel methods at CP size 1 take the same path on a one-rank group (no FSDP2 on one rank, as the
  strategy runs them): the formulas above with ``N = 1``.

Reserved memory (what TorchTitan reports) adds allocator fragmentation; the fit check adds the CUDA context and
NCCL buffers, which live outside the allocator. Constants: :mod:`simulate.calibration`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

from simulate import calibration, layers
from simulate.config import RunConfig

GIB = 2**30
FP32 = 4
FP64 = 8
# Elements of one fp64 block of the book-keeper's norms and clipped sums: the library's blocks are this size
# (`lightning_longshield.privacy.grad_sample.bookkeeping.BLOCK_ELEMENTS`).
BOOKKEEPING_BLOCK = 2**22

CATEGORIES = ("model_states", "fsdp_buffers", "activations", "logits_loss", "per_sample_grads", "ghost_norm",
              "communication")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-rank memory in bytes at the peak phase of a step."""

    phase: str
    model_states: float
    fsdp_buffers: float
    activations: float
    logits_loss: float
    per_sample_grads: float
    ghost_norm: float
    communication: float
    fragmentation: float
    runtime: float
    capacity: float

    @property
    def allocated(self) -> float:
        """Peak memory handed out by the caching allocator."""
        return sum(getattr(self, name) for name in CATEGORIES)

    @property
    def reserved(self) -> float:
        """Peak reserved memory: what TorchTitan (and the paper's tables) report."""
        return self.allocated + self.fragmentation

    @property
    def device_total(self) -> float:
        """Reserved memory plus what lives outside the allocator; must not exceed the GPU's capacity."""
        return self.reserved + self.runtime

    @property
    def fits(self) -> bool:
        return self.device_total <= self.capacity

    @property
    def peak_gib(self) -> float:
        return self.reserved / GIB

    def as_gib(self) -> dict[str, float]:
        """Every byte field in GiB, plus the derived totals (for tables and JSON)."""
        out = {f.name: getattr(self, f.name) / GIB for f in fields(self) if f.name != "phase"}
        out.update(allocated=self.allocated / GIB, reserved=self.reserved / GIB,
                   device_total=self.device_total / GIB)
        return out


def estimate_memory(cfg: RunConfig) -> MemoryBreakdown:
    """Walk one step of ``cfg`` and return the breakdown at its peak phase."""
    peak_name, peak = max(_phases(cfg), key=lambda item: sum(item[1].values()))
    allocated = sum(peak.values())
    return MemoryBreakdown(
        phase=peak_name,
        **{name: peak.get(name, 0.0) for name in CATEGORIES},
        fragmentation=allocated * calibration.ALLOCATOR_FRAGMENTATION,
        runtime=(calibration.CUDA_CONTEXT_GIB + calibration.NCCL_BUFFERS_GIB) * GIB,
        capacity=cfg.gpu.memory_bytes,
    )


def model_state_bytes(cfg: RunConfig) -> float:
    """fp32 master parameters, gradients (or the DP clipped-sum accumulator) and AdamW moments per rank (the last
    two of the trainable parameters only: under LoRA, of the adapters).

    Parameters, moments and FSDP gradients are sharded over the GPUs that share them (`RunConfig.shard_size`: every
    GPU, or one context-parallel group; at CP 1 with ``shard_over="context_parallel"``, whole on each GPU). LongShield's
    accumulator follows its
    per-sample gradients: each data-parallel group accumulates its own clipped sum (summed over groups once per
    logical batch), sharded over the CP group, or whole on every CP rank in the paper's V1 (``whole_clipped_sum``);
    LongShield's ZeRO-DP+ (CP 1) keeps the whole clipped sum on every rank and reduce-scatters it once per step.
    """
    shards = cfg.shard_size  # infinite (``--gpus inf``): what is sharded over every GPU vanishes, nothing else
    params, trainable, master = cfg.model.num_parameters, cfg.trainable.total, cfg.precision.master_bytes
    accumulator_shards = shards
    book_kept = cfg.method.per_sample_grads == "ghost" and not cfg.method.retained_norm_pass
    if cfg.method.per_sample_grads in ("full", "sharded") or book_kept:
        accumulator_shards = 1 if cfg.method.whole_clipped_sum else cfg.cp_size
    return (params * master + trainable * 2 * FP32) / shards + trainable * master / accumulator_shards


def _phases(cfg: RunConfig) -> list[tuple[str, dict[str, float]]]:
    """(name, bytes by category) for every phase of the step that can hold the peak."""
    m, a, n = cfg.model, cfg.precision.activation_bytes, cfg.cp_size
    t = cfg.tokens_per_rank
    method = cfg.method
    block_numel, root_numel, vd = m.block_numel, m.root_numel, m.embedding_numel
    grad_reduce = a + (cfg.precision.reduce_bytes if cfg.precision.reduce_bytes != a else 0)

    states = model_state_bytes(cfg)
    fsdp_params = a * (root_numel + 2 * block_numel)
    full_block = _sum_saved(layers.block_saved_tensors(m, a, method.context_parallel), t, n)
    kept_block = (_sum_saved(layers.checkpoint_saved_tensors(m, a), t, n)
                  if method.activation_checkpointing else full_block)
    head = _sum_saved(layers.head_saved_tensors(m, a), t, n)
    acts_all = m.n_layers * kept_block + head
    work_act, work_comm = _block_backward_working_set(cfg)

    if method.per_sample_grads == "ghost" and not method.retained_norm_pass:
        return _book_keeping_phases(cfg, states, fsdp_params, full_block, head, work_act, work_comm)
    psg = _PerSampleGrads(cfg)
    ghost = _GhostClipping(cfg)
    # Weight gradients autograd hands to FSDP during backward: without DP, and for V2/V3 at micro-batch 1 (the
    # sample's gradient). Otherwise LongShield's per-sample gradients are its only weight gradients; ZeRO-DP+'s norm
    # pass skips them (origin-parameter trick) and forms the clipped sum per layer afterwards.
    fsdp_grads = not method.private or psg.fsdp_gradient
    head_grad = a * cfg.trainable.embedding if fsdp_grads else 0.0
    block_grad = grad_reduce * cfg.trainable.block if fsdp_grads else 0.0

    phase = _phase_with(states, fsdp_params)
    out = [
        *_loss_phases(cfg, acts_all, phase),
        ("backward: output", phase(
            activations=acts_all + t * m.dim * a,
            logits_loss=cfg.loss_tokens_per_rank * layers.logits_grad_bytes_per_token(m, a),
            fsdp_buffers=head_grad,
            per_sample_grads=psg.head_kept() + psg.head_in_flight(),
            ghost_norm=ghost.head_transient(),
        )),
    ]
    # ZeRO-DP+ (Opacus FSDP ghost clipping) runs its norm pass with ``retain_graph=True``: nothing is freed.
    retained = method.per_sample_grads == "ghost"
    for i in reversed(range(m.n_layers)):
        done = m.n_layers - 1 - i  # blocks already differentiated
        out.append((f"backward: block {i}", phase(
            activations=(acts_all if retained else i * kept_block + full_block + head) + work_act,
            fsdp_buffers=head_grad + block_grad,
            per_sample_grads=psg.head_kept() + done * psg.block_kept() + psg.block_in_flight(),
            ghost_norm=ghost.head_kept() + done * ghost.block_kept() + ghost.block_transient(),
            communication=work_comm,
        )))
    out.append(("backward: embedding", phase(
        activations=acts_all if retained else 0.0,
        fsdp_buffers=head_grad + (0.0 if m.tie_embeddings or not fsdp_grads else a * cfg.trainable.embedding),
        per_sample_grads=psg.head_kept() + m.n_layers * psg.block_kept() + psg.embedding(),
        ghost_norm=ghost.head_kept() + m.n_layers * ghost.block_kept() + ghost.embedding_transient(),
    )))
    if retained:  # book-keeping: one layer's clipped sum at a time, unsharded, then its fp32 reduce-scatter copy
        out.append(("book-keeping: clipped sum", phase(
            activations=acts_all,
            fsdp_buffers=grad_reduce * max(vd, block_numel),
            ghost_norm=ghost.head_kept() + m.n_layers * ghost.block_kept(),
        )))
    return out


Phase = Callable[..., dict[str, float]]


def _phase_with(states: float, fsdp_params: float) -> Phase:
    """A phase's bytes by category from its own parts, plus the model states and unsharded FSDP parameters."""

    def phase(**parts: float) -> dict[str, float]:
        parts["model_states"] = states
        parts["fsdp_buffers"] = fsdp_params + parts.get("fsdp_buffers", 0.0)
        return parts

    return phase


def _loss_phases(cfg: RunConfig, activations: float, phase: Phase) -> list[tuple[str, dict[str, float]]]:
    """The loss's forward and backward, over all saved activations."""
    m, a, t = cfg.model, cfg.precision.activation_bytes, cfg.loss_tokens_per_rank
    return [
        ("forward: loss", phase(activations=activations, logits_loss=t * layers.loss_forward_bytes_per_token(m, a))),
        ("backward: loss", phase(activations=activations, logits_loss=t * layers.loss_backward_bytes_per_token(m, a))),
    ]


def _book_keeping_phases(cfg: RunConfig, states: float, fsdp_params: float, full_block: float, head: float,
                         work_act: float, work_comm: float) -> list[tuple[str, dict[str, float]]]:
    """LongShield's ZeRO-DP+ (CP 1, one backward): activations are freed as usual except the kept inputs ``A``;
    per-sample gradients (materialised weights) and book-kept ``(G, A)`` grow block by block until the clip."""
    m, a, t = cfg.model, cfg.precision.activation_bytes, cfg.tokens_per_rank
    kept = _BookKept(cfg)
    acts_all = m.n_layers * full_block + head

    phase = _phase_with(states, fsdp_params)
    out = [
        *_loss_phases(cfg, acts_all, phase),
        ("backward: output", phase(
            activations=acts_all + t * m.dim * a,
            logits_loss=cfg.loss_tokens_per_rank * layers.logits_grad_bytes_per_token(m, a),
            per_sample_grads=kept.head_grad,
            ghost_norm=kept.norm_transient(m.dim, m.vocab_size) if kept.head_ghost else 0.0,
        )),
    ]
    head_kept = kept.head_kept  # the logits gradient, once the output projection's backward is done
    for i in reversed(range(m.n_layers)):
        done = m.n_layers - 1 - i
        out.append((f"backward: block {i}", phase(
            activations=(i + 1) * full_block + work_act,
            per_sample_grads=kept.head_grad + done * kept.block_grads + kept.largest_block_grad,
            ghost_norm=head_kept + done * kept.block_kept + kept.block_norm_transient,
            communication=work_comm,
        )))
    everything = dict(per_sample_grads=kept.head_grad + m.n_layers * kept.block_grads,
                      ghost_norm=head_kept + m.n_layers * kept.block_kept)
    out.append(("backward: embedding", phase(
        per_sample_grads=everything["per_sample_grads"] + kept.embedding_grads,
        ghost_norm=everything["ghost_norm"] + kept.embedding_kept,
    )))
    out.append(("clip: book-kept sums", phase(
        per_sample_grads=everything["per_sample_grads"] + kept.embedding_grads,
        ghost_norm=everything["ghost_norm"] + kept.embedding_kept + kept.largest_clipped_sum_transient,
    )))
    return out


class _BookKept:
    """What LongShield's ZeRO-DP+ holds per weight until the clip (bytes on one rank, one micro-batch)."""

    def __init__(self, cfg: RunConfig) -> None:
        m, a = cfg.model, cfg.precision.activation_bytes
        self.b, self.seq, self.t, self.a = cfg.micro_batch_size, cfg.seq_len, cfg.tokens_per_rank, a
        self.cfg = cfg
        linears = m.block_linears()
        ghost = {lin.name: self.ghost(lin.in_features, lin.out_features) for lin in linears}
        self.block_grads = sum(self.b * lin.numel * a for lin in linears if not ghost[lin.name])
        self.largest_block_grad = max((self.b * lin.numel * a for lin in linears if not ghost[lin.name]), default=0)
        inputs = {"wq": "attn", "wk": "attn", "wv": "attn", "wo": "wo", "w1": "ffn", "w3": "ffn", "w2": "w2"}
        kept_inputs = {inputs[lin.name]: lin.in_features for lin in linears if ghost[lin.name]}
        self.block_kept = (sum(kept_inputs.values()) + sum(lin.out_features for lin in linears if ghost[lin.name]))
        self.block_kept *= a * self.t
        book_kept = [lin for lin in linears if ghost[lin.name]]
        self.block_norm_transient = max((self.norm_transient(lin.in_features, lin.out_features)
                                         for lin in book_kept), default=0.0)
        vd = m.vocab_size * m.dim
        self.head_ghost = self.ghost(m.dim, m.vocab_size)
        self.head_grad = 0.0 if self.head_ghost else self.b * vd * a
        # The logits gradient and the head's input, kept past the output projection's backward.
        self.head_kept = (m.vocab_size + m.dim) * a * self.t if self.head_ghost else 0.0
        embedding_ghost = self.head_ghost if m.tie_embeddings else book_keeps(cfg, m.dim + 1, vd)
        self.embedding_kept = m.dim * a * self.t if embedding_ghost else 0.0
        # Materialised: the embedding's per-sample gradient; tied, also the sum with the head's.
        self.embedding_grads = 0.0 if embedding_ghost else self.b * vd * a * (2 if m.tie_embeddings else 1)
        sums = [(lin.in_features, lin.out_features) for lin in book_kept]
        if self.head_ghost:
            sums.append((m.dim, m.vocab_size))
        self.largest_clipped_sum_transient = max((self.clipped_sum_transient(d, p) for d, p in sums), default=0.0)

    def ghost(self, in_features: int, out_features: int) -> bool:
        """Whether a linear weight is book-kept (`book_keeps`)."""
        return book_keeps(self.cfg, in_features + out_features, in_features * out_features)

    def norm_transient(self, in_features: int, out_features: int) -> float:
        """A ghost norm's fp64 working set (`bookkeeping.cross_squared_norm`): Gram blocks of ``step`` x ``step``
        tokens per sample, two of them and their product, or two and the column chunks of the second pair."""
        step = min(self.seq, math.isqrt(BOOKKEEPING_BLOCK // self.b))
        gram = self.b * step * step * FP64
        columns = min(max(in_features, out_features), max(1, BOOKKEEPING_BLOCK // (self.b * step)))
        return max(3 * gram, 2 * gram + 2 * self.b * step * columns * FP64)

    def clipped_sum_transient(self, in_features: int, out_features: int) -> float:
        """A book-kept clipped sum (`bookkeeping.Use.clipped_sum`): the fp32 sum and one fp64 block of output rows
        with its token chunks (the output gradients' copy and scaled copy, the inputs' copy)."""
        rows = min(out_features, max(1, BOOKKEEPING_BLOCK // in_features))
        tokens = min(self.t, max(1, BOOKKEEPING_BLOCK // max(in_features, rows)))
        block = (rows * in_features + 2 * tokens * rows + tokens * in_features) * FP64
        return in_features * out_features * FP32 + block


def _sum_saved(saved: list[layers.SavedTensor], local_tokens: float, cp_size: int) -> float:
    return sum(s.nbytes(local_tokens, cp_size) for s in saved)


def _block_backward_working_set(cfg: RunConfig) -> tuple[float, float]:
    """(activation bytes, CP communication bytes) that one block's backward holds at its largest moment beyond the
    block's saved tensors (which the phases count whole).

    SwiGLU, at the product's backward: the grads of w2's input, of silu's output and of w3's output, plus the block
    input grad, less w2's saved input (freed once w2's backward ran).
    Attention, after the SwiGLU's backward freed its saved tensors: dq and flash's fp32 dq accumulator, plus dK/dV
    of the K/V SDPA saw: under CP these span the gathered sequence and are the reduce-scatter's input, next to its
    local output.
    """
    m, a, n, t = cfg.model, cfg.precision.activation_bytes, cfg.cp_size, cfg.tokens_per_rank
    mlp = (2 * m.ffn_dim + m.dim) * a * t
    freed_by_then = _sum_saved(layers.feed_forward_saved_tensors(m, a), t, n)
    dq = m.dim * (a + FP32) * t
    dkv_local = 2 * m.dim * a * t
    attn_act, attn_comm = dq + dkv_local - freed_by_then, (dkv_local * n if cfg.method.context_parallel else 0.0)
    return (mlp, 0.0) if mlp >= attn_act + attn_comm else (attn_act, attn_comm)


class _PerSampleGrads:
    """Per-sample gradient buffers of LongShield (V1: full on each CP rank; V2/V3: 1/N plus in-flight).

    A tied head/embedding weight can only be reduce-scattered once the embedding has added its part, so under
    V2/V3 its unreduced partial stays whole from the head's backward to the end. Under per-layer clipping a layer's
    (complete, this rank's part of) per-sample gradients are clipped and freed as soon as they are formed: only the
    layer being clipped is held (a tied weight still waits for its second use). Where the fused kernels take linear
    weights (`RunConfig.fused_linear_weights`) those are never formed: only the other tensors (RMSNorm weights, the
    embedding) are, one at a time; the kernels' own working set is ``B`` fp64 norms.
    """

    def __init__(self, cfg: RunConfig) -> None:
        kind = cfg.method.per_sample_grads
        self.active = kind in ("full", "sharded")
        # V2/V3 at micro-batch 1: the sample's gradient is FSDP's fp32 shard; its unreduced form is FSDP's buffer.
        self.fsdp_gradient = cfg.sample_gradient_is_fsdps
        if self.fsdp_gradient:
            self.unit = cfg.precision.reduce_bytes
        else:
            self.unit = cfg.micro_batch_size * cfg.precision.activation_bytes  # bytes per parameter per microbatch
        self.share = 1.0 / cfg.cp_size if kind == "sharded" else 1.0
        # Partials wait for a reduce-scatter (at micro-batch 1 they are FSDP's gradient buffers, counted as such).
        self.reduced = kind == "sharded" and cfg.cp_size > 1 and not self.fsdp_gradient
        trainable = cfg.trainable
        self.block_numel = trainable.block
        self.fused = cfg.fused_linear_weights
        self.largest = trainable.largest_other_in_block if self.fused else trainable.largest_in_block
        self.vd = trainable.embedding
        # The embedding's per-sample gradient is formed in its weight's dtype (the lookup runs outside autocast).
        self.embedding_unit = self.unit if self.fsdp_gradient else cfg.micro_batch_size * cfg.precision.master_bytes
        self.tied = cfg.model.tie_embeddings
        # At CP 1 a tied embedding's use is added into the head's per-sample gradient row by row: per token, its
        # row's fp32 sum twice (formed, read back) and the head's row, plus a first-token index per (sample, row).
        per_token = cfg.model.dim * (2 * cfg.precision.master_bytes + cfg.precision.activation_bytes)
        index = 8 * cfg.micro_batch_size * cfg.model.vocab_size
        self.rows_added = bool(cfg.cp_size == 1 and self.tied and self.vd)
        self.embedding_rows = cfg.tokens_per_rank * per_token + index
        self.per_layer = cfg.clipping == "per_layer"

    def block_kept(self) -> float:
        return self.unit * self.block_numel * self.share if self.active and not self.per_layer else 0.0

    def block_in_flight(self) -> float:
        """Two unreduced layer partials: one being reduce-scattered while the next is computed; under per-layer
        clipping also the (reduced) layer being clipped."""
        if not self.active:
            return 0.0
        clipped = self.unit * self.largest * self.share if self.per_layer else 0.0
        return clipped + (2 * self.unit * self.largest if self.reduced else 0.0)

    def head_kept(self) -> float:
        if not self.active or (self.per_layer and not self.tied):
            return 0.0
        whole = self.tied and self.reduced
        return self.unit * self.vd * (1.0 if whole else self.share)

    def head_in_flight(self) -> float:
        if not self.active or self.tied:
            return 0.0
        clipped = self.unit * self.vd * self.share if self.per_layer and not self.fused else 0.0
        return clipped + (self.unit * self.vd if self.reduced else 0.0)

    def embedding(self) -> float:
        """The embedding's buffers at the end of backward. Untied: its per-sample gradient, plus its unreduced
        partial while it is reduce-scattered. Tied: at CP 1 the rows it adds into the head's per-sample gradient;
        under CP its per-sample gradient, formed whole in the weight's dtype and added in place into the head's
        partial (kept whole or as this rank's part), then freed, and after it the head's reduced shard."""
        if not self.active:
            return 0.0
        formed = self.embedding_unit * self.vd
        if self.tied:
            reduced_shard = self.unit * self.vd * self.share if self.reduced else 0.0
            if self.fsdp_gradient:
                return reduced_shard
            return self.embedding_rows if self.rows_added else max(formed, reduced_shard)
        return formed * (self.share + (1.0 if self.reduced else 0.0))


class _GhostClipping:
    """ZeRO-DP+ buffers: book-kept output gradients of every linear layer (their inputs stay alive in the
    retained graph), and the norm work of the layer being differentiated (grad sample or ghost norm)."""

    def __init__(self, cfg: RunConfig) -> None:
        m, a, t = cfg.model, cfg.precision.activation_bytes, cfg.tokens_per_rank
        self.active = cfg.method.per_sample_grads == "ghost"
        self.a, self.t, self.b, self.seq = a, t, cfg.micro_batch_size, cfg.seq_len
        self.m = m
        output_grads = sum(lin.out_features for lin in m.block_linears())
        self._block_kept = output_grads * a * t
        self._head_kept = m.vocab_size * a * t  # the logits gradient

    def norm_buffer(self, numel: int) -> float:
        """Bytes to get one layer's per-sample norms under the mixed rule (ghost iff 2 T^2 < p d)."""
        if uses_ghost_norm(self.seq, numel):
            return 2 * self.b * self.seq**2 * self.a  # a a^T and g g^T per sample
        return self.b * numel * self.a  # the per-sample gradient, freed after its norm

    def block_kept(self) -> float:
        return self._block_kept if self.active else 0.0

    def block_transient(self) -> float:
        if not self.active:
            return 0.0
        return max(self.norm_buffer(lin.numel) for lin in self.m.block_linears())

    def head_kept(self) -> float:
        return self._head_kept if self.active else 0.0

    def head_transient(self) -> float:
        return self.norm_buffer(self.m.embedding_numel) if self.active else 0.0

    def embedding_transient(self) -> float:
        return self.head_transient()


def book_keeps(cfg: RunConfig, fan_sum: int, numel: int) -> bool:
    """Whether LongShield's ZeRO-DP+ book-keeps a weight (``(G, A)`` instead of its per-sample gradient): every one
    under ``norms="ghost"``, else by the mixed rule (`ghost_norm_is_cheaper`) ``T (p + d) < p d``."""
    return cfg.method.book_keep_all or cfg.seq_len * fan_sum < numel


def uses_ghost_norm(seq_len: int, numel: int) -> bool:
    """The mixed ghost-norm rule (Bu et al. 2022): ghost norm when ``2 T^2 < p d``, else grad sample."""
    return 2 * seq_len**2 < numel
