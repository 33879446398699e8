"""Pre-flight memory check: before the first step allocates activations, ask `simulate` whether the run fits.

`LongShieldStrategy` calls :func:`run_preflight` when it processes the training DataLoader (parameters are placed,
nothing has run forward yet). On CUDA, a run the planner predicts will not fit stops with a
:class:`PreflightMemoryError` naming the predicted peak, its breakdown and the best configuration that does fit; on
CPU the prediction is only logged. ``predict(...).check()`` is the same decision as a pure function.

The estimate is of the world's GPUs with the strategy's ``shard_over``: parameters, optimizer state and the
clipped-gradient accumulator FSDP2-sharded over each context-parallel group (data-parallel groups are replicas; at
CP 1 each GPU holds them whole) or, with ``shard_over="all"``, over every GPU (`simulate.plan_strategy`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_longshield.privacy.per_layer import use_fused_kernel
from simulate import GPU_PRESETS, GPUSpec, MemoryBreakdown, ModelSpec, RunConfig, estimate_memory, plan_strategy
from simulate.config import method_for, precision_of
from simulate.loss_chunks import LossChunking
from simulate.strategy_config import StrategyConfig, describe_arguments
from simulate.throughput import estimate_step_time

GIB = 2**30
TOTALS = ("capacity", "allocated", "reserved", "device_total")  # `MemoryBreakdown.as_gib` keys that are not parts
MAX_CP_SIZE = 1024  # the largest context-parallel group an alternative may ask for
DEFAULT_GPU = "h100"  # speeds (and, on CPU, the capacity) assumed for a device no preset name matches
DISABLE_HINT = "The estimate is analytic (simulate/); to train anyway, pass LongShieldStrategy(preflight=False)."


class PreflightMemoryError(MemoryError):
    """The planner predicts that the run does not fit the device's memory; raised before the first forward."""


@dataclass(frozen=True)
class Alternative:
    """A configuration that fits: the constructor arguments that change, the GPUs it needs, its memory."""

    arguments: tuple[str, ...]
    memory: MemoryBreakdown
    gpus: Optional[int] = None  # ``None``: the GPUs the run already has

    def describe(self) -> str:
        where = "" if self.gpus is None else f" on {self.gpus} GPUs (Trainer devices x num_nodes)"
        return (
            f"LongShieldStrategy({', '.join(self.arguments)}){where}: predicted peak"
            f" {self.memory.reserved / GIB:.1f} GiB per GPU"
        )


@dataclass(frozen=True)
class PreflightResult:
    """The planner's prediction for one run (``config``: its GPUs, with the strategy's ``shard_over``)."""

    config: RunConfig
    memory: MemoryBreakdown
    world_size: int
    #: The strategy's arguments that were planned (the context-parallel size resolved).
    strategy: StrategyConfig
    notes: tuple[str, ...] = ()
    #: The sequence length was read from a training sample (no public ``seq_len``): neither it nor the memory
    #: figures computed from it are shown.
    private_length: bool = False

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def describe_run(self) -> str:
        """The run as the planner saw it (the sequence length only where it is public)."""
        cfg = self.config
        length = "the first training sample's length" if self.private_length else f"sequence length {cfg.seq_len}"
        arguments = describe_arguments({"context_parallel_size": cfg.cp_size, **self.strategy.as_arguments()})
        return (
            f"model {cfg.model_name}, {self.world_size} GPU{'s' * (self.world_size != 1)},"
            f" LongShieldStrategy({arguments}), {length}, {cfg.precision.name}"
            + (f", LoRA rank {cfg.lora_rank}" if cfg.lora_rank else "")
        )

    def peak(self) -> str:
        """Predicted peak per GPU, with and without what lives outside the caching allocator."""
        memory = self.memory
        return (
            f"predicted peak {memory.reserved / GIB:.1f} GiB per GPU"
            f" ({memory.device_total / GIB:.1f} GiB with the CUDA context and NCCL buffers)"
        )

    def breakdown(self) -> str:
        """The non-zero parts of the peak, in GiB (`MemoryBreakdown.as_gib`)."""
        parts = [f"{name} {gib:.2f}" for name, gib in self.memory.as_gib().items() if name not in TOTALS and gib]
        return f"Breakdown at the peak ({self.memory.phase}), GiB: {', '.join(parts)}."

    def check(self) -> PreflightResult:
        """This result, or :class:`PreflightMemoryError` (with the best fitting alternative) if it does not fit."""
        if not self.fits:
            # With a private length no alternative is searched: which one fits is computed from that length too.
            alternative = None if self.private_length else find_alternative(self.strategy, self.config, self.world_size)
            raise PreflightMemoryError(self.failure_message(alternative))
        return self

    def failure_message(self, alternative: Optional[Alternative]) -> str:
        """Why the run stops and what fits instead."""
        capacity = f"{self.memory.capacity / GIB:.1f} GiB capacity of the {self.config.gpu.name}"
        if self.private_length:
            head = [f"LongShield pre-flight: the run does not fit in GPU memory: the predicted peak exceeds the"
                    f" {capacity}, for {self.describe_run()}.", PRIVATE_LENGTH_NOTE]
            fix = ("No alternative is searched: it would be computed from the private length too. Give the dataset a"
                   " `seq_len` attribute, or plan the run with `longshield-plan`.")
        else:
            head = [f"LongShield pre-flight: the run does not fit in GPU memory: {self.peak()} vs {capacity},"
                    f" for {self.describe_run()}.", self.breakdown()]
            fix = (f"Fits instead: {alternative.describe()}." if alternative is not None else
                   "Nothing the planner tried fits (activation checkpointing, smaller micro-batches, context-parallel"
                   f" groups of up to {MAX_CP_SIZE} GPUs): shorten the sequences or use GPUs with more memory.")
        lines = [
            *head,
            fix,
            *self.notes,
            DISABLE_HINT,
        ]
        return "\n".join(lines)


PRIVATE_LENGTH_NOTE = (
    "The sequence length, the predicted peak and its breakdown are not shown: the training dataset has no public"
    " `seq_len` attribute, so the plan uses the length of its first sample, a value of the private data. Give the"
    " dataset a `seq_len` attribute (the configured sequence length) to plan with it and see them."
)

def model_spec_of(config: object) -> Optional[ModelSpec]:
    """A module's `LlamaConfig` (a `ModelSpec` subclass) as a plain `ModelSpec`, which the planner matches against
    its presets by value; ``None`` for anything else."""
    if not isinstance(config, ModelSpec):
        return None
    return ModelSpec(**{f.name: getattr(config, f.name) for f in fields(ModelSpec)})


def public_sequence_length(dataset: object) -> Optional[int]:
    """The dataset's configured tokens per sample, its ``seq_len`` attribute (`PackedTokenDataset`,
    `PaddedDocumentDataset`): a public value, which the pre-flight may log; ``None`` if it has none."""
    seq_len = getattr(dataset, "seq_len", None)
    return seq_len if isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len > 0 else None


def sequence_length(dataset: object) -> Optional[int]:
    """Tokens per training sample, from the first sample's ``input_ids`` (``None`` if samples are not such dicts).

    A value of the private data: plan with it, never log it (`PreflightResult.private_length`)."""
    try:
        return len(dataset[0]["input_ids"])  # type: ignore[index]
    except (AttributeError, IndexError, KeyError, NotImplementedError, TypeError):
        return None


def is_cuda(device: torch.device) -> bool:
    """Whether the check is enforced on ``device`` (elsewhere it only logs)."""
    return device.type == "cuda"


def device_properties(device: torch.device) -> tuple[str, int]:
    """``(name, total memory in bytes)`` of a CUDA device: the one place that asks the driver."""
    properties = torch.cuda.get_device_properties(device)
    return properties.name, properties.total_memory


def gpu_spec_for(name: str, capacity_bytes: float) -> GPUSpec:
    """A `GPUSpec` with the device's capacity; speeds of the preset whose type ``name`` mentions (default H100)."""
    lowered = name.lower()
    key = next((key for key in ("h200", "h100", "a100") if key in lowered), DEFAULT_GPU)
    if key == "a100":
        key = "a100-80" if capacity_bytes > 60 * GIB else "a100-40"
    preset = GPU_PRESETS[key]
    return replace(preset, name=name or preset.name, memory_gib=capacity_bytes / GIB)


def predict(
    model: ModelSpec,
    strategy: StrategyConfig,
    gpus: int,
    seq_len: int,
    precision: str,
    capacity_bytes: float,
    gpu_name: str = "",
    per_layer_kernel: str = "torch",
    private_length: bool = False,
    loss_chunk_tokens: LossChunking = "auto",
    lora_rank: int = 0,
) -> PreflightResult:
    """The planner's peak memory per GPU for `LongShieldStrategy` with ``strategy`` on ``gpus`` processes
    (`plan_strategy`; ``per_layer_kernel``: ``"auto"`` (fused) or ``"torch"``, see `planned_per_layer_kernel`;
    ``private_length``: ``seq_len`` was read from the data and is not to be shown, see `PreflightResult`;
    ``loss_chunk_tokens``: the module's chunked loss, `CausalLMModule`'s setting; ``lora_rank``: its LoRA
    adapters' rank, 0 for full fine-tuning)."""
    cp = strategy.context_parallel_size or gpus
    if cp < 1 or gpus % cp:
        raise ValueError(f"context_parallel_size={cp} must be a positive divisor of the {gpus} processes.")
    strategy = strategy.replace(context_parallel_size=cp)
    config, notes = plan_strategy(model, strategy, gpus, seq_len, precision, gpu_spec_for(gpu_name, capacity_bytes),
                                  per_layer_kernel, loss_chunk_tokens, lora_rank)
    return PreflightResult(config, estimate_memory(config), gpus, strategy, notes, private_length)


def find_alternative(strategy: StrategyConfig, config: RunConfig, world_size: int) -> Optional[Alternative]:
    """The best change to ``strategy`` (planned as ``config``) that fits: the fastest on the same GPUs, else on the
    fewest more GPUs.

    Changes tried: ``exchange="reduce_scatter"`` instead of ``"all_reduce"``, ``activation_checkpointing=True``,
    smaller micro-batches, larger context-parallel groups (divisors of the world size; beyond it, doubling up to
    :data:`MAX_CP_SIZE`).
    """
    cp = config.cp_size
    same_gpus = [n for n in range(cp, world_size + 1) if world_size % n == 0]
    doublings = (cp * 2**k for k in range(1, MAX_CP_SIZE.bit_length()))
    more_gpus = [n for n in doublings if world_size % n and n <= MAX_CP_SIZE]
    found = _fastest_fit(strategy, config, same_gpus, world_size)
    for n in more_gpus:
        if found is not None:
            break
        found = _fastest_fit(strategy, config, [n], world_size)
    return found


def _fastest_fit(
    strategy: StrategyConfig, config: RunConfig, cp_sizes: list[int], world_size: int
) -> Optional[Alternative]:
    """The fitting candidate over ``cp_sizes`` x layouts x micro-batch sizes with the most tokens/s per GPU."""
    best: Optional[tuple[float, StrategyConfig, MemoryBreakdown]] = None
    sharded_over_all = strategy.shard_over == "all"  # model states over every rank
    zero_dp = method_for(strategy)[0] == "zero-dp"  # planned as ZeRO-DP+: no context parallelism
    for cp in cp_sizes:
        if config.seq_len % (2 * cp) or (zero_dp and cp > 1):
            continue
        gpus = _processes_for(cp, world_size, config) if sharded_over_all else cp
        for layout in _lighter_layouts(strategy):
            for mbs in _smaller_micro_batches(strategy.micro_batch_size):
                candidate = layout.replace(context_parallel_size=cp, micro_batch_size=mbs)
                if candidate == strategy:
                    continue
                planned, _ = plan_strategy(config.model, candidate, gpus, config.seq_len, config.precision.name,
                                           config.gpu, config.per_layer_kernel, config.loss_chunk_tokens,
                                           config.lora_rank)
                memory = estimate_memory(planned)
                if not memory.fits:
                    continue
                step = estimate_step_time(planned)
                speed = step.tokens_per_second_per_gpu if step is not None else 0.0
                if best is None or speed > best[0]:
                    best = (speed, candidate, memory)
    if best is None:
        return None
    _, candidate, memory = best
    cp = candidate.context_parallel_size or 1
    gpus = None if world_size % cp == 0 else _processes_for(cp, world_size, config)
    changed = strategy.changed_arguments(candidate)
    return Alternative(tuple(describe_arguments({name: value}) for name, value in changed.items()), memory, gpus)


def _processes_for(cp: int, world_size: int, config: RunConfig) -> int:
    """The processes a candidate with context-parallel groups of ``cp`` runs on: the world, where ``cp`` divides it
    (the GPUs are reused); else ``cp`` times the data-parallel groups of ``config`` (a larger group keeps them)."""
    return world_size if world_size % cp == 0 else cp * (world_size // config.cp_size)


def _lighter_layouts(strategy: StrategyConfig) -> list[StrategyConfig]:
    """``strategy`` and the layouts that need less memory: sharded per-sample gradients (V1 -> V2), then every block
    checkpointed (V3)."""
    layouts = [strategy]
    if strategy.exchange == "all_reduce":
        layouts.append(layouts[-1].replace(exchange="reduce_scatter"))
    # Not for book-kept norms, planned as ZeRO-DP+ without checkpointing (`method_for`): with shard_over="all" and
    # materialised norms it is tried like any other layout.
    if strategy.activation_checkpointing is not True and method_for(strategy)[0] != "zero-dp":
        layouts.append(layouts[-1].replace(activation_checkpointing=True))
    return layouts


def _smaller_micro_batches(mbs: int) -> list[int]:
    """``mbs``, ``mbs // 2``, ... down to 1."""
    return sorted({max(1, mbs >> k) for k in range(mbs.bit_length())}, reverse=True)


def planned_per_layer_kernel(config: StrategyConfig, device: torch.device, cp: int, world_size: int) -> str:
    """The planner's ``per_layer_kernel`` for what the strategy runs: ``"auto"`` (fused) where linear weights go
    through the fused kernels (`use_fused_kernel`: CP 1, the model not sharded over data-parallel replicas, Triton on
    CUDA; off CUDA, where the check only logs, as on CUDA with Triton), else ``"torch"``."""
    if config.per_layer is None or config.per_layer.kernel == "torch":
        return "torch"
    sharded = cp > 1 or (config.shard_over == "all" and world_size > cp)
    # "auto", not the setting: a "triton" that cannot run is the engine's error to raise, not the estimate's.
    fused = use_fused_kernel("auto", device, sharded) if is_cuda(device) else not sharded
    return "auto" if fused else "torch"


def run_preflight(
    *,
    module: object,
    dataset: object,
    device: torch.device,
    world_size: int,
    cp: int,
    precision: str,
    config: StrategyConfig,
) -> Optional[PreflightResult]:
    """The strategy's pre-flight: on CUDA, raise :class:`PreflightMemoryError` if the run will not fit; else log.

    Skipped (with a log line) when the module has no `LlamaConfig` ``config``, the samples have no ``input_ids``,
    or the precision is one the planner does not model. The sequence length is the dataset's public ``seq_len``
    attribute where it has one; else the first sample's length is used for planning but never logged, nor are the
    memory figures computed from it (a value of the private data).
    """
    model = model_spec_of(getattr(module, "config", None))
    public_length = public_sequence_length(dataset)
    seq_len = public_length if public_length is not None else sequence_length(dataset)
    planner_precision = precision_of(precision)
    lora_rank = lora_rank_of(module)
    reason = _skip_reason(model, seq_len, planner_precision, precision)
    book_kept = method_for(config)[0] == "zero-dp"
    if reason is None and lora_rank and book_kept:
        reason = "the planner does not model LoRA adapters with book-kept norms (norms='ghost' or 'mixed')"
    if reason is None and book_kept and cp > 1:
        # Planned at CP 1 with the whole sequence on every GPU, it overstated the peak 2-3x and refused runs that fit.
        reason = ("the planner models book-kept norms (norms='ghost' or 'mixed') at context-parallel size 1 only,"
                  f" not over this run's {cp} ranks a sequence")
    if reason is not None:
        rank_zero_info(f"LongShield pre-flight memory check skipped: {reason}.")
        return None
    assert model is not None and seq_len is not None and planner_precision is not None
    strategy = config.replace(context_parallel_size=cp)
    run = (model, strategy, world_size, seq_len, planner_precision)
    options = dict(per_layer_kernel=planned_per_layer_kernel(config, device, cp, world_size),
                   private_length=public_length is None,
                   # A module of its own computes its loss as it likes: planned over the whole logits.
                   loss_chunk_tokens=getattr(module, "loss_chunk_tokens", None), lora_rank=lora_rank)
    unchecked = _unchecked_reason(precision, config)
    if not is_cuda(device) or unchecked is not None:
        result = predict(*run, GPU_PRESETS[DEFAULT_GPU].memory_bytes, **options)
        prediction = "planned" if result.private_length else f"on CUDA, {result.peak()}"
        rank_zero_info(
            f"LongShield pre-flight ({unchecked or device.type}: logged, not checked): {prediction} for"
            f" {result.describe_run()}. {_details(result)}{_joined(result.notes)}"
        )
        return result
    name, capacity = device_properties(device)
    result = predict(*run, capacity, gpu_name=name, **options).check()
    fits = "fits in" if result.private_length else f"fits, {result.peak()} of"
    rank_zero_info(
        f"LongShield pre-flight: {fits} {capacity / GIB:.1f} GiB ({name}) for {result.describe_run()}."
        f" {_details(result)}{_joined(result.notes)}"
    )
    return result


def lora_rank_of(module: object) -> int:
    """The rank of ``module``'s LoRA adapters (`CausalLMModule`'s ``lora``), 0 where it trains every parameter."""
    rank = getattr(getattr(module, "lora", None), "rank", 0)
    return rank if isinstance(rank, int) and not isinstance(rank, bool) and rank > 0 else 0


def _details(result: PreflightResult) -> str:
    """The breakdown of the peak, or why it is not shown."""
    return PRIVATE_LENGTH_NOTE if result.private_length else result.breakdown()


def _joined(notes: tuple[str, ...]) -> str:
    return "".join(f" {note}" for note in notes)


def _unchecked_reason(precision: str, config: StrategyConfig) -> Optional[str]:
    """Why a run is planned too far from what it runs to be refused on a plan, or None: ``bf16-true`` is planned as
    bf16-mixed (fp32 master weights and AdamW moments: about 6 bytes a parameter above its bf16 ones, so a fitting
    run would be refused), and a policy checkpointing only some blocks as every block checkpointed (below its peak,
    so the plan would pass a run that does not fit)."""
    if str(precision).startswith("bf16-true"):
        return "precision='bf16-true' is planned as bf16-mixed, above its peak"
    if config.activation_checkpointing is not False and not config.checkpoints_every_block:
        return "a policy checkpointing some blocks is planned as every block checkpointed, below its peak"
    return None


def _skip_reason(
    model: Optional[ModelSpec], seq_len: Optional[int], planner_precision: Optional[str], precision: str
) -> Optional[str]:
    if model is None:
        return "the LightningModule has no LlamaConfig `config` attribute to size the model from"
    if seq_len is None:
        return 'the training samples are not dicts with "input_ids" (their length is the sequence length)'
    if planner_precision is None:
        return f"the planner does not model precision={precision!r}"
    return None
