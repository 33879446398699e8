"""Run two real DP steps on the CPU and print the resident-memory growth of the second (a fresh process).

With ``MALLOC_MMAP_THRESHOLD_`` low, every large tensor is its own mapping, returned to the OS when freed, so the
peak resident set follows the live tensor bytes.
"""

from __future__ import annotations

import json
import resource
import sys
import threading
import time

import torch
from lightning.pytorch.callbacks import Callback

from lightning_longshield import CausalLMModule, LongShieldStrategy
from tests.support.helpers import RandomTokens, loader, make_trainer


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


class SecondStepGrowth(Callback):
    """The second step's peak resident growth: the resident set sampled every half millisecond during the step (the
    process's lifetime peak ``ru_maxrss`` could come from the first step or the set-up), minus the resident set
    just before it."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 1:
            self.before = self.peak = resident_bytes()
            self.sampling = True
            self.sampler = threading.Thread(target=self._sample, daemon=True)
            self.sampler.start()

    def _sample(self) -> None:
        while self.sampling:
            self.peak = max(self.peak, resident_bytes())
            time.sleep(0.0005)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            self.sampling = False
            self.sampler.join()
            self.growth = max(self.peak, resident_bytes()) - self.before


def main(model: str, method: str, mbs: int, seq_len: int) -> None:
    torch.manual_seed(0)
    strategy = LongShieldStrategy(noise_multiplier=1.0, micro_batch_size=mbs, poisson_sampling=False, seed=0,
                                  activation_checkpointing=method == "v3", preflight=False)
    probe = SecondStepGrowth()
    module = CausalLMModule(model, optimizer="adamw")
    dataset = RandomTokens(size=4 * mbs, seq_len=seq_len, vocab=module.config.vocab_size)
    make_trainer(strategy, max_steps=2, precision="32-true", callbacks=[probe]).fit(module, loader(dataset, 2 * mbs))
    print(json.dumps({"step_growth": probe.growth}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
