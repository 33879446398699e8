"""`PreemptionCheckpoint`: on SIGTERM (what schedulers send before they preempt a job), a checkpoint at the next step
boundary and a clean exit, so that a requeued job resumes with ``fit(ckpt_path="last")``."""

from __future__ import annotations

import os
from typing import Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn


class PreemptionCheckpoint(Callback):
    """Save ``last.ckpt`` when Lightning stops a fit for SIGTERM.

    Lightning's signal connector notes the signal, lets the current step finish (every rank agrees through a
    broadcast) and raises `SIGTERMException`, a ``SystemExit`` whose exit status is 0; this callback saves the
    checkpoint there, at a step boundary, in the `ModelCheckpoint`'s folder (``dirpath``, else the Trainer's
    ``default_root_dir``). In one process it also saves when the signal stops a fit's validation; with several it
    does not, as Lightning's validation loop stops each rank on its own. Any other exception saves nothing: mid-step
    state is not a checkpoint. The DP steps run until then are in the privacy ledger before the checkpoint is
    written. `LongShieldStrategy` adds one to a Trainer that checkpoints.
    """

    def __init__(self, dirpath: Optional[str | os.PathLike] = None) -> None:
        self.dirpath = dirpath

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Inside a fit, training or validating (a validation's batches come after a finished step).
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != TrainerFn.FITTING \
                or trainer.sanity_checking:
            return
        if not trainer.training and trainer.world_size > 1:
            # Lightning's validation loop stops each rank on its own (no broadcast), so the ranks may be at different
            # batches, and a save's collectives could meet a validation's.
            rank_zero_warn("SIGTERM during the validation of a multi-process fit: no checkpoint is saved; the last"
                           " one stands. Training steps save on SIGTERM on every rank together.")
            return
        path = os.path.join(self._directory(trainer), ModelCheckpoint.CHECKPOINT_NAME_LAST + ".ckpt")
        trainer.save_checkpoint(path)
        rank_zero_info(f"SIGTERM: saved {path} at step {trainer.global_step}; resume with fit(ckpt_path='last').")

    def _directory(self, trainer: pl.Trainer) -> str:
        if self.dirpath is not None:
            return os.fspath(self.dirpath)
        callback = trainer.checkpoint_callback
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            return callback.dirpath
        return trainer.default_root_dir
