"""`PreemptionCheckpoint`: on SIGTERM (what schedulers send before they preempt a job), a checkpoint at the next step
boundary and a clean exit, so that a requeued job resumes from it."""

from __future__ import annotations

import os
from types import FrameType
from typing import Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info


class PreemptionCheckpoint(Callback):
    """Save the last checkpoint when a fit stops for SIGTERM.

    Lightning stops a fit for SIGTERM by raising `SIGTERMException` (a ``SystemExit`` of status 0) at the end of a
    step, or in one process also after a validation batch; this callback then saves the checkpoint, in the
    `ModelCheckpoint`'s folder (``dirpath``, else the Trainer's ``default_root_dir``) under its last-checkpoint name.
    With several processes, Lightning's own handler broadcasts from inside the signal handler and each rank stops on
    its own flag, which deadlocks when the ranks are signalled at different points; so here the handler only notes the
    signal, and at each step's end the ranks agree (an all-reduce MAX of their flags: any rank's signal counts) and
    stop together, after that step (or the first batch of the validation that follows it). Any other exception saves
    nothing: mid-step state is not a checkpoint. The DP steps run until then are in the privacy ledger before the
    checkpoint is written. `LongShieldStrategy` adds one to a Trainer that checkpoints, and to every fit of several
    processes, where without checkpointing it only stops them together (no save).
    """

    def __init__(self, dirpath: Optional[str | os.PathLike] = None) -> None:
        self.dirpath = dirpath
        self._signalled = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._signalled = False
        if trainer.world_size > 1:
            connector = trainer._signal_connector
            if not callable(getattr(connector, "_sigterm_notifier_fn", None)):
                raise RuntimeError("PreemptionCheckpoint: this Lightning version's signal connector has no"
                                   " `_sigterm_notifier_fn` to replace; use the Lightning version the project pins.")
            # Lightning composes its SIGTERM handler from this attribute after `on_fit_start` (and keeps any handler
            # installed before the fit in it).
            connector._sigterm_notifier_fn = self._note_sigterm

    def _note_sigterm(self, signum: int, frame: Optional[FrameType]) -> None:
        # Only a flag: a handler runs between any two bytecodes of the step, so a collective here meets another one.
        self._signalled = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: object, batch: object,
                           batch_idx: int) -> None:
        if trainer.world_size == 1:
            return
        signalled = torch.tensor([int(self._signalled)], device=trainer.strategy.root_device)
        dist.all_reduce(signalled, op=dist.ReduceOp.MAX)
        if signalled.item():
            # Every rank's loop now raises `SIGTERMException` at this step's end (Lightning's check of this flag).
            trainer._signal_connector.received_sigterm = True

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Inside a fit, training or validating (a validation's batches come after a finished step).
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != TrainerFn.FITTING \
                or trainer.sanity_checking:
            return
        if not trainer.checkpoint_callbacks and self.dirpath is None:  # added only to stop every process together
            rank_zero_info(f"SIGTERM: stopped at step {trainer.global_step} on every process; the Trainer saves no"
                           " checkpoint (enable_checkpointing=False), so none is written.")
            return
        path = self._path(trainer)
        trainer.save_checkpoint(path)
        rank_zero_info(f"SIGTERM: saved {path} at step {trainer.global_step}; resume with fit(ckpt_path={path!r})."
                       " fit(ckpt_path='last') finds it only when the ModelCheckpoint has a fixed dirpath (a"
                       " versioned logger's next run looks in a new version's folder).")

    def _path(self, trainer: pl.Trainer) -> str:
        """The absolute path of the last checkpoint, named as the Trainer's `ModelCheckpoint` names its own."""
        callback = trainer.checkpoint_callback
        naming = callback if isinstance(callback, ModelCheckpoint) else ModelCheckpoint
        if self.dirpath is not None:
            directory = os.fspath(self.dirpath)
        elif isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            directory = callback.dirpath
        else:
            directory = trainer.default_root_dir
        return os.path.abspath(os.path.join(directory, naming.CHECKPOINT_NAME_LAST + naming.FILE_EXTENSION))
