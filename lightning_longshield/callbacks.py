"""`PrivacyMonitor`: epsilon in the progress bar and the logger; the callbacks the strategy adds to a fit."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_longshield.batching import batch_size_of, declare_logged_batch_size
from lightning_longshield.preemption import PreemptionCheckpoint, requeues_on_slurm
from lightning_longshield.privacy.metric_guard import EPSILON_KEY, log_own


def add_training_callbacks(trainer: pl.Trainer) -> None:
    """What every fit of the strategy runs with, unless the Trainer has its own: `PrivacyMonitor` (first: it declares
    the batch size to later hooks), and `PreemptionCheckpoint` where a SIGTERM must save (the Trainer checkpoints) or
    stop every process at one step (several processes: Lightning's own handler deadlocks there), and where SLURM's
    requeue signal must save at a step boundary (Lightning's handler saves mid-step)."""
    callbacks = trainer.callbacks
    if not any(isinstance(cb, PrivacyMonitor) for cb in callbacks):
        callbacks.insert(0, PrivacyMonitor())
    needed = trainer.checkpoint_callbacks or trainer.world_size > 1 or requeues_on_slurm(trainer)
    if needed and not any(isinstance(cb, PreemptionCheckpoint) for cb in callbacks):
        callbacks.append(PreemptionCheckpoint())


class PrivacyMonitor(Callback):
    """Logs ``epsilon`` (privacy spent at the run's delta) every ``log_every_n_steps`` and on the run's last step,
    and writes the epsilon spent by the end of ``fit`` to every logger. The key is reserved (`EPSILON_KEY`): a
    user's ``self.log("epsilon", ...)`` is refused.

    `LongShieldStrategy` adds one automatically. Computing epsilon with the PRV accountant costs up to about a
    second, and with randomized clipping's accountant 5-20 s (one CPU core, while the other processes wait at the next
    step), so it is not recomputed on every step (nor at every epoch end: with Poisson sampling an epoch can be a
    handful of steps); with randomized clipping raise ``log_every_n_steps`` to match. Every rank computes it, so that
    every rank's ``callback_metrics`` hold it (for an ``EarlyStopping`` or ``ModelCheckpoint`` that monitors it).

    Lightning writes what ``self.log`` collected to the loggers only at steps that are multiples of
    ``log_every_n_steps`` or when ``trainer.should_stop`` is set, so a run ending on ``max_steps``, ``max_epochs`` or a
    later stop would leave its last epsilon out of the logs: `on_train_end` writes it, unless Lightning already did.
    Epsilon is a function of public hyper-parameters (noise multiplier, sampling rate, step count) only.

    First among the callbacks (the strategy puts it there), it also gives Lightning each logical batch's size before
    any ``on_train_batch_start`` hook logs: for a ``self.log`` without ``batch_size`` Lightning would infer it from
    the batch and, where its fields disagree (a list of document ids), warn quoting the size it found, a value of the
    private data under Poisson sampling.
    """

    def __init__(self) -> None:
        self._start_step: Optional[int] = None  # the global step this fit started from
        self._written_step: Optional[int] = None  # the last step whose epsilon Lightning wrote to the loggers

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_step, self._written_step = trainer.global_step, None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        try:
            size = batch_size_of(batch)
        except ValueError:  # a batch without one leading dimension: training_step refuses it, quoting nothing
            return
        declare_logged_batch_size(trainer, size)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
        if not _accounts(strategy):
            return
        last_epoch = trainer.max_epochs is not None and 0 < trainer.max_epochs <= trainer.current_epoch + 1
        is_last = (
            trainer.should_stop
            or trainer.global_step >= trainer.max_steps > 0
            or (trainer.is_last_batch and last_epoch)
        )
        every = trainer.log_every_n_steps  # 0: no periodic logging
        if (every and trainer.global_step % every == 0) or is_last or trainer.global_step == 1:
            log_own(pl_module, EPSILON_KEY, strategy.get_epsilon(), prog_bar=True, rank_zero_only=True)
            if _lightning_writes_this_step(trainer):
                self._written_step = trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the final epsilon to every logger (global rank 0), unless Lightning wrote it at the last step or this
        fit ran no step (a resume at the end of its steps or budget: nothing new was spent)."""
        strategy = trainer.strategy
        step = trainer.global_step
        if not _accounts(strategy) or not trainer.is_global_zero or step in (self._start_step, self._written_step):
            return
        if trainer.loggers:
            epsilon = strategy.get_epsilon()
            for logger in trainer.loggers:
                logger.log_metrics({EPSILON_KEY: epsilon}, step=step)
                logger.save()
        self._written_step = step


def _accounts(strategy: Any) -> bool:
    """Whether ``strategy`` accounts privacy (a `LongShieldStrategy` whose training has started)."""
    return hasattr(strategy, "get_epsilon") and getattr(strategy, "privacy_plan", None) is not None


def _lightning_writes_this_step(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes the metrics logged at this step to the loggers after ``on_train_batch_end`` (its
    ``should_update_logs``; ``global_step`` counts every batch, as the strategy refuses gradient accumulation and
    manual optimization). A ``should_stop`` set by a hook after this one is not seen."""
    every = trainer.log_every_n_steps
    periodic = bool(every) and (trainer.global_step % every == 0 or trainer.should_stop)
    return periodic or bool(getattr(trainer, "fast_dev_run", False))
