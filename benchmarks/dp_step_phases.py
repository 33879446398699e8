"""Where a DP step's extra time goes: the forward, backward, clipping, noise and optimizer phases of LongShield's DP
engine against the same plain PyTorch loop without DP, alternating step by step in one process. Prints JSON.

Both loops train identical copies of a Llama preset on the same micro-batches, ``--accumulation`` micro-batches per
AdamW step. The non-DP loop accumulates each micro-batch's gradient into ``.grad``; each DP loop (``flat``: one norm per
sample, ``per_layer``: equal per-layer bounds) runs `DPSGDEngine` as the strategy does: ``prepare_microbatch``, forward,
backward, ``accumulate_microbatch`` (the clipping: after backward for flat clipping, during it for per-layer clipping,
whose in-backward part is then counted in ``backward``), and per step ``release`` (the noise) and the optimizer step.
Every step of every loop runs in turn (non-DP, then each DP loop), so a drift of the machine's speed weighs on all of
them alike; ``--warmup`` rounds are not timed. Reported: the median milliseconds per optimizer step of each phase and of
the whole step, per loop; each DP loop's phases minus non-DP's; ``<loop>_over_nondp``, the ratio of the median step
times, and ``<loop>_over_nondp_quartiles``, the quartiles of the ratios of each round's two steps (how far single
rounds scatter). The ``opacus`` loop (Opacus's hooks, `GradSampleModule` and `DPOptimizer`, as its
``BatchMemoryManager`` runs micro-batches: ``clip_and_accumulate`` after each backward, then ``add_noise``,
``scale_grad`` and the optimizer step) runs in the same rotation, and ``opacus_over_<loop>`` is its median step over
each LongShield loop's (with ``opacus_over_<loop>_quartiles``): ours against Opacus, side by side. On CUDA phases are
timed by events on the stream and the step synchronises once, at its end. On CPU the process first lets glibc keep
freed memory, as the strategy does when it fits (`lightning_longshield.cpu_allocator`); all loops run with it. Example
(the tiny preset, 2 CPU cores: a few minutes):

    python benchmarks/dp_step_phases.py --micro-batch-size 4 --seq-len 256 --accumulation 4 --steps 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import warnings
from collections import defaultdict
from collections.abc import Callable

import torch
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn

from lightning_longshield.cpu_allocator import retain_freed_memory
from lightning_longshield.loss import per_sample_token_loss
from lightning_longshield.models import Llama, LlamaConfig
from lightning_longshield.privacy.accountant import PrivacyAccountant
from lightning_longshield.privacy.engine import DPSGDEngine
from lightning_longshield.privacy.noise import GaussianNoise
from simulate.strategy_config import PerLayerClipping, StrategyConfig

DP_LOOPS = {"flat": StrategyConfig(), "per_layer": StrategyConfig(clipping=PerLayerClipping(kernel="torch"))}
NOISE_MULTIPLIER, MAX_GRAD_NORM, SAMPLE_RATE = 1.0, 1.0, 0.01  # the accounting does not change the timing
OPACUS = "opacus"
Phases = dict[str, float]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="LlamaConfig preset")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=16, help="timed optimizer steps of each loop")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps of each loop first")
    loops = [*sorted(DP_LOOPS), OPACUS]
    parser.add_argument("--loops", nargs="+", choices=loops, default=loops, help="DP loops timed against non-DP")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    for name in ("seq_len", "micro_batch_size", "accumulation", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1.")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0.")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; run on --device cpu here.")
    return args


class PhaseTimer:
    """Adds the seconds of each named phase of one step. On CUDA each phase is timed by two events on the current
    stream, read once the outermost phase (the step) has ended and its event has been reached: no synchronisation
    inside the step, whose kernels queue as they do in training."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: Phases = defaultdict(float)
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._depth = 0

    def __call__(self, phase: str, work: Callable[..., object], *args: object) -> object:
        if self.device.type != "cuda":
            began = time.perf_counter()
            result = work(*args)
            self.seconds[phase] += time.perf_counter() - began
            return result
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._depth += 1
        start.record()
        result = work(*args)
        end.record()
        self._depth -= 1
        self._events.append((phase, start, end))
        if not self._depth:
            end.synchronize()
            for name, began_at, ended_at in self._events:
                self.seconds[name] += began_at.elapsed_time(ended_at) / 1e3  # milliseconds
            self._events.clear()
        return result


def mean_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The mean over samples of each sample's mean token cross-entropy, as `CausalLMModule` trains."""
    return per_sample_token_loss(model(tokens[:, :-1]), tokens[:, 1:]).mean()


def summed_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The sum over samples of each sample's loss: what the strategy back-propagates in a DP step, so that each
    per-sample gradient is the sample's own (not divided by the micro-batch size) and is clipped as in training."""
    return per_sample_token_loss(model(tokens[:, :-1]), tokens[:, 1:]).sum()


def nondp_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: torch.Tensor, timer: PhaseTimer) -> None:
    optimizer.zero_grad(set_to_none=True)
    for tokens in batches:
        loss = timer("forward", mean_loss, model, tokens)
        timer("backward", loss.backward)
    timer("optimizer", optimizer.step)


def dp_step(model: nn.Module, optimizer: torch.optim.Optimizer, engine: DPSGDEngine, batches: torch.Tensor,
            timer: PhaseTimer) -> None:
    engine.begin_logical_batch()
    size = batches.shape[1]
    for tokens in batches:
        engine.prepare_microbatch(size)
        loss = timer("forward", summed_loss, model, tokens)
        timer("backward", loss.backward)
        timer("clipping", engine.accumulate_microbatch, size)
    timer("noise", engine.release, NOISE_MULTIPLIER, SAMPLE_RATE, batches.shape[0] * size)
    timer("optimizer", optimizer.step)


def opacus_step(model: nn.Module, optimizer: DPOptimizer, batches: torch.Tensor, timer: PhaseTimer) -> None:
    for index, tokens in enumerate(batches):
        loss = timer("forward", mean_loss, model, tokens)
        timer("backward", loss.backward)
        timer("clipping", opacus_clip, optimizer, index + 1 < len(batches))
    timer("noise", opacus_noise, optimizer)
    timer("optimizer", optimizer.original_optimizer.step)
    optimizer.zero_grad(set_to_none=True)  # the sums too: the last call was not a skipped step


def opacus_clip(optimizer: DPOptimizer, more: bool) -> None:
    """Clip and add a micro-batch's per-sample gradients; with ``more`` micro-batches to come in the logical batch,
    drop them and ``.grad``, as Opacus's skipped step and ``zero_grad(set_to_none=True)`` do (its default,
    ``set_to_none=False``, zeroes ``.grad`` in place: a pass per parameter more). The last one's are read by
    ``scale_grad``."""
    optimizer.clip_and_accumulate()
    if more:
        for param in optimizer.params:
            param.grad_sample = None
            param.grad = None


def opacus_noise(optimizer: DPOptimizer) -> None:
    optimizer.add_noise()
    optimizer.scale_grad()


def run(args: argparse.Namespace) -> dict[str, object]:
    device = torch.device(args.device)
    if device.type == "cpu":
        retain_freed_memory()  # as the strategy does on CPU; in this process both loops run with it
    preset = LlamaConfig.from_name(args.preset)
    config = dataclasses.replace(preset, max_seq_len=max(preset.max_seq_len, args.seq_len))
    tokens = torch.randint(0, config.vocab_size, (args.accumulation, args.micro_batch_size, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(0)).to(device)

    def fresh_model() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = Llama(config).to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    steps: dict[str, Callable[[PhaseTimer], None]] = {}
    model, optimizer = fresh_model()
    steps["nondp"] = lambda timer, m=model, o=optimizer: nondp_step(m, o, tokens, timer)
    ours = [loop for loop in args.loops if loop in DP_LOOPS]
    for loop in ours:
        model, optimizer = fresh_model()
        engine = DPSGDEngine(model, MAX_GRAD_NORM, GaussianNoise(device), PrivacyAccountant("rdp"),
                             config=DP_LOOPS[loop])
        steps[loop] = lambda timer, m=model, o=optimizer, e=engine: dp_step(m, o, e, tokens, timer)
    if OPACUS in args.loops:
        # Opacus's hooks on the embedding, whose input needs no gradient, warn at every backward.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        model, optimizer = fresh_model()
        private = DPOptimizer(optimizer, noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=MAX_GRAD_NORM,
                              expected_batch_size=args.accumulation * args.micro_batch_size)
        hooked = GradSampleModule(model)
        steps[OPACUS] = lambda timer, m=hooked, o=private: opacus_step(m, o, tokens, timer)

    timed: dict[str, list[Phases]] = defaultdict(list)
    for round_ in range(args.warmup + args.steps):
        for loop, step in steps.items():
            timer = PhaseTimer(device)
            timer("step", step, timer)
            if round_ >= args.warmup:
                timed[loop].append(dict(timer.seconds))

    medians = {loop: {phase: round(1e3 * statistics.median(step[phase] for step in rounds), 2)
                      for phase in rounds[0]} for loop, rounds in timed.items()}
    report: dict[str, object] = {"config": vars(args), "median_ms_per_step": medians}
    base = medians["nondp"]
    for loop in args.loops:
        report[f"{loop}_minus_nondp_ms"] = {phase: round(value - base.get(phase, 0.0), 2)
                                            for phase, value in medians[loop].items()}
        report[f"{loop}_over_nondp"] = round(medians[loop]["step"] / base["step"], 3)
        report[f"{loop}_over_nondp_quartiles"] = paired_quartiles(timed[loop], timed["nondp"])
    if OPACUS in args.loops:
        for loop in ours:
            report[f"opacus_over_{loop}"] = round(medians[OPACUS]["step"] / medians[loop]["step"], 3)
            report[f"opacus_over_{loop}_quartiles"] = paired_quartiles(timed[OPACUS], timed[loop])
    return report


def paired_quartiles(numerator: list[Phases], denominator: list[Phases]) -> list[float]:
    """The quartiles of the step-time ratios of the same rounds (a round's two steps ran seconds apart, so a drift of
    the machine's speed cancels in each): how far single rounds scatter around the middle one."""
    ratios = [top["step"] / bottom["step"] for top, bottom in zip(numerator, denominator)]
    if len(ratios) < 2:
        return [round(ratios[0], 3)] * 3
    return [round(value, 3) for value in statistics.quantiles(ratios, n=4, method="inclusive")]


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(run(parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()
