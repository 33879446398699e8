"""`PrivacyMonitor`: epsilon in the progress bar and the logger."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


class PrivacyMonitor(Callback):
    """Logs ``epsilon`` (privacy spent at the run's delta) every ``log_every_n_steps`` and on the run's last step.

    `LongShieldStrategy` adds one automatically. Computing epsilon with the PRV accountant costs up to about a
    second, so it is not recomputed on every step (nor at every epoch end: with Poisson sampling an epoch can be
    a handful of steps).
    """

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
        if not hasattr(strategy, "get_epsilon") or getattr(strategy, "privacy_plan", None) is None:
            return
        last_epoch = trainer.max_epochs is not None and 0 < trainer.max_epochs <= trainer.current_epoch + 1
        is_last = (
            trainer.should_stop
            or trainer.global_step >= trainer.max_steps > 0
            or (trainer.is_last_batch and last_epoch)
        )
        every = trainer.log_every_n_steps  # 0: no periodic logging
        if (every and trainer.global_step % every == 0) or is_last or trainer.global_step == 1:
            pl_module.log("epsilon", strategy.get_epsilon(), prog_bar=True, rank_zero_only=True)
