"""Cost of DP-SGD per optimizer step: LongShield and Opacus, each against a matching non-DP loop. Prints JSON.

These loops train the same model on the same micro-batches, ``--accumulation`` micro-batches per optimizer step:

- ``longshield``: Lightning + `LongShieldStrategy` (noise_multiplier=1, fixed batches: poisson_sampling=False);
  the DataLoader yields logical batches and the strategy splits them into micro-batches. ``longshield_v3`` is the
  same with every block's activations checkpointed (``activation_checkpointing=True``).
- ``nondp_lightning``: the same Lightning loop with the default single-device strategy; the DataLoader yields
  micro-batches and ``accumulate_grad_batches`` makes the same number of forward/backward passes per step.
- ``opacus``: a plain PyTorch loop with Opacus ``make_private(grad_sample_mode="hooks")`` and its
  ``BatchMemoryManager`` splitting logical batches into micro-batches.
- ``nondp_torch``: the same plain loop without Opacus, accumulating gradients over the micro-batches.
- ``zero_dp_plus``: the ``longshield`` loop with ``norms="mixed"`` and ``shard_over="all"`` (on one process:
  mixed ghost norms with book-keeping; the paper's ZeRO-DP+ baseline).
- ``opacus_ghost``: the Opacus loop with ``grad_sample_mode="ghost"`` (ghost norms, a second backward pass).
- ``longshield_per_layer``: the ``longshield`` loop with ``clipping="per_layer"`` (equal thresholds) and
  ``PerLayerClipping(kernel="torch")``: per-sample gradients materialised, clipped and freed one layer at a time.
- ``longshield_per_layer_fused``: the same with ``PerLayerClipping(kernel="triton")``: linear weights through the fused
  Triton kernel (no per-sample gradient in memory). CUDA only.
- ``longshield_hutchinson``: the ``longshield`` loop with randomized clipping, ``ProjectedNorms("hutchinson",
  projection_dim=32)`` (estimated norms of linear weights, book-kept clipped sums).

Every (loop, micro-batch size) runs in a fresh process (forked from a server that only imported the libraries), so
peak memory is measured in isolation: the most bytes of tensors alive at once during training, on CUDA
``max_memory_allocated`` above the memory allocated just before training (and ``max_memory_reserved``), on CPU
the peak of what the CPU allocator reports to the profiler over a separate, untimed run of two optimizer steps (the
same quantity). A last optimizer step is not timed: the privacy
monitor computes epsilon at the end of a fit's last step. On CPU the growth of peak RSS (``ru_maxrss``) from
just before training is reported too, as ``peak_rss``: it also counts what the C allocator keeps after a free and
the pages of libraries first used during training, so it says little about what a loop holds. The LongShield loops
also report the most per-sample-gradient bytes the DP engine held at once, ``opacus`` the size of its
``grad_sample`` tensors. They also time one step's noise alone (the engine's keyed draws into a tensor per
parameter) and report ``<loop>_noise_floor_over_nondp``: non-DP's step plus that noise, over non-DP's step, the
ratio no DP-SGD implementation can go below on that machine. The loops that clip materialised per-sample
gradients (``longshield``, ``longshield_v3``, ``longshield_per_layer``) also time the least work clipping adds to
non-DP's step, on fp32 tensors of the parameters' shapes allocated beforehand: at micro-batch size 1 one read of each
gradient (its norm; the scaled add replaces non-DP's accumulation), above 1 one write and two reads of a
``(B, *shape)`` tensor per parameter (the per-sample gradients written where non-DP writes one gradient, read for the
norms, read again for the clipped sum), and report ``<loop>_passes_floor_over_nondp``: non-DP's step plus the noise
and those passes for every micro-batch, over non-DP's step: the floor of any such clipping on that machine (not
reported where those B copies of the parameters do not fit beside the trained state). Both floors are timed after
the loop's memory is measured, so their buffers count in neither figure.
Step time is the median over ``--steps`` optimizer steps after
``--warmup`` steps; with ``--repeats`` every configuration runs that many times, interleaved, and the least
disturbed (minimum) measurement is reported. A machine that runs a whole process faster or slower than another
makes a ratio of two processes' times unreliable: with ``--same-process`` every DP loop's process then also runs its
non-DP loop twice and itself once more (DP, non-DP, non-DP, DP: a drift of the process's speed weighs on both; the
DP loop's peak memory is measured in its first run, before the others), and ``<loop>_over_nondp_same_process`` is the
median over the repeats of the ratio of the two loops' median step times within one process. Example:

    python benchmarks/dp_overhead.py --seq-len 256 --micro-batch-sizes 1 4 --steps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from forked_workers import exit_code_of, redirect_output
from lightning.pytorch.callbacks import Callback
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import wrap_data_loader
from resident_memory import peak_rss_bytes
from torch._C._profiler import _EventType
from torch.utils.data import DataLoader, Dataset

from lightning_longshield import CausalLMModule, LongShieldStrategy, PerLayerClipping, ProjectedNorms
from lightning_longshield.loss import causal_lm_loss
from lightning_longshield.models import Llama, LlamaConfig
from lightning_longshield.privacy.shards import local_tensor
from lightning_longshield.text_data import python_stdlib_corpus

METHODS = ("nondp_lightning", "longshield", "longshield_v3", "zero_dp_plus", "longshield_per_layer",
           "longshield_per_layer_fused", "longshield_hutchinson", "nondp_torch", "opacus", "opacus_ghost")
LIGHTNING_DP = ("longshield", "longshield_v3", "zero_dp_plus", "longshield_per_layer", "longshield_per_layer_fused",
                "longshield_hutchinson")
CUDA_ONLY = ("longshield_per_layer_fused",)
#: Loops that clip per-sample gradients formed in memory at micro-batch sizes above 1 (all of them at once, or a layer
#: at a time), and ``.grad`` at micro-batch size 1.
MATERIALISING = ("longshield", "longshield_v3", "longshield_per_layer")
# LongShieldStrategy arguments of each Lightning DP loop beyond the shared ones
STRATEGY_OPTIONS: dict[str, dict[str, Any]] = {
    "longshield_v3": dict(activation_checkpointing=True),
    "zero_dp_plus": dict(norms="mixed", shard_over="all"),
    "longshield_per_layer": dict(clipping=PerLayerClipping(kernel="torch")),
    "longshield_per_layer_fused": dict(clipping=PerLayerClipping(kernel="triton")),
    "longshield_hutchinson": dict(norms=ProjectedNorms("hutchinson", projection_dim=32)),
}
PRECISIONS = ("32-true", "bf16-mixed")
#: The non-DP loop each DP loop is compared with.
BASELINES = {
    **{method: "nondp_lightning" for method in LIGHTNING_DP},
    "opacus": "nondp_torch",
    "opacus_ghost": "nondp_torch",
}
NOTES = (
    "Ratios compare each DP loop with its own non-DP loop: longshield with nondp_lightning (same Lightning loop,"
    " accumulate_grad_batches = micro-batches per step), opacus (hooks, BatchMemoryManager) with nondp_torch (same"
    " plain PyTorch loop with gradient accumulation). Every optimizer step runs the same forward/backward passes"
    " over the same samples: logical batch = accumulation x micro_batch_size, fixed batches (no Poisson"
    " sampling), noise_multiplier=1, max_grad_norm=1, AdamW, the given precision. Step time: median seconds per"
    " optimizer step"
    " after warm-up. Peak memory: each run in a fresh process, the most bytes of tensors alive at once during"
    " training (optimizer states, activations, gradients, per-sample gradients): on CUDA max_memory_allocated above"
    " the pre-training allocation, on CPU the CPU allocator's peak over two profiled optimizer steps; peak_rss (CPU)"
    " is the growth of peak RSS, which also counts what the C allocator keeps after frees. Every configuration"
    " runs `repeats` times, interleaved, and the minimum of each measurement is reported. With micro_batch_size=1"
    " LongShield needs no per-sample-gradient buffer (the micro-batch gradient is the per-sample gradient);"
    " Opacus always materialises grad_sample."
)


class _Samples(Dataset):
    """``{"input_ids", "labels"}`` views of (N, T + 1) token rows."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index, :-1], "labels": self.rows[index, 1:]}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="LlamaConfig preset")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--data", choices=("random", "stdlib"), default="random")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps not timed (at least 1)")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    parser.add_argument("--repeats", type=int, default=2, help="runs of every configuration, interleaved")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", choices=PRECISIONS, default="32-true",
                        help="fp32, or bf16 autocast over fp32 parameters (default: %(default)s)")
    parser.add_argument("--methods", nargs="+", choices=METHODS,
                        default=["nondp_lightning", "longshield", "nondp_torch", "opacus"])
    parser.add_argument("--profile-dir", help="Lightning loops: profile one more optimizer step after the timed ones "
                        "(torch.profiler); write its table of kernels by self time and its Chrome trace here")
    parser.add_argument("--same-process", action="store_true",
                        help="also time each DP loop's non-DP loop in the DP loop's process (see above)")
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--micro-batch-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.warmup, args.steps, args.repeats, args.accumulation) < 1:
        parser.error("--warmup, --steps, --repeats and --accumulation must be >= 1")
    cuda_only = sorted(set(CUDA_ONLY) & {*args.methods, args.worker})
    if cuda_only and args.device != "cuda":
        parser.error(f"{', '.join(cuda_only)} runs the fused Triton kernel, which needs CUDA: pass --device cuda")
    return args


# ---------------------------------------------------------------------------- worker: one loop in this process


def _dataset(args: argparse.Namespace, size: int) -> Dataset:
    window = args.seq_len + 1
    if args.data == "random":
        rows = torch.randint(0, 256, (size, window), generator=torch.Generator().manual_seed(0))
    else:
        data = python_stdlib_corpus(max_bytes=size * window).encode("utf-8")
        if len(data) < size * window:
            raise ValueError(f"The standard library holds fewer than {size} windows of {window} bytes.")
        rows = torch.frombuffer(bytearray(data), dtype=torch.uint8).long().view(size, window)
    return _Samples(rows)


def _config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig.from_name(args.preset)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class _ProfileLastStep(Callback):
    """Profiles the optimizer step after the ``timed_steps`` timed ones and writes its table of operators by self time
    (the device's where there is one) and its Chrome trace to ``--profile-dir``; the profiled step is not timed."""

    def __init__(self, args: argparse.Namespace, timed_steps: int) -> None:
        self.args, self.timed_steps = args, timed_steps
        self.profiler: Optional[torch.profiler.profile] = None
        self.written = False

    def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
        if trainer.global_step == self.timed_steps and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.args.device == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        if self.profiler is None or self.written or trainer.global_step != self.timed_steps + 1:
            return
        self.written = True  # the step's later hooks (and a repeated hook) see the same global step
        _synchronize(self.args.device)
        self.profiler.__exit__(None, None, None)
        sort_by = "self_cuda_time_total" if self.args.device == "cuda" else "self_cpu_time_total"
        name = f"{self.args.worker}_T{self.args.seq_len}_mbs{self.args.micro_batch_size}.txt"
        Path(self.args.profile_dir).mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(Path(self.args.profile_dir) / name.replace(".txt", ".trace.json")))
        table = self.profiler.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=60)
        (Path(self.args.profile_dir) / name).write_text(table)


def _lightning_step_ends(
    args: argparse.Namespace, dataset: Dataset, dp: bool, total_steps: int, held: dict[str, Any]
) -> list[float]:
    ends: list[float] = []

    class StepEnds(Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
            if trainer.global_step > len(ends):
                _synchronize(args.device)
                ends.append(time.perf_counter())

    callbacks: list[Callback] = [StepEnds()]
    if args.profile_dir:
        callbacks.append(_ProfileLastStep(args, total_steps))
        total_steps += 1
    total_steps += 1  # a last step, not timed: the privacy monitor computes epsilon at the end of a fit's last step
    micro, logical = args.micro_batch_size, args.micro_batch_size * args.accumulation
    if dp:
        strategy: Any = LongShieldStrategy(
            noise_multiplier=1.0, max_grad_norm=1.0, micro_batch_size=micro, poisson_sampling=False, seed=0,
            **STRATEGY_OPTIONS.get(args.worker, {}),
        )
        loader, accumulation = DataLoader(dataset, batch_size=logical), 1
    else:
        strategy, loader, accumulation = "auto", DataLoader(dataset, batch_size=micro), args.accumulation
    torch.manual_seed(0)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=1,
        max_steps=total_steps,
        precision=args.precision,
        accumulate_grad_batches=accumulation,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(CausalLMModule(_config(args), optimizer="adamw", learning_rate=1e-4), loader)
    if dp:  # what the DP engine held for the last micro-batch (per-layer clipping: the most at once)
        held["per_sample_grad_bytes"] = strategy.dp_engine.last_held_bytes
        held["bookkept_bytes"] = strategy.dp_engine.last_bookkept_bytes
        held["engine"] = strategy.dp_engine  # its floors are timed once the loop's memory is measured
    return ends


def _floor_seconds(engine: Any, args: argparse.Namespace) -> dict[str, float]:
    """The noise alone, and for the loops that clip materialised per-sample gradients the least clipping work, timed
    apart after the loop (their buffers would count in its memory)."""
    floors = {"noise_s": _noise_draw_seconds(engine, args.device)}
    if args.worker in MATERIALISING:
        try:
            floors["passes_s"] = _clipping_pass_seconds(engine, args.micro_batch_size, args.device)
        except torch.OutOfMemoryError:  # B copies of every parameter beside the trained state: no floor then
            torch.cuda.empty_cache()
    return floors


def _noise_draw_seconds(engine: Any, device: str, repeats: int = 5, warmup: int = 3) -> float:
    """Median time of one step's noise alone: the release's keyed draws, as many values as trainable parameters,
    drawn as the release draws them (into fp32 tensors of the parameters' shapes, allocated beforehand) and added
    to those tensors: the part of a DP step no implementation can skip. The first ``warmup`` draws are not timed: in
    the loop every release but the first follows another (on CPU the first few draws here took 13-18 ms where the
    later ones, and the releases in the loop, took 10-12)."""
    totals = [torch.zeros(local_tensor(param).shape, device=device) for param in engine.capture.parameters.values()]

    def draw(step: int) -> None:
        engine.noise.start_step(10**9 + step)  # any step number: only the time is kept
        engine.noise.add_to_scaled_all(totals, 1.0, 1.0)

    return _median_seconds(draw, device, repeats, warmup)


def _clipping_pass_seconds(engine: Any, micro_batch_size: int, device: str, repeats: int = 5,
                           warmup: int = 2) -> float:
    """Median time of the least work clipping adds to a micro-batch of non-DP's step, on fp32 tensors allocated
    beforehand. One sample: a read of every gradient (its norm; the scaled add takes the place of non-DP's
    accumulation). More: for every trainable parameter one write of a ``(B, *shape)`` tensor and two reads of it (its
    per-sample L2 norms, and its sum over the samples into a tensor of the parameter's shape): what non-DP does not
    do, up to its own write of one gradient."""
    shapes = [local_tensor(param).shape for param in engine.capture.parameters.values()]
    samples = [torch.ones(micro_batch_size, *shape, device=device) for shape in shapes]
    totals = [torch.empty(shape, device=device) for shape in shapes]

    def passes(_: int) -> None:
        for sample, total in zip(samples, totals):
            rows = sample.view(micro_batch_size, -1)
            if micro_batch_size == 1:
                torch.linalg.vector_norm(rows, dim=1)
                continue
            sample.fill_(1.0)
            torch.linalg.vector_norm(rows, dim=1)
            torch.sum(sample, 0, out=total)

    return _median_seconds(passes, device, repeats, warmup)


def _median_seconds(call: Callable[[int], None], device: str, repeats: int, warmup: int) -> float:
    """Median seconds of ``call(i)`` for ``i`` in ``0 .. repeats - 1``, after ``warmup`` untimed calls (negative
    ``i``), each synchronised with the device."""
    times = []
    for step in range(-warmup, repeats):
        _synchronize(device)
        start = time.perf_counter()
        call(step)
        _synchronize(device)
        if step >= 0:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _torch_step_ends(
    args: argparse.Namespace, dataset: Dataset, dp: bool, total_steps: int, held: dict[str, Any]
) -> list[float]:
    torch.manual_seed(0)
    model = Llama(_config(args)).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    micro, logical = args.micro_batch_size, args.micro_batch_size * args.accumulation
    loader = DataLoader(dataset, batch_size=micro)
    scale = 1.0 / args.accumulation
    criterion: Any = causal_lm_loss
    if dp:
        ghost = args.worker == "opacus_ghost"
        private = PrivacyEngine().make_private(
            module=model,
            optimizer=optimizer,
            data_loader=DataLoader(dataset, batch_size=logical),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
            grad_sample_mode="ghost" if ghost else "hooks",
            **(dict(criterion=torch.nn.CrossEntropyLoss(ignore_index=-100)) if ghost else {}),
        )
        if ghost:  # per-sample mean token losses through Opacus's criterion; its backward runs two passes
            model, optimizer, ghost_criterion, logical_loader = private

            def criterion(logits: torch.Tensor, labels: torch.Tensor) -> Any:
                return ghost_criterion(logits.flatten(0, 1).float(), labels.flatten(), shape=logits.shape)
        else:
            model, optimizer, logical_loader = private
        # What BatchMemoryManager does: the DP optimizer clips and sums micro-batches until a logical batch ends,
        # then divides by the logical batch size, so the loss is not scaled by the accumulation.
        loader = wrap_data_loader(data_loader=logical_loader, max_batch_size=micro, optimizer=optimizer)
        scale = 1.0
    ends: list[float] = []
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed")
    for index, batch in enumerate(loader):
        input_ids, labels = batch["input_ids"].to(args.device), batch["labels"].to(args.device)
        with autocast:
            loss = criterion(model(input_ids), labels)
        (loss * scale).backward()
        if args.worker == "opacus":  # every layer's grad_sample, held until the optimizer clips them
            held["per_sample_grad_bytes"] = sum(
                p.grad_sample.numel() * p.grad_sample.element_size()
                for p in model.parameters() if isinstance(getattr(p, "grad_sample", None), torch.Tensor)
            )
        if dp:
            optimizer.step()  # a no-op (clip and accumulate only) until the logical batch's last micro-batch
            optimizer.zero_grad()
        if (index + 1) % args.accumulation:
            continue
        if not dp:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        _synchronize(args.device)
        ends.append(time.perf_counter())
        if len(ends) == total_steps:
            break
    return ends


def _peak_tensor_bytes_on_cpu(args: argparse.Namespace, dataset: Dataset, dp: bool) -> int:
    """The most bytes of CPU tensors alive at once over two optimizer steps of the loop (the second has the
    optimizer's states), as the CPU allocator reports them to the profiler: only allocations made while it records
    count, so the run is a fresh one, built under it. Not timed."""
    args = argparse.Namespace(**{**vars(args), "profile_dir": None})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        _loop(args)(args, dataset, dp, 2, {})
    peak, pending = 0, list(profiler.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        if event.tag == _EventType.Allocation:
            peak = max(peak, event.extra_fields.total_allocated)
        pending.extend(event.children)
    return peak


def run_worker(args: argparse.Namespace) -> dict[str, float]:
    """Train with one loop for warmup + steps + 1 optimizer steps; median step time and peak tensor memory (on CUDA
    also the peak reserved by the caching allocator, on CPU also the growth of peak RSS)."""
    total_steps = args.warmup + args.steps + 1
    dataset = _dataset(args, total_steps * args.accumulation * args.micro_batch_size)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        baseline = peak_rss_bytes()
    dp = args.worker in BASELINES
    held: dict[str, Any] = {}
    durations = _step_durations(args, dataset, dp, total_steps, held)
    engine = held.pop("engine", None)
    result = {"step_s": statistics.median(durations), **held}
    if args.device == "cuda":
        result["peak_mem_bytes"] = torch.cuda.max_memory_allocated() - baseline
        result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    else:
        result["peak_rss_bytes"] = peak_rss_bytes() - baseline
    if engine is not None:  # its memory is measured; then freed, with its model, before any other loop runs
        result.update(_floor_seconds(engine, args))
        del engine
    if dp and args.same_process:  # after the DP loop: its peak memory is already measured
        result["same_process_over_nondp"] = _same_process_ratio(args, dataset, total_steps, durations)
    if args.device == "cpu":  # last: the profiler's records would add to the peak RSS
        result["peak_mem_bytes"] = _peak_tensor_bytes_on_cpu(args, dataset, dp)
    return result


def _same_process_ratio(
    args: argparse.Namespace, dataset: Dataset, total_steps: int, dp_durations: list[float]
) -> float:
    """The DP loop's median step time over its non-DP loop's, both timed in this process in the order DP (already
    run: ``dp_durations``), non-DP, non-DP, DP, so that a drift of this process's speed, or what one loop leaves
    behind for the next, weighs on both alike."""
    again = argparse.Namespace(**{**vars(args), "profile_dir": None})
    nondp = argparse.Namespace(**{**vars(again), "worker": BASELINES[args.worker]})
    nondp_durations = [step for _ in range(2) for step in _step_durations(nondp, dataset, False, total_steps, {})]
    dp_durations = [*dp_durations, *_step_durations(again, dataset, True, total_steps, {})]
    return statistics.median(dp_durations) / statistics.median(nondp_durations)


def _step_durations(
    args: argparse.Namespace, dataset: Dataset, dp: bool, total_steps: int, held: dict[str, Any]
) -> list[float]:
    """Seconds of each timed optimizer step of the loop ``args.worker``."""
    ends = _loop(args)(args, dataset, dp, total_steps, held)[:total_steps]  # a profiled step after these: not timed
    return [b - a for a, b in zip(ends, ends[1:])][args.warmup :]


def _loop(args: argparse.Namespace) -> Callable[..., list[float]]:
    """The function that runs ``args.worker``'s training loop and returns its optimizer steps' end times."""
    return _torch_step_ends if args.worker in ("nondp_torch", "opacus", "opacus_ghost") else _lightning_step_ends


# ---------------------------------------------------------------------------- driver: one fresh process per config


class WorkerFailed(RuntimeError):
    """A measured configuration's process failed; ``out_of_memory`` says whether it ran out of device memory."""

    def __init__(self, message: str, out_of_memory: bool) -> None:
        super().__init__(message)
        self.out_of_memory = out_of_memory


#: Seconds one configuration's process may run: a process stuck in a collective or a driver call fails the
#: benchmark instead of stalling it (a 1B model's T 16384 step on an H100 takes a few seconds).
WORKER_TIMEOUT_S = 900


def measure(method: str, micro_batch_size: int, argv: list[str]) -> dict[str, float]:
    """Run one configuration in a fresh process (``argv``: this script's flags; `forked_workers`) and return its
    measurements."""
    import dp_overhead  # by name (also where this file runs as the script): the target's module in the worker

    worker_argv = [*argv, "--worker", method, "--micro-batch-size", str(micro_batch_size)]
    with tempfile.TemporaryDirectory() as folder:
        stdout_path, stderr_path = Path(folder, "stdout"), Path(folder, "stderr")
        exit_code = exit_code_of(dp_overhead.run_forked_worker, (worker_argv, str(stdout_path), str(stderr_path)),
                                 WORKER_TIMEOUT_S)
        stdout = stdout_path.read_text(errors="replace") if stdout_path.exists() else ""
        stderr = stderr_path.read_text(errors="replace") if stderr_path.exists() else ""
    if exit_code is None:
        raise WorkerFailed(f"{method} (micro_batch_size={micro_batch_size}) ran past {WORKER_TIMEOUT_S} s:\n"
                           f"{stderr[-4000:]}", out_of_memory=False)
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if exit_code != 0 or not lines:
        raise WorkerFailed(f"{method} (micro_batch_size={micro_batch_size}) failed:\n{stderr[-4000:]}",
                           out_of_memory="OutOfMemoryError" in stderr)
    return json.loads(lines[-1])


def run_forked_worker(argv: list[str], stdout_path: str, stderr_path: str) -> None:
    """A configuration's process: its standard output and error go to the two files."""
    redirect_output(stdout_path, stderr_path)
    main(argv)


def largest_within_budget(
    candidates: list[int], budget_mib: float, peak_bytes: Callable[[int], float]
) -> tuple[Optional[int], dict[int, float]]:
    """The largest of ``candidates`` (tried in increasing order) whose ``peak_bytes(candidate)`` stays within
    ``budget_mib``, and the peaks measured (MiB); the search stops at the first over the budget or out of memory."""
    largest, peaks = None, {}
    for candidate in sorted(candidates):
        try:
            peak = peak_bytes(candidate)
        except WorkerFailed as failure:
            if not failure.out_of_memory:
                raise
            break
        peaks[candidate] = round(peak / 2**20, 1)
        if peak > budget_mib * 2**20:
            break
        largest = candidate
    return largest, peaks


def _least_disturbed(runs: list[dict[str, float]]) -> dict[str, float]:
    """Minimum of each measurement over repeated runs (interference from other work only ever adds time); the
    median of a within-process ratio, which interference can move either way."""
    return {key: (statistics.median if key == "same_process_over_nondp" else min)(run[key] for run in runs)
            for key in runs[0]}


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)


def _row(micro_batch_size: int, accumulation: int, measured: dict[str, dict[str, float]]) -> dict[str, Any]:
    def get(method: str, key: str) -> Optional[float]:
        return measured[method][key] if method in measured else None

    row: dict[str, Any] = {"micro_batch_size": micro_batch_size, "logical_batch_size": micro_batch_size * accumulation}
    for method in METHODS:
        if method in measured:
            row[f"{method}_step_s"] = round(get(method, "step_s"), 4)  # type: ignore[arg-type]
            row[f"{method}_peak_mem_mib"] = round(get(method, "peak_mem_bytes") / 2**20, 1)  # type: ignore[operator]
            if "peak_rss_bytes" in measured[method]:
                row[f"{method}_peak_rss_mib"] = round(get(method, "peak_rss_bytes") / 2**20, 1)  # type: ignore[operator]
    for method in METHODS:
        if method in measured and "per_sample_grad_bytes" in measured[method]:
            row[f"{method}_per_sample_grad_mib"] = round(get(method, "per_sample_grad_bytes") / 2**20, 2)
        if method in measured and "bookkept_bytes" in measured[method]:
            row[f"{method}_bookkept_mib"] = round(get(method, "bookkept_bytes") / 2**20, 2)
        if method in measured and "noise_s" in measured[method]:
            row[f"{method}_noise_s"] = round(get(method, "noise_s"), 4)  # type: ignore[arg-type]
        if method in measured and "passes_s" in measured[method]:
            row[f"{method}_passes_s"] = round(get(method, "passes_s"), 4)  # type: ignore[arg-type]
    for dp, nondp in BASELINES.items():
        if dp in measured and "same_process_over_nondp" in measured[dp]:
            row[f"{dp}_over_nondp_same_process"] = round(get(dp, "same_process_over_nondp"), 3)  # type: ignore[arg-type]
        if dp not in measured or nondp not in measured:
            continue
        row[f"{dp}_over_nondp"] = ratio(get(dp, "step_s"), get(nondp, "step_s"))
        row[f"{dp}_peak_mem_over_nondp"] = ratio(get(dp, "peak_mem_bytes"), get(nondp, "peak_mem_bytes"))
        if "peak_rss_bytes" in measured[dp]:
            row[f"{dp}_peak_rss_over_nondp"] = ratio(get(dp, "peak_rss_bytes"), get(nondp, "peak_rss_bytes"))
        if "noise_s" in measured[dp]:  # the floor: non-DP plus the noise alone
            row[f"{dp}_noise_floor_over_nondp"] = ratio(
                get(nondp, "step_s") + get(dp, "noise_s"), get(nondp, "step_s"))  # type: ignore[operator]
        if "passes_s" in measured[dp]:  # and the least work on materialised per-sample gradients
            floor = get(nondp, "step_s") + get(dp, "noise_s") + accumulation * get(dp, "passes_s")  # type: ignore
            row[f"{dp}_passes_floor_over_nondp"] = ratio(floor, get(nondp, "step_s"))
    return row


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args)))
        return
    forwarded = {
        "--preset": args.preset,
        "--seq-len": args.seq_len,
        "--accumulation": args.accumulation,
        "--data": args.data,
        "--warmup": args.warmup,
        "--steps": args.steps,
        "--device": args.device,
        "--precision": args.precision,
        **({"--profile-dir": args.profile_dir} if args.profile_dir else {}),
    }
    shared = [f"{flag}={value}" for flag, value in forwarded.items()]
    if args.same_process:
        shared.append("--same-process")
    runs: dict[tuple[int, str], list[dict[str, float]]] = {}
    for _ in range(args.repeats):
        for micro_batch_size in args.micro_batch_sizes:
            for method in args.methods:
                runs.setdefault((micro_batch_size, method), []).append(measure(method, micro_batch_size, shared))
    results = [
        _row(m, args.accumulation, {method: _least_disturbed(runs[m, method]) for method in args.methods})
        for m in args.micro_batch_sizes
    ]
    config = {
        "preset": args.preset,
        "seq_len": args.seq_len,
        "accumulation": args.accumulation,
        "data": args.data,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "repeats": args.repeats,
        "same_process": args.same_process,
        "device": args.device,
        "precision": args.precision,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    print(json.dumps({"config": config, "results": results, "notes": NOTES}, indent=2))


if __name__ == "__main__":
    main()
