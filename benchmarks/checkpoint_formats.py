"""Checkpoint save and load, one full file against sharded, on two processes (CP 2, FSDP2 over both). Prints JSON.

Each configuration trains one DP step (AdamW) on fresh processes joined by a gloo group, then every rank saves and
loads the same state in both formats (`LongShieldStrategy(checkpoint_format=...)`): ``full`` gathers the model and
optimizer state to rank 0 and writes one file; ``sharded`` has every rank write its own shards (PyTorch's distributed
checkpoint engine) plus a manifest. Per format and rank: seconds to save and to load, and the growth of the process's
resident memory during each over its level just before (sampled every millisecond); the JSON gives the maximum over
ranks, rank 0's, the checkpoint's bytes on disk, and the ratios sharded / full. Example:

    python benchmarks/checkpoint_formats.py --presets tiny medium
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import tempfile
import threading
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import Callback
from resident_memory import current_rss_bytes
from torch.utils.data import DataLoader, Dataset

from lightning_longshield import CausalLMModule, LongShieldStrategy
from lightning_longshield.models import LlamaConfig

#: ``medium``: about 57 M parameters (0.7 GB of model and AdamW state in fp32), where a gathered copy shows.
PRESETS = {"tiny": LlamaConfig.from_name("tiny"),
           "medium": replace(LlamaConfig.from_name("tiny"), vocab_size=32000, dim=512, n_layers=8, n_heads=8,
                             n_kv_heads=4, ffn_dim=1536)}
WORLD_SIZE = 2
SEQ_LEN = 32
FORMATS = ("full", "sharded")


class Tokens(Dataset):
    def __init__(self, size: int, vocab: int) -> None:
        self.rows = torch.randint(0, vocab, (size, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index, :-1], "labels": self.rows[index, 1:]}


def return_free_memory() -> None:
    """Hand the C allocator's free pages back to the OS (glibc's ``malloc_trim``; elsewhere nothing), so that what a
    measured call allocates shows in the resident memory even where it reuses blocks that training freed."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakGrowth:
    """Context manager: the most the resident memory rose above its level at entry (after the allocator's free pages
    went back to the OS), sampled every millisecond."""

    def __enter__(self) -> PeakGrowth:
        gc.collect()
        return_free_memory()
        self.start = self.peak = current_rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, current_rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.start


class MeasureCheckpoints(Callback):
    """After training, on every rank: save and load in each format, timed and memory-sampled."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.results: dict[str, Any] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        for checkpoint_format in FORMATS:
            strategy.checkpoint_format = checkpoint_format
            path = self.out_dir / f"{checkpoint_format}.ckpt"
            strategy.barrier()
            with PeakGrowth() as save_memory:
                start = time.perf_counter()
                trainer.save_checkpoint(path)
                save_s = time.perf_counter() - start
            strategy.barrier()
            with PeakGrowth() as load_memory:
                start = time.perf_counter()
                checkpoint = strategy.load_checkpoint(path)
                strategy.load_model_state_dict(checkpoint)
                if strategy.lightning_restore_optimizer:
                    strategy.load_optimizer_state_dict(checkpoint)
                load_s = time.perf_counter() - start
            del checkpoint
            strategy.barrier()
            self.results[checkpoint_format] = {
                "save_s": save_s, "save_memory_growth": save_memory.growth,
                "load_s": load_s, "load_memory_growth": load_memory.growth, "bytes_on_disk": _disk_bytes(path),
            }


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def worker(rank: int, preset: str, out_dir: str, threads: int) -> None:
    """One rank: join the gloo group, take one DP step, measure both formats, write this rank's results."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD_SIZE))
    torch.set_num_threads(threads)
    store = dist.FileStore(str(Path(out_dir, "store")), WORLD_SIZE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timedelta(minutes=10))
    try:
        config = replace(PRESETS[preset], max_seq_len=SEQ_LEN)
        measure = MeasureCheckpoints(out_dir)
        strategy = LongShieldStrategy(context_parallel_size=WORLD_SIZE, noise_multiplier=1.0, micro_batch_size=2,
                                      poisson_sampling=False, seed=0, preflight=False)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD_SIZE, max_steps=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[measure], default_root_dir=out_dir)
        module = CausalLMModule(config, optimizer="adamw", learning_rate=1e-4)
        trainer.fit(module, DataLoader(Tokens(8, config.vocab_size), batch_size=4))
        parameters = sum(p.numel() for p in module.parameters())
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"parameters": parameters, **measure.results}))
    finally:
        dist.destroy_process_group()


def measure_preset(preset: str, threads: int) -> dict[str, Any]:
    """Both formats for ``preset`` on fresh processes: per format, the maximum over ranks and rank 0's figures."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(worker, args=(preset, out_dir, threads), nprocs=WORLD_SIZE, join=True,
                           start_method="spawn")
        ranks = [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    row: dict[str, Any] = {"preset": preset, "parameters": ranks[0]["parameters"]}
    for checkpoint_format in FORMATS:
        figures = [r[checkpoint_format] for r in ranks]
        row[checkpoint_format] = {
            "save_s": round(max(f["save_s"] for f in figures), 3),
            "load_s": round(max(f["load_s"] for f in figures), 3),
            "save_memory_growth_mib": round(max(f["save_memory_growth"] for f in figures) / 2**20, 1),
            "load_memory_growth_mib": round(max(f["load_memory_growth"] for f in figures) / 2**20, 1),
            "rank0_save_memory_growth_mib": round(figures[0]["save_memory_growth"] / 2**20, 1),
            "mib_on_disk": round(figures[0]["bytes_on_disk"] / 2**20, 1),
        }
    for key in ("save_s", "load_s", "save_memory_growth_mib", "rank0_save_memory_growth_mib"):
        row[f"sharded_over_full_{key}"] = _ratio(row["sharded"][key], row["full"][key])
    return row


def _ratio(numerator: float, denominator: float) -> Optional[float]:
    return round(numerator / denominator, 3) if denominator else None


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=["tiny", "medium"])
    parser.add_argument("--threads-per-rank", type=int, default=1)
    args = parser.parse_args(argv)
    results = [measure_preset(preset, args.threads_per_rank) for preset in args.presets]
    config = {"world_size": WORLD_SIZE, "layout": "CP 2 (FSDP2 over both ranks), AdamW, fp32",
              "torch": torch.__version__}
    print(json.dumps({"config": config, "results": results}, indent=2))


if __name__ == "__main__":
    main()
