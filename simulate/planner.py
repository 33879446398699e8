"""Answers for a user planning a run: does it fit, how fast, how long can the context go, what to pick."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from simulate.config import METHODS, MethodSpec, RunConfig, make_config, parse_gpus, planned_as_run
from simulate.loss_chunks import LossChunking
from simulate.memory import GIB, MemoryBreakdown, estimate_memory
from simulate.strategy_config import SHARD_OVER
from simulate.throughput import StepTime, estimate_step_time

DP_METHODS = ("zero-dp", "v1", "v2", "v3")
MBS_OPTIONS = (1, 2, 4, 8)
MAX_SEARCH_EXPONENT = 24  # max-seq searches T = 2^0 .. 2^24 (16M tokens)
SEARCH_LIMIT = 2**MAX_SEARCH_EXPONENT

# The non-private run each DP method is compared with (same parallelism, same checkpointing).
BASELINES = {"zero-dp": "nondp-fsdp", "v1": "nondp-cp", "v2": "nondp-cp", "v3": "nondp-cp-ac"}


@dataclass(frozen=True)
class Plan:
    """Memory and speed of one configuration, plus its non-private baseline's speed."""

    config: RunConfig
    memory: MemoryBreakdown
    step: StepTime | None
    baseline_tokens_per_second: float | None

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def peak_memory_gib(self) -> float:
        """Peak reserved memory per GPU (what TorchTitan reports)."""
        return self.memory.peak_gib

    @property
    def tokens_per_second_per_gpu(self) -> float | None:
        return self.step.tokens_per_second_per_gpu if self.step else None

    @property
    def dp_gap(self) -> float | None:
        """Non-private over private throughput (the paper's "gap"); ``None`` for non-private methods."""
        tps = self.tokens_per_second_per_gpu
        if self.baseline_tokens_per_second is None or not tps:
            return None
        return self.baseline_tokens_per_second / tps

    def to_dict(self) -> dict[str, object]:
        """JSON-ready summary: inputs echoed, verdict, peak memory with breakdown, throughput."""
        out: dict[str, object] = dict(self.config.inputs())
        out.update(
            activation_checkpointing=self.config.method.activation_checkpointing,
            fits=self.fits,
            peak_memory_gib=round(self.peak_memory_gib, 3),
            capacity_gib=round(self.memory.capacity / GIB, 3),
            peak_phase=self.memory.phase,
            breakdown_gib={k: round(v, 3) for k, v in self.memory.as_gib().items()},
            tokens_per_second_per_gpu=_round(self.tokens_per_second_per_gpu),
            mfu=_round(self.step.mfu, 4) if self.step else None,
            baseline_method=BASELINES.get(self.config.method.name),
            baseline_tokens_per_second_per_gpu=_round(self.baseline_tokens_per_second),
            dp_gap=_round(self.dp_gap, 3),
            step_end_seconds=_round(self.step.step_end, 4) if self.step else None,
        )
        return out


def plan_notes(p: Plan) -> tuple[str, ...]:
    """Notes on ``p``'s throughput where it leaves something out or DP comes out faster than non-DP."""
    notes = []
    step = p.step
    if step is not None and step.step_end:
        collective = "reduce-scattered" if p.config.shard_over == "all" else "all-reduced"
        notes.append(f"Note: once per optimizer step the clipped sums of the {p.config.data_parallel_size:.0f}"
                     f" data-parallel groups are {collective} ({step.step_end * 1e3:.3g} ms), amortised over the"
                     " logical batch's micro-batches like the optimizer step, so not in tokens/s.")
    if p.dp_gap is not None and p.dp_gap < 1:
        notes.append(f"Note: DP is predicted faster than non-DP ({p.dp_gap:.2f}x): the non-DP baseline reduce-scatters"
                     " fp32 gradients of the whole model every micro-batch, exposed where that and FSDP's all-gathers"
                     " exceed compute, while LongShield reduce-scatters each block's per-sample gradients over its CP"
                     " group behind the next block's backward and reduces its clipped sum once per optimizer step.")
    return tuple(notes)


def evaluate(cfg: RunConfig) -> Plan:
    """Memory, speed and DP/non-DP gap of one configuration."""
    baseline = BASELINES.get(cfg.method.name)
    baseline_tps = None
    if baseline is not None:
        step = estimate_step_time(cfg.replace(method=baseline, cp=cfg.cp_size, clipping="flat"))
        baseline_tps = step.tokens_per_second_per_gpu if step else None
    return Plan(cfg, estimate_memory(cfg), estimate_step_time(cfg), baseline_tps)


def plan(**inputs: object) -> Plan:
    """:func:`evaluate` straight from :func:`simulate.config.make_config` keyword inputs."""
    return evaluate(make_config(**inputs))  # type: ignore[arg-type]


def candidate_seq_lens(cp_size: int) -> list[int]:
    """Powers of two up to the search limit that a CP group of ``cp_size`` can split into ``2 x cp_size`` equal
    chunks; a CP size with none is refused."""
    if cp_size & (cp_size - 1):
        raise ValueError(f"CP size {cp_size} cannot split a power-of-two sequence into 2 x {cp_size} equal chunks; "
                         "use a power-of-two --cp that divides --gpus.")
    if 2 * cp_size > SEARCH_LIMIT:
        raise ValueError(f"CP size {cp_size} needs sequences of at least {2 * cp_size:,} tokens, beyond the search"
                         f" limit of {SEARCH_LIMIT:,}; use a --cp of at most {SEARCH_LIMIT // 2:,}.")
    return [2**k for k in range(MAX_SEARCH_EXPONENT + 1) if 2**k % (2 * cp_size) == 0]


def max_seq_len(**inputs: object) -> Plan | None:
    """The plan at the largest power-of-two sequence length that fits, or ``None`` if none does.

    Takes :func:`make_config`'s inputs without ``seq_len``. Memory grows with T, so this bisects.
    """
    probe = probe_config(**inputs)
    lengths = candidate_seq_lens(probe.cp_size)
    lo, hi = 0, len(lengths)  # invariant: lengths[:lo] fit, lengths[hi:] do not
    while lo < hi:
        mid = (lo + hi) // 2
        if estimate_memory(probe.replace(seq_len=lengths[mid])).fits:
            lo = mid + 1
        else:
            hi = mid
    return evaluate(probe.replace(seq_len=lengths[lo - 1])) if lo else None


def probe_config(**inputs: object) -> RunConfig:
    """A valid config from :func:`make_config`'s inputs without ``seq_len`` (at ``2 x CP`` tokens), for searches."""
    if "seq_len" in inputs:
        raise TypeError("This search chooses the sequence length itself; do not pass seq_len.")
    return make_config(**inputs, seq_len=2 * _cp_of(inputs))  # type: ignore[arg-type]


def recommend(model: str, gpus: int | float | str, seq_len: int, gpu: str = "h100",
              precision: str = "bf16-mixed", methods: tuple[str, ...] = DP_METHODS,
              mbs_options: tuple[int, ...] = MBS_OPTIONS, lora_rank: int = 0, clipping: str = "flat",
              per_layer_kernel: str = "torch", loss_chunk_tokens: LossChunking = "auto") -> list[Plan]:
    """Every (method, MBS, CP size) that fits ``seq_len`` as `LongShieldStrategy` runs it, fastest first (least
    memory first with infinite GPUs).

    Each LongShield method is planned as the strategy runs its arguments (`planned_as_run`, as the pre-flight
    check plans them), so a recommendation's peak is the one ``fit --config`` and the pre-flight check give;
    candidates that are the same run (V1 and V2 at MBS 1) are listed once. CP methods try every power-of-two CP size
    that divides the GPU count and splits ``seq_len`` evenly, below the GPU count with model states sharded over each
    CP group (the strategy's default) and over all GPUs (``shard_over="all"``). ``lora_rank``, ``clipping``,
    ``per_layer_kernel`` and ``loss_chunk_tokens`` are :func:`make_config`'s (``"triton"`` is answered as
    ``"auto"``, which fuses wherever ``"triton"`` would run and is never refused); a method they do not go with is
    skipped (an error when no method does).
    """
    kernel = "auto" if per_layer_kernel == "triton" else per_layer_kernel
    probe = make_config(model=model, gpus=gpus, method="nondp-fsdp", seq_len=seq_len, gpu=gpu, precision=precision,
                        lora_rank=lora_rank, per_layer_kernel=kernel, loss_chunk_tokens=loss_chunk_tokens)
    plans: dict[RunConfig, Plan] = {}
    for cfg in _candidates(probe, methods, mbs_options, clipping):
        if cfg not in plans and estimate_memory(cfg).fits:
            plans[cfg] = evaluate(cfg)
    return sorted(plans.values(), key=_rank_key)


def _candidates(probe: RunConfig, methods: tuple[str, ...], mbs_options: tuple[int, ...],
                clipping: str) -> list[RunConfig]:
    """``probe`` with every method, CP size, layout and MBS, each as the strategy runs it (`planned_as_run`); those
    not valid with ``probe``'s inputs are left out, and the first one's error is raised when none is valid."""
    candidates, errors = [], []
    for name in methods:
        for cp in _cp_sizes(probe, METHODS[name].context_parallel, probe.seq_len):
            if name == "v1" and cp == 1 and "v2" in methods:
                continue  # at CP 1 the strategy's V1 is V2's run (nothing to exchange), with a needless argument
            layouts = SHARD_OVER if cp is not None and cp < probe.num_gpus else (None,)
            for shard_over, mbs in itertools.product(layouts, mbs_options):
                try:
                    candidates.append(planned_as_run(probe.replace(method=name, mbs=mbs, cp=cp, clipping=clipping,
                                                                   shard_over=shard_over)))
                except ValueError as err:
                    errors.append(err)
    if errors and not candidates:
        raise errors[0]
    return candidates


def compare(model: str, gpus: int | float | str, gpu: str = "h100", precision: str = "bf16-mixed",
            methods: tuple[str, ...] = tuple(METHODS), mbs_options: tuple[int, ...] = MBS_OPTIONS,
            cp: int | None = None) -> list[tuple[str, int, Plan | None]]:
    """(method, MBS, plan at the largest fitting power-of-two T or ``None``) for every pair.

    With infinite GPUs and no ``cp``, CP methods have no CP size and are left out (the FSDP ceiling view).
    """
    unbounded = math.isinf(parse_gpus(gpus)) and cp is None
    if unbounded and all(METHODS[name].context_parallel for name in methods):
        raise ValueError("With --gpus inf, CP methods need a CP size: give --cp N, or compare zero-dp or nondp-fsdp"
                         " (the FSDP ceiling).")
    rows = []
    for name in methods:
        context_parallel = METHODS[name].context_parallel
        if context_parallel and unbounded:
            continue
        for mbs in mbs_options:
            rows.append((name, mbs, max_seq_len(model=model, gpus=gpus, method=name, mbs=mbs,
                                                cp=cp if context_parallel else None, gpu=gpu, precision=precision)))
    return rows


def _cp_of(inputs: dict[str, object]) -> int:
    """The CP size make_config will pick, to build a valid probe (2 x CP tokens)."""
    method = inputs.get("method", "v2")
    method = method if isinstance(method, MethodSpec) else METHODS.get(str(method))
    if method is None or not method.context_parallel:
        return 1
    cp = inputs.get("cp")
    if cp is not None:
        return int(cp)  # type: ignore[arg-type]
    gpus = parse_gpus(inputs.get("gpus", 4))  # type: ignore[arg-type]
    return 1 if math.isinf(gpus) else int(gpus)


def cp_sizes(gpus: int, seq_len: int | None = None) -> list[int]:
    """The candidate CP sizes on ``gpus`` GPUs: powers of two that divide it and (if given) cut ``seq_len`` into
    ``2 x CP`` equal chunks."""
    return [n for n in (2**k for k in range(gpus.bit_length()))
            if gpus % n == 0 and (seq_len is None or seq_len % (2 * n) == 0)]


def _cp_sizes(probe: RunConfig, context_parallel: bool, seq_len: int) -> list[int | None]:
    if not context_parallel:
        return [None]
    if math.isinf(probe.num_gpus):
        raise ValueError("Recommendations for CP methods need a finite --gpus (e.g. --gpus 8); with --gpus inf,"
                         " recommend --methods zero-dp alone (the FSDP ceiling).")
    return list(cp_sizes(int(probe.num_gpus), seq_len))


def _rank_key(p: Plan) -> tuple[float, float, bool]:
    """Fastest, then least memory, then the strategy's default exchange (V2; at CP 1 V1 is the same run and would
    only add a non-default argument)."""
    tps = p.tokens_per_second_per_gpu
    return (-tps if tps is not None else 0.0, p.peak_memory_gib, p.config.method.name != "v2")


def _round(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)
