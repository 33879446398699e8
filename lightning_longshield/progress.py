"""`StepProgressBar`: a training progress bar that counts DP steps of a ``max_steps`` run."""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, honest about a DP run's length.

    With Poisson logical batches an epoch is no unit of the run: each batch is one DP step, and a ``max_steps`` run
    ends in the middle of an epoch or spans several. When the run's number of steps is known (``max_steps``, or
    ``max_epochs`` times the batches of an epoch), the training bar shows ``Step n/total``, the optimizer steps
    taken out of the run's (continued across epochs, resumed at the restored step). Otherwise it is Lightning's
    bar of one epoch's batches, described ``Epoch e`` (with ``/last`` only when ``max_epochs`` is set).

    Where the output is not a terminal (a batch job's log, ``> file``), rich draws the bar only when it ends, so a
    plain ``Step n/total`` line goes to standard error every ``line_seconds`` seconds and at the last step.
    """

    def __init__(self, *args: Any, line_seconds: float = 30.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.line_seconds = line_seconds
        self._last_line: Optional[float] = None

    def _step_total(self) -> Union[int, None]:
        """The run's optimizer steps (one per batch: DP-SGD refuses gradient accumulation), or None when they are
        not known (an open-ended run)."""
        total = self.trainer.estimated_stepping_batches
        return int(total) if math.isfinite(total) else None

    @property
    def total_train_batches(self) -> Union[int, float]:
        total = self._step_total()
        return super().total_train_batches if total is None else total

    def _get_train_description(self, current_epoch: int) -> str:
        if self._step_total() is not None:
            description = "Step"
        elif self.trainer.max_epochs is not None and self.trainer.max_epochs > 0:
            description = f"Epoch {current_epoch}/{self.trainer.max_epochs - 1}"
        else:
            description = f"Epoch {current_epoch}"
        return f"{description:{len(self.validation_description)}}"

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._step_total() is None or self.train_progress_bar_id is None:
            super().on_train_epoch_start(trainer, pl_module)
        if self._step_total() is not None:  # one bar for the whole run, started at the steps already taken
            self._update(self.train_progress_bar_id, trainer.global_step)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._step_total() is None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()
        self._plain_line(trainer.global_step, self._step_total())

    def _plain_line(self, step: int, total: Optional[int]) -> None:
        """A ``Step n/total`` line where rich draws nothing until the end (not a terminal)."""
        console = getattr(self, "_console", None)
        if self.is_disabled or console is None or console.is_terminal:
            return
        now = time.monotonic()
        if self._last_line is not None and now - self._last_line < self.line_seconds and step != total:
            return
        self._last_line = now
        print(f"Step {step}/{total}", file=sys.stderr, flush=True)
