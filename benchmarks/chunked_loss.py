"""The loss phase with and without chunks, on CPU: peak memory and time of the output head plus cross-entropy,
forward and backward, over ``(B, T)`` hidden states (``--chunk-tokens 0``: the whole logits), and of one whole DP
step of the ``tiny`` preset with a realistic vocabulary. Prints one JSON object with chunked / whole ratios.

    python benchmarks/chunked_loss.py --seq-len 4096 --vocab 32000 --chunk-tokens auto

Every measurement runs in a fresh process (forked from a server that imported the libraries once) with
``MALLOC_MMAP_THRESHOLD_`` lowered so freed large blocks go back to
the OS and peak RSS tracks live memory; memory is the peak-RSS growth over the measured work.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from forked_workers import exit_code_of, redirect_output
from resident_memory import current_rss_bytes, peak_rss_bytes


def run_worker(kind: str, chunk_tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in a fresh process (`forked_workers`), with glibc returning large freed blocks to the OS so
    that RSS follows the live tensors."""
    import chunked_loss  # by name (also where this file runs as the script): the target's module in the worker

    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the server's C library when it starts; forks inherit it
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder, "result.json")
        exit_code = exit_code_of(chunked_loss.measure_into, (
            str(result), kind, chunk_tokens, args.seq_len, args.vocab, args.micro_batch_size, args.repeats))
        if exit_code or not result.exists():
            raise RuntimeError(f"the {kind} worker (chunk_tokens={chunk_tokens}) failed with exit code {exit_code};"
                               " its traceback is above")
        return json.loads(result.read_text())


def measure_into(path: str, kind: str, *arguments: int) -> None:
    """A worker's measurement (`loss_phase` or `dp_step` of ``arguments``), written to ``path`` as JSON; what the
    libraries print goes to standard error, never into the driver's JSON on standard output."""
    redirect_output(None, None)
    measure = loss_phase if kind == "loss_phase" else dp_step
    Path(path).write_text(json.dumps(measure(*arguments)))


def loss_phase(chunk_tokens: int, seq_len: int, vocab: int, micro_batch_size: int, repeats: int) -> dict[str, Any]:
    """Head + cross-entropy, forward and backward, on the tiny preset's width."""
    import torch
    from torch import nn

    from lightning_longshield.loss import chunked_per_sample_token_loss, per_sample_token_loss
    from lightning_longshield.models import LlamaConfig

    torch.manual_seed(0)
    dim = LlamaConfig.from_name("tiny").dim
    head = nn.Linear(dim, vocab, bias=False)
    hidden = torch.randn(micro_batch_size, seq_len, dim, requires_grad=True)
    labels = torch.randint(0, vocab, (micro_batch_size, seq_len))
    start = current_rss_bytes()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        if chunk_tokens:
            loss = chunked_per_sample_token_loss(hidden, head, labels, chunk_tokens=chunk_tokens)
        else:
            loss = per_sample_token_loss(head(hidden), labels)
        loss.sum().backward()
        times.append(time.perf_counter() - began)
        hidden.grad = head.weight.grad = None
    return {"seconds": min(times), "peak_growth_bytes": peak_rss_bytes() - start}


def dp_step(chunk_tokens: int, seq_len: int, vocab: int, micro_batch_size: int, repeats: int) -> dict[str, Any]:
    """Whole DP steps (flat clipping, materialised per-sample gradients) of the tiny preset with ``vocab``."""
    import dataclasses

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, Dataset

    from lightning_longshield import CausalLMModule, LongShieldStrategy
    from lightning_longshield.models import LlamaConfig

    class Tokens(Dataset):
        def __len__(self) -> int:
            return micro_batch_size * (repeats + 1)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, vocab, (seq_len + 1,), generator=torch.Generator().manual_seed(index))
            return {"input_ids": ids[:-1], "labels": ids[1:]}

    class Probe(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.start = self.start or current_rss_bytes()  # the peak so far may be the set-up's
            self.began = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.times.append(time.perf_counter() - self.began)

    config = dataclasses.replace(LlamaConfig.from_name("tiny"), vocab_size=vocab, max_seq_len=seq_len)
    module = CausalLMModule(config, optimizer="sgd", learning_rate=1e-3, loss_chunk_tokens=chunk_tokens or None)
    probe = Probe()
    strategy = LongShieldStrategy(noise_multiplier=1.0, micro_batch_size=micro_batch_size, poisson_sampling=False,
                                  preflight=False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=repeats + 1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[probe])
    trainer.fit(module, DataLoader(Tokens(), batch_size=micro_batch_size))
    return {"seconds": min(probe.times[1:] or probe.times), "peak_growth_bytes": peak_rss_bytes() - probe.start}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size (the tiny preset's width)")
    parser.add_argument("--chunk-tokens", default="auto",
                        help="positions per chunk of the chunked loss, or 'auto' (CausalLMModule's default rule)")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-dp-step", action="store_true", help="measure the loss phase only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from lightning_longshield.models import LlamaConfig
    from simulate.loss_chunks import resolve_loss_chunk_tokens

    setting = args.chunk_tokens if args.chunk_tokens == "auto" else int(args.chunk_tokens)
    chunk = resolve_loss_chunk_tokens(setting, args.micro_batch_size, args.seq_len, LlamaConfig.from_name("tiny").dim,
                                      args.vocab)
    if chunk is None:
        raise SystemExit(f"--chunk-tokens {args.chunk_tokens} does not chunk T {args.seq_len} at this vocabulary: pass"
                         " a number of positions below --seq-len.")
    args.chunk_tokens = chunk
    report: dict[str, Any] = {"config": {key: value for key, value in vars(args).items()}}
    kinds = ("loss_phase",) if args.skip_dp_step else ("loss_phase", "dp_step")
    for kind in kinds:
        whole, chunked = (run_worker(kind, chunk, args) for chunk in (0, args.chunk_tokens))
        report[kind] = {
            "whole": whole, "chunked": chunked,
            "peak_chunked_over_whole": round(chunked["peak_growth_bytes"] / max(whole["peak_growth_bytes"], 1), 3),
            "time_chunked_over_whole": round(chunked["seconds"] / whole["seconds"], 3),
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
