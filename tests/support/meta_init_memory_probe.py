"""Per-rank peak RSS of setting up a ~0.8 GiB (fp32) model under CP 2, until training starts (run as a script).

``python -m tests.support.meta_init_memory_probe prebuilt|meta OUT_DIR`` (from the repository root): ``prebuilt``
builds the whole model on every rank before ``fit`` (as a model built outside ``configure_model`` is); ``meta``
leaves it to ``configure_model``, which the strategy runs on the meta device. Each rank writes
``{"peak_growth": bytes}`` to ``OUT_DIR/rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.multiprocessing as mp
from lightning.pytorch.callbacks import Callback

from tests.support.ac_memory_probe import peak_rss_bytes, status_bytes

CONFIG = dict(vocab_size=32000, dim=1024, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=4096, max_seq_len=64,
              rope_theta=10000.0)


class PeakAtTrainStart(Callback):
    def __init__(self, before: int) -> None:
        self.before = before

    def on_train_start(self, trainer, pl_module) -> None:
        self.growth = peak_rss_bytes(resettable=False) - self.before
        trainer.should_stop = True


def rank_main(rank: int, mode: str, out_dir: str, store: str) -> None:
    import torch.distributed as dist

    from lightning_longshield import CausalLMModule, LongShieldStrategy
    from lightning_longshield.models import LlamaConfig
    from tests.support.helpers import RandomTokens, loader, make_trainer

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2")
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    # The process is fresh (spawned): its peak so far is its import-time footprint, about what it holds now, so
    # the process's lifetime peak minus this is the set-up's growth without resetting the peak counter (which
    # some sandboxes do not allow).
    before = status_bytes("VmRSS")
    module = CausalLMModule(LlamaConfig(**CONFIG), optimizer="sgd")
    if mode == "prebuilt":
        module.configure_model()
    probe = PeakAtTrainStart(before)
    strategy = LongShieldStrategy(context_parallel_size=2, noise_multiplier=1.0, poisson_sampling=False,
                                  preflight=False, seed=0)
    make_trainer(strategy, max_steps=1, devices=2, callbacks=[probe]).fit(
        module, loader(RandomTokens(size=8, seq_len=16), 2)
    )
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"peak_growth": probe.growth}))
    dist.barrier()  # both ranks are done with the group
    # Leave without interpreter teardown, which now and then aborted a rank after its result was written
    # ("terminate called without an active exception": a C++ thread destroyed while joinable).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], sys.argv[2]
    mp.start_processes(rank_main, args=(mode, out_dir, str(Path(out_dir, "store"))), nprocs=2, start_method="spawn")
