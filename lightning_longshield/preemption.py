"""`PreemptionCheckpoint`: on SIGTERM (what schedulers send before they preempt a job), a checkpoint at the next step
boundary and a clean exit, so that a requeued job resumes from it; on SLURM's requeue signal, the same checkpoint
under Lightning's HPC name and the job requeued."""

from __future__ import annotations

import functools
import os
import re
import subprocess
from pathlib import Path
from types import FrameType
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_longshield.durable_checkpoints import is_local
from lightning_longshield.hpc_checkpoints import next_hpc_checkpoint
from lightning_longshield.privacy.session import privacy_unit_of

#: The signal connector's handlers replaced for the fit (Lightning composes its handlers from these attributes).
_SIGTERM_NOTIFIER, _SLURM_REQUEUE_HANDLER = "_sigterm_notifier_fn", "_slurm_sigusr_handler_fn"


def requeues_on_slurm(trainer: Any) -> bool:
    """Whether the Trainer runs under SLURM with automatic requeueing (Lightning's requeue signal handler)."""
    environment = getattr(getattr(trainer, "_accelerator_connector", None), "cluster_environment", None)
    return isinstance(environment, SLURMEnvironment) and environment.auto_requeue


class PreemptionCheckpoint(Callback):
    """Save a checkpoint at a step boundary when a fit stops for SIGTERM or SLURM's requeue signal.

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

    Under SLURM with ``auto_requeue`` (Lightning's default there), Lightning's requeue-signal handler saved a
    checkpoint from inside the signal handler, mid-step: weights, optimizer and privacy state from different points of
    a step (and, with several processes, collectives interleaved with the step's). Here that signal stops the fit the
    same way; the checkpoint is saved at the step boundary as ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir`` (the name
    Lightning resumes from by itself when the requeued job calls ``fit`` without ``ckpt_path``), whether or not the
    Trainer checkpoints, and global rank 0 then requeues the job with ``scontrol requeue``. The strategy adds one to
    every such fit.
    """

    def __init__(self, dirpath: Optional[str | os.PathLike] = None) -> None:
        self.dirpath = dirpath
        self._signalled = self._requeue = self._agreed_requeue = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._signalled = self._requeue = self._agreed_requeue = False
        connector = trainer._signal_connector
        replaced = [(_SIGTERM_NOTIFIER, self._note_sigterm)] if trainer.world_size > 1 else []
        if requeues_on_slurm(trainer):
            # One process stops as for SIGTERM, on Lightning's own flag (no collective to meet).
            stops = connector if trainer.world_size == 1 else None
            replaced.append((_SLURM_REQUEUE_HANDLER, functools.partial(self._note_requeue, stops)))
        for name, handler in replaced:
            if not callable(getattr(connector, name, None)):
                raise RuntimeError(f"PreemptionCheckpoint: this Lightning version's signal connector has no `{name}`"
                                   " to replace; use the Lightning version the project pins.")
            # Lightning composes its handlers from these attributes after `on_fit_start` (keeping any SIGTERM handler
            # installed before the fit).
            setattr(connector, name, handler)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _restore_lightnings_handlers(trainer)

    def _note_sigterm(self, signum: int, frame: Optional[FrameType]) -> None:
        # Only a flag: a handler runs between any two bytecodes of the step, so a collective here meets another one.
        self._signalled = True

    def _note_requeue(self, stops: Optional[Any], signum: int, frame: Optional[FrameType]) -> None:
        self._requeue = True
        if stops is not None:
            stops.received_sigterm = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: object, batch: object,
                           batch_idx: int) -> None:
        if trainer.world_size == 1:
            return
        flags = torch.tensor([int(self._signalled), int(self._requeue)], device=trainer.strategy.root_device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, requeue = (bool(flag) for flag in flags.tolist())
        if signalled or requeue:
            # What every rank does, whatever signal reaches it later (its handler writes only the flags above).
            self._agreed_requeue = requeue
            # Every rank's loop now raises `SIGTERMException` at this step's end (Lightning's check of this flag).
            trainer._signal_connector.received_sigterm = True

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        _restore_lightnings_handlers(trainer)  # `teardown` is not called after an exception
        # Inside a fit, training or validating (a validation's batches come after a finished step).
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != TrainerFn.FITTING:
            return
        requeue = self._agreed_requeue if trainer.world_size > 1 else self._requeue
        if requeue:  # in the sanity check no step has run: nothing to save, the job still to requeue
            self._save_and_requeue(trainer, save=not trainer.sanity_checking)
            return
        if trainer.sanity_checking:
            return
        _state_the_guarantee(trainer)
        if not trainer.checkpoint_callbacks and self.dirpath is None:  # added to stop ranks together, or for SLURM
            where = " on every process" if trainer.world_size > 1 else ""
            rank_zero_info(f"SIGTERM: stopped at step {trainer.global_step}{where}; the Trainer saves no checkpoint"
                           " (enable_checkpointing=False), so none is written.")
            return
        path = self._path(trainer)
        trainer.save_checkpoint(path)
        rank_zero_info(f"SIGTERM: saved {path} at step {trainer.global_step}; resume with fit(ckpt_path={path!r})."
                       " fit(ckpt_path='last') finds it only when the ModelCheckpoint has a fixed dirpath (a"
                       " versioned logger's next run looks in a new version's folder).")

    def _save_and_requeue(self, trainer: pl.Trainer, save: bool = True) -> None:
        """Lightning's requeue, at a step boundary: loggers finalized, the HPC checkpoint saved (its number chosen on
        rank 0 for every rank), and the job requeued once every rank is past the save."""
        for logger in trainer.loggers:
            logger.finalize("finished")
        if save:
            root = trainer.default_root_dir
            # Numbered from the exact names (Lightning's numbering reads digits of cut-off saves' temporary names).
            path = os.fspath(next_hpc_checkpoint(Path(root).absolute())) if is_local(root) else \
                trainer._checkpoint_connector.hpc_save_path(root)
            path = trainer.strategy.broadcast(path)
            trainer.save_checkpoint(path)
            saved = f"saved {path} at step {trainer.global_step}"
            resume = f"fit(ckpt_path={path!r}) resumes from that checkpoint"
        else:
            saved = "stopped in the sanity check, before any step (nothing to save)"
            resume = "its fit resumes as this one did"
        trainer.strategy.barrier("PreemptionCheckpoint.requeue")
        if not trainer.is_global_zero:
            return
        job = _slurm_job_id()
        if trainer.fit_loop.done:  # the signal came with the last step: nothing left to run
            rank_zero_info(f"SLURM requeue signal: {saved}; training is complete, so job {job} is not requeued.")
            return
        failure = "no SLURM job id" if job is None else None
        if job is not None:
            try:
                status = subprocess.call(["scontrol", "requeue", job])
                failure = None if status == 0 else f"scontrol exit status {status}"
            except OSError as error:  # no scontrol here (a container without SLURM's tools)
                failure = f"scontrol could not run: {error}"
        if failure is None:
            rank_zero_info(f"SLURM requeue signal: {saved}; requeued job {job}, whose fit() without ckpt_path resumes"
                           " from the newest HPC checkpoint.")
        else:
            rank_zero_warn(f"SLURM requeue signal: {saved}, but the job was not requeued ({failure}); resubmit it:"
                           f" {resume}.")

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


def _state_the_guarantee(trainer: pl.Trainer) -> None:
    """The guarantee spent by the steps before the stop (the end of fit, which states it, does not come)."""
    privacy = getattr(getattr(trainer, "strategy", None), "privacy", None)
    if privacy is None or privacy.plan is None:
        return
    unit = privacy_unit_of(getattr(trainer, "datamodule", None))
    rank_zero_info(f"SIGTERM at step {trainer.global_step}. {privacy.describe_guarantee(unit)}")


def _restore_lightnings_handlers(trainer: pl.Trainer) -> None:
    """Lightning's own handlers again for the Trainer's later runs (those registered for this fit are already
    composed, and Lightning restores the signals' previous handlers at its teardown)."""
    for name in (_SIGTERM_NOTIFIER, _SLURM_REQUEUE_HANDLER):
        vars(trainer._signal_connector).pop(name, None)


def _slurm_job_id() -> Optional[str]:
    """The job to requeue: an array job's ``<array job>_<task>``, else ``SLURM_JOB_ID``; None where neither is a job
    id."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}" if array_job else os.environ.get("SLURM_JOB_ID")
    return job if job and re.fullmatch(r"[0-9]+(_[0-9]+)?", job) else None
