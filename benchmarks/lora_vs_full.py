"""DP full fine-tuning vs DP LoRA, side by side in one run: per-sample-gradient bytes, trainable parameters and step
time of `LongShieldStrategy` on the same model, data and micro-batches. Prints JSON.

    python benchmarks/lora_vs_full.py --preset tiny --seq-len 256 --micro-batch-size 8 --steps 4

Each configuration trains ``--warmup + --steps`` DP steps (noise_multiplier=1, fixed logical batches of
``--accumulation`` micro-batches, AdamW) in this process; step time is the median of the timed steps.
``per_sample_grad_bytes`` is what the engine held for the last micro-batch (``dp_engine.last_held_bytes``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_longshield import CausalLMModule, LongShieldStrategy
from lightning_longshield.lora import LoraOptions
from lightning_longshield.models import LlamaConfig
from lightning_longshield.text_data import PackedTokenDataset, python_stdlib_corpus


class StepTimer(Callback):
    def __init__(self) -> None:
        self.durations: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.durations.append(time.perf_counter() - self.start)


def run(args: argparse.Namespace, lora: Optional[LoraOptions]) -> dict[str, Any]:
    torch.manual_seed(0)
    logical = args.micro_batch_size * args.accumulation
    corpus = torch.tensor(list(python_stdlib_corpus(max_bytes=(args.seq_len + 1) * logical * 4).encode()))
    dataset = PackedTokenDataset(corpus, args.seq_len)
    module = CausalLMModule(LlamaConfig.from_name(args.preset), lora=lora)
    strategy = LongShieldStrategy(noise_multiplier=1.0, max_grad_norm=1.0, micro_batch_size=args.micro_batch_size,
                                  poisson_sampling=False, preflight=False)
    timer = StepTimer()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=args.warmup + args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timer], limit_val_batches=0)
    trainer.fit(module, DataLoader(dataset, batch_size=logical))
    return {
        "trainable_parameters": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "per_sample_grad_bytes": strategy.dp_engine.last_held_bytes,
        "step_s": statistics.median(timer.durations[args.warmup:]),
    }


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per logical batch")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    full, lora = run(args, None), run(args, LoraOptions(rank=args.lora_rank))
    result = {
        "config": vars(args),
        "full": full,
        "lora": lora,
        "lora_over_full": {key: lora[key] / full[key] for key in full},
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
