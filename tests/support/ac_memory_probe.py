"""Run one DP training step and print the peak-RSS growth during it (run as a script in a fresh process).

On Linux the peak is reset when the step starts (``/proc/self/clear_refs``), so a transient before the step (an
import, the set-up) cannot hide the step's own peak; elsewhere the process-lifetime peak is used.
"""

from __future__ import annotations

import json
import resource
import sys

import torch
from lightning.pytorch.callbacks import Callback

from lightning_longshield import LongShieldStrategy
from tests.support.helpers import RandomTokens, loader, make_module, make_trainer, small_config


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM, the peak resident set size
        return True
    except OSError:
        return False


def peak_rss_bytes(resettable: bool) -> int:
    return status_bytes("VmHWM") if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Baseline(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.resettable = reset_peak_rss()
        self.before = status_bytes("VmRSS") if self.resettable else peak_rss_bytes(False)


def main(activation_checkpointing: bool) -> None:
    torch.manual_seed(0)
    config = small_config(n_layers=6, dim=128, n_heads=4, n_kv_heads=2, ffn_dim=512, max_seq_len=4096)
    module = make_module(config)
    baseline = Baseline()
    strategy = LongShieldStrategy(noise_multiplier=1.0, micro_batch_size=2, poisson_sampling=False,
                                  activation_checkpointing=activation_checkpointing, seed=0)
    make_trainer(strategy, max_steps=1, callbacks=[baseline]).fit(module, loader(RandomTokens(size=2, seq_len=1024), 2))
    print(json.dumps({"step_peak_growth": peak_rss_bytes(baseline.resettable) - baseline.before}))


if __name__ == "__main__":
    main(sys.argv[1] == "1")
