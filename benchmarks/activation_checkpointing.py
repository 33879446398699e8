"""LongShield-V3 on CPU: peak memory and step time with and without activation checkpointing, and the longest
sequence that fits a memory budget. Prints one JSON object.

Every measurement runs in a fresh process with ``MALLOC_MMAP_THRESHOLD_`` lowered so freed large blocks go back to
the OS and peak RSS tracks live memory. Memory is the peak-RSS growth over the training steps (model, optimizer
and Lightning set-up excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from resident_memory import current_rss_bytes, peak_rss_bytes

WORKER_FLAG = "--worker"


def run_worker(seq_len: int, checkpointing: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.steps`` DP steps at ``seq_len`` in a fresh process; peak-RSS growth and median step time."""
    command = [sys.executable, __file__, WORKER_FLAG, str(seq_len), str(int(checkpointing)),
               str(args.layers), str(args.dim), str(args.micro_batch_size), str(args.steps)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def worker(seq_len: int, checkpointing: bool, layers: int, dim: int, micro_batch_size: int, steps: int) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_longshield import CausalLMModule, LongShieldStrategy
    from lightning_longshield.models import LlamaConfig

    class Samples(TensorDataset):
        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            tokens = self.tensors[0][index]
            return {"input_ids": tokens[:-1], "labels": tokens[1:]}

    class Probe(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start_rss = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if not self.start_rss:
                self.start_rss = current_rss_bytes()  # the peak so far may be the set-up's
            self.started = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.times.append(time.perf_counter() - self.started)

    torch.manual_seed(0)
    config = LlamaConfig.from_name("tiny", n_layers=layers, dim=dim, ffn_dim=3 * dim, max_seq_len=seq_len)
    data = Samples(torch.randint(0, config.vocab_size, (micro_batch_size * 4, seq_len + 1)))
    probe = Probe()
    strategy = LongShieldStrategy(noise_multiplier=1.0, micro_batch_size=micro_batch_size, poisson_sampling=False,
                                  activation_checkpointing=checkpointing, seed=0)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[probe])
    trainer.fit(CausalLMModule(config, optimizer="adamw"), DataLoader(data, batch_size=micro_batch_size))
    print(json.dumps({"peak_growth_mib": (peak_rss_bytes() - probe.start_rss) / 2**20,
                      "step_s": statistics.median(probe.times[1:] or probe.times)}))


def longest_fitting(checkpointing: bool, args: argparse.Namespace) -> int | None:
    """The longest power-of-two sequence length whose step stays within the memory budget."""
    best = None
    seq_len = args.min_seq_len
    while seq_len <= args.max_seq_len:
        if run_worker(seq_len, checkpointing, args)["peak_growth_mib"] > args.budget_mib:
            break
        best, seq_len = seq_len, seq_len * 2
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget-mib", type=float, default=256.0)
    parser.add_argument("--min-seq-len", type=int, default=256)
    parser.add_argument("--max-seq-len", type=int, default=8192)
    args = parser.parse_args()
    without = run_worker(args.seq_len, False, args)
    with_ac = run_worker(args.seq_len, True, args)
    print(json.dumps({
        "config": vars(args),
        "without_checkpointing": without,
        "with_checkpointing": with_ac,
        "peak_memory_ratio": with_ac["peak_growth_mib"] / without["peak_growth_mib"],
        "step_time_ratio": with_ac["step_s"] / without["step_s"],
        "longest_seq_len_within_budget": {
            "without_checkpointing": longest_fitting(False, args),
            "with_checkpointing": longest_fitting(True, args),
        },
        "notes": "CPU, one process; memory is peak-RSS growth during training steps. Step time includes the extra"
                 " forward of every block; the paper reports about 1.33x on GPUs.",
    }, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == WORKER_FLAG:
        seq, flag, layers, dim, mbs, steps = (int(v) for v in sys.argv[2:8])
        worker(seq, bool(flag), layers, dim, mbs, steps)
    else:
        main()
