"""Is the trace honest? Traced peak (fake tensors, CPU) vs the real CUDA peak of the same DP step, side by side.

    python benchmarks/trace_vs_cuda.py            # needs one CUDA GPU; prints one JSON object

For each configuration (one process, so context-parallel size 1) it trains two real DP steps on the GPU, each a
logical batch of two micro-batches, and reads ``torch.cuda.max_memory_allocated`` over the second step (AdamW's
moments exist, as in the trace); then it traces the same step with `lightning_longshield.traced_memory.trace_step`
and with the analytic model. Ratios are traced / measured and analytic / measured; a step that runs out of GPU memory is
recorded with ``measured_gib: null``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = (  # (model, method, micro-batch size, sequence length)
    ("llama3.2-1b", "v2", 1, 4096),
    ("llama3.2-1b", "v2", 2, 4096),
    ("llama3.2-1b", "v2", 1, 8192),
    ("llama3.2-1b", "v3", 2, 8192),
    ("llama3.2-1b", "v3", 1, 16384),
    ("llama3.2-3b", "v3", 1, 4096),
)


class TokenWindows(torch.utils.data.Dataset):
    """Random token windows of one length (memory does not depend on the values)."""

    def __init__(self, size: int, seq_len: int, vocab_size: int) -> None:
        self.tokens = torch.randint(vocab_size, (size, seq_len + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index, :-1], "labels": self.tokens[index, 1:]}


def measured_peak(model: str, method: str, mbs: int, seq_len: int) -> int | None:
    """Peak bytes allocated on the GPU during the second of two real DP steps (``None``: out of memory), less what
    was still allocated before this configuration (an earlier one's leftovers)."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_longshield import CausalLMModule, LongShieldStrategy
    from lightning_longshield.models import LlamaConfig

    class PeakOfSecondStep(Callback):
        peak = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                torch.cuda.synchronize()
                self.peak = torch.cuda.max_memory_allocated() - leftover

    gc.collect()  # a Trainer and its module refer to each other: freed only by the collector
    leftover = torch.cuda.memory_allocated()
    config = LlamaConfig.from_name(model)
    strategy = LongShieldStrategy(noise_multiplier=1.0, micro_batch_size=mbs, poisson_sampling=False, seed=0,
                                  activation_checkpointing=method == "v3", preflight=False)
    probe = PeakOfSecondStep()
    trainer = L.Trainer(strategy=strategy, accelerator="cuda", devices=1, precision="bf16-mixed", max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[probe])
    data = torch.utils.data.DataLoader(TokenWindows(4 * mbs, seq_len, config.vocab_size), batch_size=2 * mbs)
    try:
        trainer.fit(CausalLMModule(config, optimizer="adamw"), data)
    except torch.OutOfMemoryError:
        probe.peak = None
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # the trace creates its own (fake) one
    del trainer, strategy
    gc.collect()
    torch.cuda.empty_cache()
    return probe.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", type=int, nargs="+", default=list(range(len(CONFIGS))),
                        help="indices into CONFIGS to run (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("trace_vs_cuda.py measures real CUDA memory: run it on a machine with a GPU.")
    from lightning_longshield.traced_memory import trace_step
    from simulate import estimate_memory, make_config

    rows = []
    for model, method, mbs, seq_len in (CONFIGS[i] for i in args.configs):
        measured = measured_peak(model, method, mbs, seq_len)
        traced = trace_step(model=model, method=method, cp=1, mbs=mbs, seq_len=seq_len).total
        analytic = estimate_memory(make_config(model=model, gpus=1, method=method, mbs=mbs, seq_len=seq_len)).allocated
        row = {"model": model, "method": method, "mbs": mbs, "seq_len": seq_len,
               "measured_gib": None if measured is None else round(measured / 2**30, 3),
               "traced_gib": round(traced / 2**30, 3), "analytic_gib": round(analytic / 2**30, 3)}
        if measured is not None:
            row.update(traced_over_measured=round(traced / measured, 3),
                       analytic_over_measured=round(analytic / measured, 3))
        rows.append(row)
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
