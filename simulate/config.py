"""Validated inputs of one simulated run: model, hardware, method, batch geometry and precision."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from simulate.loss_chunks import LossChunking, check_loss_chunking, resolve_loss_chunk_tokens
from simulate.specs import (
    GPU_PRESETS,
    MODEL_PRESETS,
    GPUSpec,
    ModelSpec,
    TrainableParams,
    get_gpu_spec,
    get_model_spec,
    trainable_params,
)
from simulate.strategy_config import (
    CLIPPING_MODES,
    DEFAULT_BUCKET_MB,
    METHOD_PRESETS,
    PER_LAYER_KERNELS,
    SHARD_OVER,
    PerLayerClipping,
    StrategyConfig,
)


@dataclass(frozen=True)
class MethodSpec:
    """How a training method lays out work and memory.

    ``per_sample_grads`` is ``"none"`` (non-DP), ``"ghost"`` (FSDP + mixed ghost clipping with book-keeping,
    the paper's ZeRO-DP+), ``"full"`` (LongShield-V1: every CP rank all-reduces and keeps full per-sample
    gradients) or ``"sharded"`` (LongShield-V2/V3: reduce-scatter over CP, each rank keeps and accumulates 1/N of
    them). ``whole_clipped_sum``: every CP rank accumulates the whole clipped sum (the paper's V1 prototype);
    LongShield's V1 keeps only its shard of each clipped gradient (`longshield_config`). ``retained_norm_pass``: the
    paper's ZeRO-DP+ prototype (Opacus FSDP ghost clipping): a norm pass with ``retain_graph=True`` that frees no
    activation, every linear layer's output gradient book-kept; LongShield's ZeRO-DP+ runs one backward in which each
    weight keeps either ``(G, A)`` or its per-sample gradient, whichever is smaller (`longshield_config`), or, with
    ``book_keep_all`` (``norms="ghost"``), ``(G, A)`` for every weight. ``shard_over``: the layout the method plans
    by default (`RunConfig.shard_over`).
    """

    name: str
    description: str
    context_parallel: bool
    activation_checkpointing: bool
    per_sample_grads: str
    #: The `METHOD_PRESETS` entry (the strategy's arguments) this method runs, or shares its layout with (non-DP).
    preset: str = "v2"
    overlap_grad_comm: bool = False
    whole_clipped_sum: bool = False
    retained_norm_pass: bool = False
    book_keep_all: bool = False
    shard_over: str = "context_parallel"

    @property
    def private(self) -> bool:
        return self.per_sample_grads != "none"


METHODS: dict[str, MethodSpec] = {
    m.name: m
    for m in (
        MethodSpec("nondp-fsdp", "non-private FSDP (TorchTitan baseline)", False, False, "none", shard_over="all"),
        MethodSpec("zero-dp", "FSDP + mixed ghost clipping + book-keeping (ZeRO-DP+)", False, False, "ghost",
                   preset="zero-dp", retained_norm_pass=True, shard_over="all"),
        MethodSpec("nondp-cp", "non-private FSDP + context parallelism", True, False, "none"),
        MethodSpec("nondp-cp-ac", "non-private CP + block activation checkpointing", True, True, "none", preset="v3"),
        MethodSpec("v1", "LongShield-V1: CP + per-sample grads all-reduced over CP", True, False, "full",
                   preset="v1", whole_clipped_sum=True),
        MethodSpec("v2", "LongShield-V2: CP + per-sample grads reduce-scattered over CP (overlapped)", True, False,
                   "sharded", overlap_grad_comm=True),
        MethodSpec("v3", "LongShield-V3: V2 + DP-safe block activation checkpointing", True, True, "sharded",
                   preset="v3", overlap_grad_comm=True),
    )
}


#: Flat clipping (per-sample gradients of the whole model until the norm is known) or per-layer clipping.
CLIPPINGS = CLIPPING_MODES


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each tensor family under a training precision."""

    name: str
    activation_bytes: int  # activations, unsharded compute parameters, per-sample gradients
    master_bytes: int = 4  # sharded master parameters, gradients / DP accumulator, AdamW moments
    reduce_bytes: int = 4  # FSDP gradient reduce-scatter dtype
    tensor_core_tf32: bool = False  # matmuls run at the TF32 rate instead of the bf16 rate


PRECISIONS: dict[str, Precision] = {
    "bf16-mixed": Precision("bf16-mixed", activation_bytes=2),
    "fp32": Precision("fp32", activation_bytes=4, tensor_core_tf32=True),
}


@dataclass(frozen=True)
class RunConfig:
    """One (model, hardware, method, MBS, T, CP) point. Build it with :func:`make_config`."""

    model_name: str
    model: ModelSpec
    gpu_name: str
    gpu: GPUSpec
    num_gpus: float  # an int, or math.inf for the FSDP ceiling
    method: MethodSpec
    micro_batch_size: int
    seq_len: int
    cp_size: int
    precision: Precision
    lora_rank: int = 0  # > 0: only LoRA adapters of this rank on every block projection train
    clipping: str = "flat"  # "per_layer": each layer's per-sample gradients clipped and freed as they complete
    per_layer_kernel: str = "torch"  # the strategy's PerLayerClipping.kernel: "auto"/"triton" fused where it runs
    loss_chunk_tokens: LossChunking = "auto"  # CausalLMModule's: "auto", None (the whole logits) or positions
    shard_over: str = "context_parallel"  # LongShieldStrategy's: model states over each CP group, or over all GPUs

    @property
    def shard_size(self) -> float:
        """GPUs the model states are FSDP2-sharded over: all of them (``shard_over="all"``), else one CP group."""
        return self.num_gpus if self.shard_over == "all" else self.cp_size

    @property
    def data_parallel_size(self) -> float:
        """Data-parallel groups: each draws its own samples and accumulates its own clipped sum."""
        return self.num_gpus / self.cp_size

    @property
    def loss_chunk(self) -> int | None:
        """Positions per chunk of the loss on one rank (`resolve_loss_chunk_tokens`), ``None`` for the whole logits."""
        positions = self.seq_len // self.cp_size
        return resolve_loss_chunk_tokens(self.loss_chunk_tokens, self.micro_batch_size, positions, self.model.dim,
                                         self.model.vocab_size)

    @property
    def loss_tokens_per_rank(self) -> float:
        """Tokens whose logits exist at once on one rank: one chunk's, or all ``tokens_per_rank``."""
        chunk = self.loss_chunk
        return self.tokens_per_rank if chunk is None else self.micro_batch_size * chunk

    @property
    def strategy(self) -> StrategyConfig:
        """`LongShieldStrategy`'s arguments that run this point (for a LongShield method; the non-DP baselines as
        the layout they share with V2 / V3)."""
        clipping = PerLayerClipping(kernel=self.per_layer_kernel) if self.clipping == "per_layer" else "flat"
        arguments = {**METHOD_PRESETS[self.method.preset], "context_parallel_size": self.cp_size,
                     "shard_over": self.shard_over}
        if self.method.book_keep_all:
            arguments["norms"] = "ghost"
        if self.method.per_sample_grads == "sharded" and not self.method.overlap_grad_comm:
            arguments["overlap_communication"] = False
        return StrategyConfig(**arguments, micro_batch_size=self.micro_batch_size, clipping=clipping)

    @property
    def sample_gradient_is_fsdps(self) -> bool:
        """LongShield V2 / V3 at micro-batch 1: the sample's gradient is FSDP's reduce-scattered ``.grad`` (every
        micro-batch, as without DP); not where model states are sharded over data-parallel replicas, whose ``.grad``
        would sum their samples (the per-sample path runs instead)."""
        return (self.method.per_sample_grads == "sharded" and self.micro_batch_size == 1
                and self.shard_size == self.cp_size)

    @property
    def fused_linear_weights(self) -> bool:
        """Whether per-layer clipping takes linear weights through the fused kernels (`PER_LAYER_KERNELS`). Not at
        micro-batch 1: there the summed gradient is the sample's, and the strategy clips it after backward."""
        return self.fused_kernel_runs and self.per_layer_kernel != "torch" and self.micro_batch_size > 1

    @property
    def fused_kernel_runs(self) -> bool:
        """Whether the strategy can run the fused per-layer kernels here (`use_fused_kernel`): per-layer clipping,
        CP 1 and the model whole on each GPU (not sharded over data-parallel replicas)."""
        return self.clipping == "per_layer" and self.cp_size == 1 and self.shard_size == 1

    @property
    def trainable(self) -> TrainableParams:
        """The parameters that take gradients (all of them, or the LoRA adapters)."""
        return trainable_params(self.model, self.lora_rank)

    @property
    def tokens_per_rank(self) -> float:
        """Tokens one rank holds activations for in one microbatch."""
        return self.micro_batch_size * self.seq_len / self.cp_size

    def replace(self, **changes: object) -> RunConfig:
        """A validated copy with some inputs changed (same names as :func:`make_config`)."""
        inputs = self.inputs()
        inputs.update(model=self.model, gpu=self.gpu)  # the specs themselves, so custom ones carry over
        inputs.update(changes)
        if inputs["method"] == self.method.name:  # the same method: keep its spec (LongShield's variant, if it is one)
            inputs["method"] = self.method
        return make_config(**inputs)  # type: ignore[arg-type]

    def inputs(self) -> dict[str, object]:
        """The inputs as :func:`make_config` takes them (JSON friendly, ``inf`` GPUs as the string "inf")."""
        return {
            "model": self.model_name,
            "gpus": "inf" if math.isinf(self.num_gpus) else int(self.num_gpus),
            "method": self.method.name,
            "mbs": self.micro_batch_size,
            "seq_len": self.seq_len,
            "cp": self.cp_size,
            "gpu": self.gpu_name,
            "precision": self.precision.name,
            "lora_rank": self.lora_rank,
            "clipping": self.clipping,
            "per_layer_kernel": self.per_layer_kernel,
            "loss_chunk_tokens": self.loss_chunk_tokens,
            "shard_over": self.shard_over,
        }


def precision_of(lightning_precision: object) -> str | None:
    """The planner's precision for a Lightning ``precision`` (``"bf16-mixed"``, ``"32-true"``, ``32``...): 16-bit
    compute is ``"bf16-mixed"``, 32-bit ``"fp32"``; ``None`` for one the planner does not model."""
    text = str(lightning_precision)
    if text.startswith(("bf16", "16")):
        return "bf16-mixed"
    if text.startswith("32"):
        return "fp32"
    return None


#: The most GPUs the planner plans for (a larger count is refused; ``inf`` is the FSDP ceiling).
MAX_GPUS = 2**20


def parse_gpus(value: int | float | str) -> float:
    """GPU count from ``4``, ``"4"`` or ``"inf"``, at most `MAX_GPUS`; anything else is a clear error."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("inf", "infinite", "infinity"):
            return math.inf
        if not text.isdigit():
            raise ValueError(f"--gpus must be a positive integer or 'inf', got {value!r}.")
        value = int(text)
    if value != math.inf and (value != int(value) or value < 1):
        raise ValueError(f"--gpus must be a positive integer or 'inf', got {value!r}.")
    if value != math.inf and value > MAX_GPUS:
        raise ValueError(f"--gpus {value} is above the {MAX_GPUS:,} GPUs the planner plans for; give at most"
                         f" {MAX_GPUS} (or 'inf' for the FSDP ceiling).")
    return float(value)


def make_config(
    model: str | ModelSpec = "llama3.1-8b",
    gpus: int | float | str = 4,
    method: str | MethodSpec = "v2",
    mbs: int = 1,
    seq_len: int = 4096,
    cp: int | None = None,
    gpu: str | GPUSpec = "h100",
    precision: str = "bf16-mixed",
    lora_rank: int = 0,
    clipping: str = "flat",
    per_layer_kernel: str = "torch",
    loss_chunk_tokens: LossChunking = "auto",
    shard_over: str | None = None,
) -> RunConfig:
    """Validate raw inputs into a :class:`RunConfig`; every error says how to fix the input.

    ``model``, ``gpu`` and ``method`` are preset names or specs (a custom model, a GPU with its measured capacity,
    LongShield's variant of a method from `longshield_config`).
    ``cp=None`` means: all GPUs form one CP group for CP methods, and 1 for FSDP methods.
    ``loss_chunk_tokens`` is `CausalLMModule`'s (``"auto"``: its default rule; ``None``: the whole logits at once).
    ``shard_over`` is `LongShieldStrategy`'s (``None``: the method's own, ``"all"`` for ``nondp-fsdp`` and
    ``zero-dp``, else the strategy's default ``"context_parallel"``).
    """
    spec = model if isinstance(model, ModelSpec) else get_model_spec(model)
    gpu_spec = gpu if isinstance(gpu, GPUSpec) else get_gpu_spec(gpu)
    model_name = model if isinstance(model, str) else _preset_name(spec, MODEL_PRESETS, "custom")
    gpu_name = gpu if isinstance(gpu, str) else _preset_name(gpu_spec, GPU_PRESETS, gpu_spec.name)
    if isinstance(method, MethodSpec):
        method_spec = method
    elif method in METHODS:
        method_spec = METHODS[method]
    else:
        raise ValueError(f"Unknown method {method!r}; choose one of {list(METHODS)}.")
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}; choose one of {list(PRECISIONS)}.")
    num_gpus = parse_gpus(gpus)
    if int(mbs) != mbs or mbs < 1:
        raise ValueError(f"Micro-batch size must be a positive integer, got {mbs!r}; use --mbs 1 or more.")
    if int(seq_len) != seq_len or seq_len < 1:
        raise ValueError(f"Sequence length must be a positive integer, got {seq_len!r}.")
    if int(lora_rank) != lora_rank or lora_rank < 0:
        raise ValueError(f"--lora-rank must be 0 (full fine-tuning) or a positive integer, got {lora_rank!r}.")
    if lora_rank and method_spec.per_sample_grads == "ghost":
        raise ValueError("LoRA is modelled for LongShield's methods and the non-DP baselines, not zero-dp; drop"
                         " --lora-rank or pick another method.")
    if clipping not in CLIPPINGS:
        raise ValueError(f"Unknown clipping {clipping!r}; choose one of {list(CLIPPINGS)}.")
    if clipping == "per_layer" and method_spec.per_sample_grads not in ("full", "sharded"):
        raise ValueError(f"Per-layer clipping is modelled for LongShield's per-sample-gradient methods (v1, v2, v3),"
                         f" not {method_spec.name}; drop --clipping per_layer or pick one of them.")
    if per_layer_kernel not in PER_LAYER_KERNELS:
        raise ValueError(f"Unknown per-layer kernel {per_layer_kernel!r}; choose one of {list(PER_LAYER_KERNELS)}.")
    check_loss_chunking(loss_chunk_tokens)
    shard_over = method_spec.shard_over if shard_over is None else shard_over
    if shard_over not in SHARD_OVER:
        raise ValueError(f"Unknown shard_over {shard_over!r}; choose one of {list(SHARD_OVER)}.")
    cp_size = _resolve_cp(method_spec, num_gpus, cp)
    if method_spec.context_parallel and seq_len % (2 * cp_size):
        raise ValueError(
            f"Sequence length {seq_len} must be divisible by 2 x CP size = {2 * cp_size} "
            "(load-balanced sharding cuts it into 2N chunks); pick a multiple of it."
        )
    cfg = RunConfig(model_name, spec, gpu_name, gpu_spec, num_gpus, method_spec, int(mbs), int(seq_len), cp_size,
                    PRECISIONS[precision], int(lora_rank), clipping, per_layer_kernel, loss_chunk_tokens, shard_over)
    if clipping == "per_layer" and per_layer_kernel == "triton" and not cfg.fused_kernel_runs:
        raise ValueError("PerLayerClipping(kernel='triton') needs CP 1 and the model whole on each GPU (not sharded"
                         " over data-parallel replicas), or the strategy refuses it; use kernel='auto' (fused where"
                         " it runs: --per-layer-kernel auto) or 'torch'.")
    return cfg


def as_run_by_longshield(method: str, mbs: int) -> str:
    """The method LongShield's strategy really runs for ``method``: with one sample per micro-batch, V1 takes V2's
    path (the sample's gradient is FSDP's reduce-scattered gradient shard; no per-sample buffer is all-reduced).
    ``"v1"`` itself stays the paper's V1, whose prototype keeps full per-sample gradients at any micro-batch size."""
    return "v2" if method == "v1" and mbs == 1 else method


def as_run_by_strategy(method: str, mbs: int, norms: str = "mixed", overlap_communication: bool = True) -> MethodSpec:
    """The spec of ``method`` as `LongShieldStrategy` runs it (`as_run_by_longshield`): its V1 keeps only its shard of
    each clipped gradient (not the whole clipped sum), its ZeRO-DP+ runs one backward with book-keeping (no retained
    norm pass; with ``norms="ghost"`` every weight book-kept), V2 / V3 reduce-scatter behind the backward unless
    ``overlap_communication`` is off; the non-DP baselines are as they are."""
    spec = METHODS[as_run_by_longshield(method, mbs)]
    return replace(spec, whole_clipped_sum=False, retained_norm_pass=False,
                   book_keep_all=spec.per_sample_grads == "ghost" and norms == "ghost",
                   overlap_grad_comm=spec.overlap_grad_comm and overlap_communication)


def longshield_config(
    model: str | ModelSpec,
    method: str,
    cp: int,
    mbs: int,
    seq_len: int,
    precision: str = "bf16-mixed",
    gpu: str | GPUSpec = "h100",
    lora_rank: int = 0,
    data_parallel: int = 1,
    clipping: str = "flat",
    per_layer_kernel: str = "torch",
    loss_chunk_tokens: LossChunking = "auto",
    shard_over: str | None = None,
    norms: str = "mixed",
    overlap_communication: bool = True,
) -> RunConfig:
    """`LongShieldStrategy` as the planner sees it, with the method the strategy really runs (`as_run_by_longshield`;
    its V1 keeps only its shard of each clipped gradient, not the whole clipped sum), on ``cp x data_parallel`` GPUs:
    model states sharded over each context-parallel group (``shard_over="context_parallel"``, the default for CP
    methods; data-parallel groups are replicas) or over all of them (``"all"``), each DP group accumulating its own
    clipped sum over its CP group.

    ``"zero-dp"`` is the strategy's ZeRO-DP+ (``context_parallel_size=1, shard_over="all", norms="mixed"``, or
    ``norms="ghost"``): model states sharded over all ``data_parallel`` GPUs (with ``shard_over="context_parallel"``:
    whole on each), one backward with book-keeping (no retained norm pass).
    ``loss_chunk_tokens`` is `CausalLMModule`'s setting; ``overlap_communication`` the strategy's.
    """
    spec = as_run_by_strategy(method, mbs, norms, overlap_communication)
    return make_config(model=model, gpus=cp * data_parallel, method=spec, mbs=mbs,
                       seq_len=seq_len, cp=cp, gpu=gpu, precision=precision, lora_rank=lora_rank, clipping=clipping,
                       per_layer_kernel=per_layer_kernel, loss_chunk_tokens=loss_chunk_tokens, shard_over=shard_over)


def method_for(strategy: StrategyConfig) -> tuple[str, tuple[str, ...]]:
    """The planner's method for what `LongShieldStrategy` runs with ``strategy``, with notes on where the estimate is
    approximate."""
    notes: list[str] = []
    if strategy.projected_norms is not None:
        notes.append(RANDOMIZED_CLIPPING_NOTE)
    if strategy.per_sample != "materialize":
        if (strategy.context_parallel_size or 1) > 1 or strategy.activation_checkpointing is not False:
            notes.append(f"Note: norms={strategy.per_sample!r} is estimated as ZeRO-DP+ (book-keeping, CP 1, no"
                         " checkpointing, the full sequence on each GPU, model states over one context-parallel group"
                         " unless shard_over='all'); this run's context parallelism or checkpointing differs, so the"
                         " estimate is approximate.")
        return "zero-dp", tuple(notes)
    if strategy.output_stationary:
        notes.append("Note: exchange='output_stationary' is planned as V2's reduce-scatter of per-sample gradients;"
                     " its all-to-alls and re-gathered linear inputs are not modelled, so the estimate is approximate.")
    if (strategy.shards_per_sample_grads and strategy.context_parallel_size != 1
            and strategy.communication_bucket_mb != DEFAULT_BUCKET_MB):
        notes.append(BUCKET_NOTE)
    if strategy.activation_checkpointing is False:
        return ("v2" if strategy.shards_per_sample_grads else "v1"), tuple(notes)
    if not strategy.checkpoints_every_block:
        notes.append("Note: the estimate assumes every block is checkpointed (activation_checkpointing is a policy).")
    if not strategy.shards_per_sample_grads:
        notes.append("Note: estimated as V3 (sharded per-sample gradients); with exchange='all_reduce' every rank keeps"
                     " all of them, so the real peak is higher.")
    return "v3", tuple(notes)


#: How `plan_strategy` plans LoRA with book-kept norms, which the cost model does not cover.
LORA_BOOK_KEPT_NOTE = (
    "Note: LoRA with book-kept norms (norms='ghost' or 'mixed') is planned as norms='materialize'. 'mixed' materialises"
    " an adapter's per-sample gradients (in x rank) wherever they are smaller than its inputs and output gradients"
    " (tokens x (in + rank)), so the plans agree for it; 'ghost' book-keeps every adapter, which is not modelled.")


def planned_with_lora(strategy: StrategyConfig, lora_rank: int) -> tuple[StrategyConfig, tuple[str, ...]]:
    """``strategy`` as the planner plans it with LoRA adapters of rank ``lora_rank`` (0: none), and a note where
    that differs: book-kept norms become materialised ones (`LORA_BOOK_KEPT_NOTE`)."""
    if lora_rank and method_for(strategy)[0] == "zero-dp":
        return strategy.replace(norms="materialize"), (LORA_BOOK_KEPT_NOTE,)
    return strategy, ()


def plan_strategy(
    model: str | ModelSpec,
    strategy: StrategyConfig,
    gpus: int,
    seq_len: int,
    precision: str = "bf16-mixed",
    gpu: str | GPUSpec = "h100",
    per_layer_kernel: str = "torch",
    loss_chunk_tokens: LossChunking = "auto",
    lora_rank: int = 0,
) -> tuple[RunConfig, tuple[str, ...]]:
    """The planner's point for `LongShieldStrategy` with ``strategy`` on ``gpus`` processes, and notes where the
    estimate is approximate: the one place where the strategy's arguments meet the planner's cost model
    (`method_for`). All ``gpus`` are planned in context-parallel groups of ``strategy.context_parallel_size``
    (``None``: all ``gpus``), with model states sharded over each group or, with ``shard_over="all"``, over all
    ``gpus``; ZeRO-DP+ as `zero_dp_layout` says. ``seq_len`` is rounded up to a multiple of ``2 x CP`` (the
    load-balanced sharding needs it). ``lora_rank``: the LoRA adapters' rank (0: full fine-tuning)."""
    cp = strategy.context_parallel_size or gpus
    strategy, lora_notes = planned_with_lora(strategy, lora_rank)
    method, notes = method_for(strategy.replace(context_parallel_size=cp))
    notes = (*notes, *lora_notes)
    mbs = strategy.micro_batch_size
    if method == "zero-dp":
        world, shard_over = zero_dp_layout(strategy.shard_over, cp, gpus)
        return longshield_config(model, method, 1, mbs, seq_len, precision, gpu, lora_rank=lora_rank,
                                 data_parallel=world, loss_chunk_tokens=loss_chunk_tokens, shard_over=shard_over,
                                 norms=strategy.per_sample), notes
    padded = -(-seq_len // (2 * cp)) * (2 * cp)
    clipping = "flat" if strategy.per_layer is None else "per_layer"
    return longshield_config(model, method, cp, mbs, padded, precision, gpu, lora_rank=lora_rank,
                             data_parallel=gpus // cp, clipping=clipping, per_layer_kernel=per_layer_kernel,
                             loss_chunk_tokens=loss_chunk_tokens, shard_over=strategy.shard_over,
                             overlap_communication=strategy.overlap_communication), notes


def zero_dp_layout(shard_over: str, cp: int, gpus: int) -> tuple[int, str]:
    """(GPUs, shard_over) on which book-kept norms (ZeRO-DP+, planned at CP 1) are planned for ``gpus`` processes in
    context-parallel groups of ``cp``: all of them as the run shards them (over all; or, at CP 1, whole on each
    replica), else, above CP 1 with ``"context_parallel"``, one group with its model states sharded over it
    (approximate: `method_for`'s note)."""
    if shard_over == "all" or cp == 1:
        return gpus, shard_over
    return cp, "all"


def planned_as_run(cfg: RunConfig) -> RunConfig:
    """``cfg`` as `LongShieldStrategy` runs the arguments that run it (``cfg.strategy``), planned as the pre-flight
    check plans them (`plan_strategy`: V1 at micro-batch 1 is V2's run, ZeRO-DP+ is one backward with
    book-keeping); a non-private baseline, which the strategy does not run, as it is."""
    if not cfg.method.private:
        return cfg
    gpus = cfg.num_gpus if math.isinf(cfg.num_gpus) else int(cfg.num_gpus)  # inf: ZeRO-DP+'s FSDP ceiling
    planned, _ = plan_strategy(cfg.model, cfg.strategy, gpus, cfg.seq_len, cfg.precision.name,  # type: ignore[arg-type]
                               cfg.gpu, cfg.per_layer_kernel, cfg.loss_chunk_tokens, cfg.lora_rank)
    return planned


#: How `plan_strategy` plans a reduce-scatter bucket size other than the default.
BUCKET_NOTE = (
    "Note: communication_bucket_mb is planned as the default bucket: a larger bucket keeps more per-sample gradient"
    " partials in flight (up to its size), and a smaller one issues more collectives; neither is modelled.")


RANDOMIZED_CLIPPING_NOTE = (
    "Note: randomized clipping (ProjectedNorms) keeps every linear and embedding layer's inputs and output gradients"
    " until the norms are known (about MBS x T x (in + out) elements per layer, with k-column sketches), which the"
    " planner does not model: the estimate assumes per-sample gradients and is approximate (lower at long sequences)."
)


TRACEABLE_METHODS = ("zero-dp", "nondp-cp", "nondp-cp-ac", "v1", "v2", "v3")  # LongShield's code paths (traced memory)


def _preset_name(spec: object, presets: Mapping[str, object], default: str) -> str:
    """The name of the preset equal to ``spec``, else ``default``."""
    return next((name for name, preset in presets.items() if preset == spec), default)


def _resolve_cp(method: MethodSpec, num_gpus: float, cp: int | None) -> int:
    if not method.context_parallel:
        if cp not in (None, 1):
            raise ValueError(f"Method {method.name!r} does not use context parallelism; drop --cp or pick a CP "
                             "method (nondp-cp, nondp-cp-ac, v1, v2, v3).")
        return 1
    if cp is None:
        if math.isinf(num_gpus):
            raise ValueError(f"Method {method.name!r} needs a finite CP size; give --cp N with --gpus inf.")
        return int(num_gpus)
    if int(cp) != cp or cp < 1:
        raise ValueError(f"CP size must be a positive integer, got {cp!r}.")
    if not math.isinf(num_gpus) and int(num_gpus) % cp:
        raise ValueError(f"CP size {cp} (--cp) must divide the GPU count {int(num_gpus)} (--gpus); pick a divisor.")
    return int(cp)
