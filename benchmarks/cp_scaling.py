"""Context-parallel scaling of LongShield DP-SGD (V1, V2, V2 output-stationary) against non-DP training. Prints JSON.

For every CP size (one data-parallel group; CP 1 is a single process) and method, fresh processes joined by a gloo
group train the same model on the same random tokens with the same parallelism (FSDP2 over the CP group, CP
attention, head-tail sequence sharding) and ``ACCUMULATION`` micro-batches per optimizer step:

- ``nondp``: Lightning's `ModelParallelStrategy` (its ``tensor_parallel`` mesh dimension is the CP group) with a
  `CausalLMModule` that applies LongShield's FSDP2 sharding and CP attention in ``configure_model`` and shards each
  micro-batch like the strategy; plain AdamW, gradient accumulation over the micro-batches.
- ``v1``: ``LongShieldStrategy(exchange="all_reduce")`` (per-sample gradients all-reduced over CP).
- ``v2``: ``LongShieldStrategy()`` (input-stationary: per-sample gradients reduce-scattered over CP).
- ``v2_os``: ``LongShieldStrategy(exchange="output_stationary")`` (all-to-all + all-gather of inputs).

Per configuration: peak RSS of each worker and its growth over the RSS after setup, the per-sample-gradient bytes
held after backward, the bytes passed to each kind of collective per optimizer step and the median step time, each
the maximum over ranks; plus the ratios of the DP methods to non-DP at every CP size. Example:

    python benchmarks/cp_scaling.py --seq-len 512 --cp-sizes 1 2 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from resident_memory import current_rss_bytes, peak_rss_bytes
from torch.distributed import ProcessGroup
from torch.utils.data import DataLoader, Dataset

from lightning_longshield import CausalLMModule, LongShieldStrategy
from lightning_longshield.context_parallel import apply_context_parallel_attention, shard_batch
from lightning_longshield.models import LlamaConfig
from lightning_longshield.parallelize import shard_with_fsdp

METHODS: dict[str, Optional[dict[str, Any]]] = {
    "nondp": None,
    "v1": {"exchange": "all_reduce"},
    "v2": {},
    "v2_os": {"exchange": "output_stationary"},
}
RATIOS = {
    "v1_over_nondp": ("v1", "nondp"),
    "v2_over_nondp": ("v2", "nondp"),
    "v2_os_over_nondp": ("v2_os", "nondp"),
    "v2_over_v1": ("v2", "v1"),
}
ACCUMULATION = 2  # micro-batches per optimizer step: logical batch = ACCUMULATION x micro-batch size
# Every torch.distributed collective ends in one of these ProcessGroup methods (its deprecated aliases, e.g.
# all_gather_into_tensor -> all_gather_single, and references captured at import time included).
COLLECTIVES = {
    "all_gather": (
        "allgather",
        "all_gather_single",
        "_allgather_base",
        "allgather_coalesced",
        "allgather_into_tensor_coalesced",
        "all_gather_single_coalesced",
    ),
    "reduce_scatter": (
        "reduce_scatter",
        "reduce_scatter_single",
        "_reduce_scatter_base",
        "reduce_scatter_tensor_coalesced",
        "reduce_scatter_single_coalesced",
    ),
    "all_reduce": ("allreduce", "allreduce_coalesced"),
    "all_to_all": ("alltoall", "alltoall_base", "all_to_all_single"),
    "broadcast": ("broadcast",),
}
NOTES = (
    "Same model, data, micro-batches and parallelism for every method at a CP size: FSDP2 over the CP group"
    " (lightning_longshield.parallelize.shard_with_fsdp, sum reduction), CP attention (K/V all-gathered over the CP"
    " group) and head-tail sequence sharding; at CP 1 FSDP2 on a one-rank mesh and the model's own attention (as"
    " LongShieldStrategy does)."
    " nondp is Lightning's ModelParallelStrategy (its tensor_parallel mesh dimension is the CP group) with the same"
    " CausalLMModule loss, plain AdamW and accumulate_grad_batches = micro-batches per step, so both sides pay the"
    " same Lightning loop overheads; FSDP2 reduce-scatters its gradients after every micro-batch. DP methods:"
    " noise_multiplier=1, max_grad_norm=1, fixed batches (poisson_sampling=False), the DataLoader yields the logical"
    " batch and the strategy splits it. At CP 1 v1, v2 and v2_os run the same code (no exchange). step_s: median"
    " over the timed steps of the time from the start of a step's first micro-batch to the end of its optimizer"
    " step (noise and AdamW included; epsilon logging between steps excluded), max over ranks; with repeats, the"
    " run with the smallest step_s. Memory: each configuration in fresh processes forked from a forkserver that"
    " preloaded lightning_longshield; peak_rss_mib is ru_maxrss at the end, peak_rss_growth_mib that minus the RSS"
    " at on_train_start (model sharded, optimizer built, AdamW state not yet allocated), max over ranks; RSS follows"
    " the allocator, not tensor lifetimes. per_sample_grad_bytes: strategy.dp_engine.last_held_bytes after the last"
    " backward. comm_bytes_per_step: bytes handed to torch.distributed ProcessGroup collective methods (where every"
    " torch.distributed function ends, so deprecated aliases such as all_gather_into_tensor -> all_gather_single"
    " and functions captured at import time are counted once each), per timed step: all_gather counts the gathered"
    " output, reduce_scatter the unreduced input, all_reduce and broadcast the tensor, all_to_all the input (a ring"
    " moves (N-1)/N of that per rank, 2(N-1)/N for all_reduce); the small all_reduce of DP methods is the per-sample"
    " squared norms (V2) and the CP-summed loss for logging, broadcast is Lightning's 8-byte SIGTERM flag per"
    " training_step call. Every rank runs torch_threads_per_rank intra-op threads (default 1: multi-threaded ranks"
    " on a busy machine spin in OpenMP barriers and their times scatter far more); with CP 4 on 2 cores two ranks"
    " share a core, so step times compare methods at one CP size; across CP sizes they show contention and gloo"
    " copies, not scaling."
)


@dataclass(frozen=True)
class Run:
    """One configuration, as its worker processes see it."""

    method: str
    world_size: int
    seq_len: int
    micro_batch_size: int
    warmup: int
    steps: int
    threads: int
    out_dir: str


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (total over the CP group)")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--warmup", type=int, default=1, help="optimizer steps not timed (at least 1)")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    parser.add_argument("--threads-per-rank", type=int, default=1, help="torch intra-op threads of every rank")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every configuration, interleaved")
    args = parser.parse_args(argv)
    if min(args.warmup, args.steps, args.micro_batch_size, args.threads_per_rank, args.repeats, *args.cp_sizes) < 1:
        parser.error("--warmup, --steps, --micro-batch-size, --threads-per-rank, --repeats, --cp-sizes must be >= 1")
    return args


# ---------------------------------------------------------------------------- measurement inside a worker


class CommunicationCounter:
    """Bytes handed to each kind of collective by this process (see `COLLECTIVES`)."""

    def __init__(self) -> None:
        self.bytes = dict.fromkeys(COLLECTIVES, 0)

    def install(self) -> None:
        """Wrap the ProcessGroup collective methods of this process (for the rest of its life)."""
        for kind, names in COLLECTIVES.items():
            for name in names:
                original = getattr(ProcessGroup, name, None)
                if original is not None:
                    setattr(ProcessGroup, name, self._counting(kind, original))

    def _counting(self, kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(group: ProcessGroup, *args: Any, **kwargs: Any) -> Any:
            # (output, input, ...) or (tensors, options): the larger buffer of the first two arguments.
            self.bytes[kind] += max((_nbytes(arg) for arg in args[:2]), default=0)
            return original(group, *args, **kwargs)

        return counted


def _nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a tensor or nested lists of tensors; anything else counts 0)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(item) for item in value)
    return 0


class StepProbe(Callback):
    """The RSS after setup; time and communication at the start of every optimizer step's first micro-batch and
    at the end of its last (so the loop's work between steps, e.g. logging epsilon, is not counted)."""

    def __init__(self, counter: CommunicationCounter) -> None:
        self.counter = counter
        self.setup_rss = 0
        self.starts: list[tuple[float, dict[str, int]]] = []
        self.ends: list[tuple[float, dict[str, int]]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.setup_rss = current_rss_bytes()

    def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
        if trainer.global_step == len(self.starts):
            self.starts.append((time.perf_counter(), dict(self.counter.bytes)))

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        if trainer.global_step > len(self.ends):
            self.ends.append((time.perf_counter(), dict(self.counter.bytes)))

    def timed(self, warmup: int, count: int) -> tuple[list[float], dict[str, float]]:
        """Durations of the ``count`` steps after ``warmup`` and their communication per step, by kind."""
        steps = list(zip(self.starts, self.ends))[warmup:warmup + count]
        durations = [end - start for (start, _), (end, _) in steps]
        per_step = {
            kind: sum(end[kind] - start[kind] for (_, start), (_, end) in steps) / len(steps) for kind in COLLECTIVES
        }
        return durations, per_step


class NonDPModule(CausalLMModule):
    """`CausalLMModule` with LongShield's parallelism applied by the module, for `ModelParallelStrategy`."""

    def configure_model(self) -> None:
        super().configure_model()
        context_parallel = self.device_mesh["tensor_parallel"]
        if context_parallel.size() > 1:
            apply_context_parallel_attention(self, context_parallel.get_group())
        shard_with_fsdp(self, context_parallel)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        context_parallel = self.device_mesh["tensor_parallel"]
        if context_parallel.size() > 1:
            batch = shard_batch(batch, context_parallel.get_local_rank(), context_parallel.size())
        return super().training_step(batch, batch_idx)


class RandomTokens(Dataset):
    """``size`` samples of ``seq_len`` random tokens (labels: the next token)."""

    def __init__(self, size: int, seq_len: int, vocab_size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, vocab_size, (size, seq_len + 1), generator=generator)

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index, :-1], "labels": self.rows[index, 1:]}


def _strategy_and_module(run: Run, config: LlamaConfig) -> tuple[Any, CausalLMModule]:
    """The method's strategy and a freshly seeded module (the model is built by the strategy's setup)."""
    torch.manual_seed(0)
    strategy_kwargs = METHODS[run.method]
    if strategy_kwargs is None:
        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=run.world_size)
        return strategy, NonDPModule(config, optimizer="adamw", learning_rate=1e-4)
    strategy = LongShieldStrategy(
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        micro_batch_size=run.micro_batch_size,
        poisson_sampling=False,
        seed=0,
        **strategy_kwargs,
    )
    return strategy, CausalLMModule(config, optimizer="adamw", learning_rate=1e-4)


def train(run: Run, counter: CommunicationCounter) -> dict[str, Any]:
    """Fit warmup + steps optimizer steps, and one more, not timed (the privacy monitor computes epsilon at the end
    of a fit's last step, before the probe's end of that step); this rank's measurements."""
    tiny = LlamaConfig.from_name("tiny")
    config = replace(tiny, max_seq_len=max(tiny.max_seq_len, run.seq_len))
    strategy, module = _strategy_and_module(run, config)
    dp = METHODS[run.method] is not None
    logical = ACCUMULATION * run.micro_batch_size
    total_steps = run.warmup + run.steps + 1
    probe = StepProbe(counter)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=run.world_size,
        max_steps=total_steps,
        accumulate_grad_batches=1 if dp else ACCUMULATION,
        callbacks=[probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    dataset = RandomTokens(total_steps * logical, run.seq_len, config.vocab_size)
    trainer.fit(module, DataLoader(dataset, batch_size=logical if dp else run.micro_batch_size))
    durations, communicated = probe.timed(run.warmup, run.steps)
    return {
        "step_s": statistics.median(durations),
        "peak_rss": peak_rss_bytes(),
        "peak_rss_growth": peak_rss_bytes() - probe.setup_rss,
        "per_sample_grad_bytes": strategy.dp_engine.last_held_bytes if dp else 0,
        "comm_bytes_per_step": communicated,
    }


def worker(rank: int, run: Run, store_path: str) -> None:
    """One rank of a configuration: join the gloo group, train, write this rank's measurements."""
    # Lightning sees an externally launched process (like torchrun) and reuses the initialised group.
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(run.world_size))
    torch.set_num_threads(run.threads)
    counter = CommunicationCounter()
    counter.install()
    store = dist.FileStore(store_path, run.world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=run.world_size, timeout=timedelta(minutes=10))
    try:
        Path(run.out_dir, f"rank{rank}.json").write_text(json.dumps(train(run, counter)))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- driver: fresh processes per configuration


def measure(args: argparse.Namespace, method: str, cp_size: int) -> dict[str, Any]:
    """Run one configuration on ``cp_size`` fresh processes; the maximum of every measurement over ranks."""
    with tempfile.TemporaryDirectory() as out_dir:
        run = Run(
            method,
            cp_size,
            args.seq_len,
            args.micro_batch_size,
            args.warmup,
            args.steps,
            args.threads_per_rank,
            out_dir,
        )
        mp.start_processes(
            worker, args=(run, str(Path(out_dir, "store"))), nprocs=cp_size, join=True, start_method="forkserver"
        )
        ranks = [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(cp_size)]
    return {
        "cp_size": cp_size,
        "method": method,
        "step_s": round(max(r["step_s"] for r in ranks), 4),
        "peak_rss_mib": round(max(r["peak_rss"] for r in ranks) / 2**20, 1),
        "peak_rss_growth_mib": round(max(r["peak_rss_growth"] for r in ranks) / 2**20, 1),
        "per_sample_grad_bytes": max(r["per_sample_grad_bytes"] for r in ranks),
        "comm_bytes_per_step": {
            kind: round(max(r["comm_bytes_per_step"][kind] for r in ranks)) for kind in COLLECTIVES
        },
    }


def ratios(results: list[dict[str, Any]], cp_size: int) -> dict[str, dict[str, Optional[float]]]:
    """Step-time and peak-RSS-growth ratios of the methods measured at ``cp_size``."""
    by_method = {r["method"]: r for r in results if r["cp_size"] == cp_size}

    def ratio(key: str, numerator: str, denominator: str) -> Optional[float]:
        if numerator not in by_method or denominator not in by_method or not by_method[denominator][key]:
            return None
        return round(by_method[numerator][key] / by_method[denominator][key], 3)

    return {
        key: {name: ratio(key, *pair) for name, pair in RATIOS.items()} for key in ("step_s", "peak_rss_growth_mib")
    }


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    mp.get_context("forkserver").set_forkserver_preload(["lightning_longshield"])
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for _ in range(args.repeats):
        for cp_size in args.cp_sizes:
            for method in args.methods:
                runs.setdefault((cp_size, method), []).append(measure(args, method, cp_size))
    # Other load on the machine only ever adds time: keep each configuration's least disturbed run.
    results = [min(repeated, key=lambda result: result["step_s"]) for repeated in runs.values()]
    config = {
        "preset": "tiny",
        "seq_len": args.seq_len,
        "micro_batch_size": args.micro_batch_size,
        "logical_batch_size": ACCUMULATION * args.micro_batch_size,
        "cp_sizes": args.cp_sizes,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "repeats": args.repeats,
        "torch_threads_per_rank": args.threads_per_rank,
        "noise_multiplier": 1.0,
        "max_grad_norm": 1.0,
        "cpu_cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "lightning": L.__version__,
    }
    output = {
        "config": config,
        "results": results,
        "ratios": {str(cp_size): ratios(results, cp_size) for cp_size in args.cp_sizes},
        "notes": NOTES,
    }
    print(json.dumps(output, indent=2))


if __name__ == "__main__":
    main()
