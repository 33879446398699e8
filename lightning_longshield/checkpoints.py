"""The strategy's checkpoints: sharded on PyTorch's distributed checkpoint engine (`sharded_checkpoints`), or one full
file whose optimizer state is keyed by parameter name; both load at any layout, with the strategy's privacy state
(plan, accountant history, the run's privacy ledger) under `CHECKPOINT_KEY`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_longshield.durable_checkpoints import is_local, newer_checkpoint_beside
from lightning_longshield.hpc_checkpoints import missing_hpc_checkpoint_replacement
from lightning_longshield.privacy.ledger import LEDGER_FILE
from lightning_longshield.sharded_checkpoints import (
    ShardedSave,
    forget_stale_gradients,
    is_sharded_checkpoint,
    load_hyperparameters,
    load_sharded,
    replace_folder,
    restore_interrupted_swap,
    save_sharded,
)

CHECKPOINT_KEY = "longshield"
#: ``checkpoint_format="auto"`` writes one full file up to this many parameters (its fp32 weights and AdamW state, all
#: on rank 0, stay under about 2 GiB) and, with several processes, sharded checkpoints above it.
AUTO_FULL_FILE_PARAMETERS = 2**27
# Set on a module by a checkpoint loaded outside fit: (path, privacy state), checked when a fit starts.
_LOADED_DP_HISTORY = "_longshield_loaded_dp_history"
# Set on a module by the fits that trained it: (the session's identity, its DP steps), checked when a fit starts.
_TRAINED_BY = "_longshield_trained_by"


def warn_if_a_newer_checkpoint_is_beside(path: Any) -> None:
    """Warn when a resume from a ``last*`` checkpoint (what ``fit(ckpt_path="last")`` finds) leaves a newer whole
    checkpoint beside it unused: a ``last.ckpt`` saved at SIGTERM is not refreshed by a `ModelCheckpoint` without
    ``save_last``, so after a later crash "last" rolls the run back."""
    if not is_local(path) or not Path(path).name.startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST):
        return
    try:
        newer = newer_checkpoint_beside(Path(path))
    except OSError:  # a file beside it went away while listed (another job's ModelCheckpoint), or a dangling link
        return
    if newer is not None:
        rank_zero_warn(
            f"Resuming from {path}, but {newer.name} beside it was written later: the steps between them run again"
            " and are accounted again (their privacy is spent twice). fit(ckpt_path='last') finds last.ckpt, which a"
            " ModelCheckpoint without save_last does not refresh after a SIGTERM saved it. Pass"
            f" ckpt_path={os.fspath(newer)!r} to resume from the newer one, and set ModelCheckpoint(save_last=True)"
            " so that 'last' follows every checkpoint."
        )


def check_checkpoint_options(checkpoint_format: str, async_checkpoints: bool) -> None:
    """Refuse an unknown ``checkpoint_format``, or asynchronous saves of full checkpoints, naming the choices."""
    if checkpoint_format not in ("auto", "sharded", "full"):
        raise ValueError(f"checkpoint_format={checkpoint_format!r}: choose 'auto' (sharded above 134 M parameters"
                         " with several processes, else one file), 'sharded' or 'full'.")
    if async_checkpoints and checkpoint_format == "full":
        raise ValueError("async_checkpoints=True writes sharded checkpoints in the background; use"
                         " checkpoint_format='sharded' (or 'auto') with it.")


def forget_trained(module: Any) -> None:
    """Drop `mark_trained`'s note: for a run whose claim is its own steps alone whatever trained the weights before
    (a privacy audit: its canaries are new to them)."""
    module.__dict__.pop(_TRAINED_BY, None)


def mark_trained(module: Any, session: Any) -> None:
    """Note on ``module`` that ``session``'s DP steps trained its weights, if it took any: a fit under another
    strategy, whose accountant would leave them out, is then refused (`StrategyCheckpoints.check_weights_accounted`)."""
    if module is not None and session.accountant.steps:
        module.__dict__[_TRAINED_BY] = (session.identity, session.accountant.steps)


class StrategyCheckpoints:
    """Strategy mix-in: sharded checkpoints (`sharded_checkpoints`: every rank writes and reads its own shards) where
    `sharded_checkpoints` says so, else the full model and optimizer state gathered to save and scattered back into
    shards to load. A checkpoint of either kind loads whatever the format chosen now.

    The full file's model state comes from `ModelParallelStrategy` with ``save_distributed_checkpoint=False``; this
    class makes its optimizer state portable (by parameter name, not position) and loads both through Lightning's own
    restore path instead of `ModelParallelStrategy`'s sharded-folder loader (which needs DTensor parameters; at CP 1
    they are plain). The strategy's ``privacy`` (`PrivacySession`) travels with either, and a restored run adds the
    steps its privacy ledger recorded after the checkpoint.
    """

    _loaded_sharded = False
    _pending_save: Optional[ShardedSave] = None
    _removals_after_commit: tuple[Any, ...] = ()  # checkpoints superseded by the save under way
    _save_group: Optional[Any] = None
    # A checkpoint loaded by validate, test or predict: its privacy state (the DP history of the weights it holds) is
    # what a save outside fit writes, not the session's.
    _loaded_outside_fit = False
    _privacy_state_outside_fit: Optional[dict[str, Any]] = None

    @property
    def sharded_checkpoints(self) -> bool:
        """``checkpoint_format="sharded"`` or asynchronous saves, or ``"auto"`` with more than one process and more
        than `AUTO_FULL_FILE_PARAMETERS` parameters. Below that, one file (loadable with ``torch.load``, the simplest
        to move) costs rank 0 under about 2 GiB; one process writes everything either way."""
        chosen = self.checkpoint_format  # type: ignore[attr-defined]
        if chosen == "sharded" or self.async_checkpoints:  # type: ignore[attr-defined]
            return True
        if chosen == "full" or self.world_size == 1:  # type: ignore[attr-defined]
            return False
        module = self.lightning_module  # type: ignore[attr-defined]
        return sum(p.numel() for p in module.parameters()) > AUTO_FULL_FILE_PARAMETERS

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state: gathered whole on rank 0 for one-file checkpoints; for sharded ones each rank's own
        shards (DTensors under FSDP2, plain tensors at CP 1), never gathered, as `ModelParallelStrategy` gives them
        with distributed checkpoints (``v.full_tensor()`` makes a shard whole, a collective)."""
        if self.sharded_checkpoints:
            return get_model_state_dict(self.lightning_module)  # type: ignore[attr-defined]
        return super().lightning_module_state_dict()  # type: ignore[misc]

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if self.privacy.ledger_path is None and self.privacy.plan is not None:  # type: ignore[attr-defined]
            self.open_privacy_ledger()  # type: ignore[attr-defined]  # a run that can be resumed keeps a ledger
        state = (self._privacy_state_outside_fit if self._loaded_outside_fit and not self._fitting()
                 else self.privacy.state_dict())  # type: ignore[attr-defined]
        if state is not None:
            checkpoint[CHECKPOINT_KEY] = state
        if not self.sharded_checkpoints:
            local = storage_options is None and is_local(filepath)
            sharded = self._sharded_checkpoint_at(filepath) if local else None
            if sharded is not None:
                self._replace_sharded_by_one_file(checkpoint, sharded)
            elif local and self.broadcast(Path(filepath).is_symlink()):  # type: ignore[attr-defined]
                # A link (``last.ckpt``) to a checkpoint: the file replaces the link. ModelParallelStrategy's save
                # would remove a sharded folder at the path, and fails on a link to one.
                ParallelStrategy.save_checkpoint(self, checkpoint, filepath)  # type: ignore[arg-type]
            else:
                super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]
            return
        if storage_options is not None:
            raise TypeError("Sharded checkpoints take no storage_options; use checkpoint_format='full' with a"
                            " CheckpointIO of your own.")
        for key in ("state_dict", "optimizer_states"):
            checkpoint.pop(key, None)
        self.commit_pending_save()
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]  # type: ignore[attr-defined]
        save = save_sharded(self.broadcast(filepath), self.lightning_module, optimizers,  # type: ignore[attr-defined]
                            checkpoint, self.global_rank, self.barrier,  # type: ignore[attr-defined]
                            background_group=self._background_group())
        self._pending_save = save if save.pending is not None else None
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        # No later step to finish it (a save at SIGTERM); or a ModelCheckpoint links ``last.ckpt`` to it as soon as
        # this returns, and a link to a save that a crash cuts short leaves no last checkpoint to resume.
        if not trainer.training or trainer.interrupted or _links_last(trainer):
            self.commit_pending_save()

    def _sharded_checkpoint_at(self, filepath: Any) -> Optional[Path]:
        """Rank 0's ``filepath`` if rank 0 sees a sharded checkpoint's folder (not a link to one) there, else None:
        every rank learns rank 0's answer, as the save is then made differently."""
        path = Path(self.broadcast(filepath))  # type: ignore[attr-defined]
        found = is_sharded_checkpoint(path) and not path.is_symlink()
        return path if self.broadcast(found) else None  # type: ignore[attr-defined]

    def _replace_sharded_by_one_file(self, checkpoint: dict[str, Any], path: Path) -> None:
        """A one-file save over a sharded checkpoint of the same name (the format changed under it): the file is
        written aside, then swapped in. Lightning's own save removes the folder first, which leaves the name without
        a checkpoint for the whole write."""
        if self.is_global_zero:  # type: ignore[attr-defined]
            temporary = path.with_name(f".{path.name}.file.partial")
            self.checkpoint_io.save_checkpoint(checkpoint, temporary)  # type: ignore[attr-defined]
            replace_folder(temporary, path)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove a superseded checkpoint; while an asynchronous save is under way, only once it is committed (until
        then the superseded one is the newest whole checkpoint)."""
        if self._pending_save is not None:
            self._removals_after_commit = (*self._removals_after_commit, filepath)
            return
        super().remove_checkpoint(filepath)  # type: ignore[misc]

    def _background_group(self) -> Optional[Any]:
        """The process group of asynchronous saves (created on first use, on every rank: saves are collectives)."""
        if not self.async_checkpoints:  # type: ignore[attr-defined]
            return None
        if self._save_group is None:
            import torch.distributed as dist

            self._save_group = dist.new_group(backend="gloo")
        return self._save_group

    def commit_pending_save(self, wait: bool = True) -> None:
        """Finish the asynchronous save under way, if any (a collective). ``wait=False``: only once every rank's
        shards are written (else leave it for a later step)."""
        if self._pending_save is None:
            return
        if not wait and not self.reduce_boolean_decision(self._pending_save.written(),  # type: ignore[attr-defined]
                                                         all=True):
            return
        save, self._pending_save = self._pending_save, None
        save.commit(self.barrier)  # type: ignore[attr-defined]
        removals, self._removals_after_commit = self._removals_after_commit, ()
        for path in removals:
            super().remove_checkpoint(path)  # type: ignore[misc]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        if self._pending_save is not None:
            self.commit_pending_save(wait=False)

    def on_train_end(self) -> None:
        self.commit_pending_save()
        super().on_train_end()  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A sharded checkpoint folder or one full checkpoint file (not `ModelParallelStrategy`'s loader), and the
        privacy state."""
        path = self.broadcast(checkpoint_path)  # type: ignore[attr-defined]
        if self.is_global_zero and (restored := restore_interrupted_swap(Path(path))):  # type: ignore[attr-defined]
            rank_zero_warn(f"Checkpoint {path} was missing: its save was cut off between renaming the previous"
                           f" checkpoint aside and the new one into place. The"
                           f" {'previous' if restored.name.endswith('.previous') else 'new'} one, whole, now has its"
                           " name and is loaded.")
        replacement = (missing_hpc_checkpoint_replacement(Path(path))
                       if self.is_global_zero and is_local(path) else None)  # type: ignore[attr-defined]
        if replacement is not None:
            rank_zero_warn(f"HPC checkpoint {path} does not exist (Lightning numbered it from a save cut off under"
                           f" its temporary name); resuming from {replacement}, the newest whole one beside it.")
            path = os.fspath(replacement)
        path = self.broadcast(path)  # type: ignore[attr-defined]  # also waits for rank 0's repairs above
        self._loaded_sharded = is_sharded_checkpoint(path)
        module = self.lightning_module  # type: ignore[attr-defined]
        if self._loaded_sharded:
            checkpoint = load_sharded(Path(path), module, list(self.optimizers),  # type: ignore[attr-defined]
                                      strict=module.strict_loading)
        else:
            checkpoint = ParallelStrategy.load_checkpoint(self, path, weights_only=False)  # type: ignore[arg-type]
        state = checkpoint.get(CHECKPOINT_KEY)
        if not self._fitting():  # validate, test, predict: the run's accounting is left as it is
            self._loaded_outside_fit, self._privacy_state_outside_fit = True, state
            if state is not None:  # the module now holds weights with a DP history this session may not hold
                module.__dict__[_LOADED_DP_HISTORY] = (os.fspath(path), state)
            return checkpoint
        module.__dict__.pop(_LOADED_DP_HISTORY, None)  # a resume: the checkpoint's history is the session's now
        forget_trained(module)
        if self.is_global_zero:  # type: ignore[attr-defined]
            warn_if_a_newer_checkpoint_is_beside(path)
        if not self.privacy.poisson_sampling:  # type: ignore[attr-defined]
            _drop_empty_loader_states(checkpoint)
        if state is not None:
            self.privacy.load_state_dict(state)  # type: ignore[attr-defined]
            self.privacy.resume_from_ledger(self.privacy_ledger, self.broadcast)  # type: ignore[attr-defined]
        elif checkpoint.get("global_step"):
            rank_zero_warn(
                f"Resuming {path}, which holds no privacy state (it was not saved by LongShieldStrategy during a DP"
                f" fit) after {checkpoint['global_step']} steps: they are not accounted, so the printed guarantee"
                " covers this fit's steps only, and none of the data those steps trained on if they ran without DP."
                " Resume a checkpoint of the DP run itself."
            )
        return checkpoint

    def _fitting(self) -> bool:
        try:
            trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        except RuntimeError:  # no longer attached (Lightning refused a second fit of a spawn Trainer): not fitting
            return False
        return trainer.state.fn == TrainerFn.FITTING

    def on_train_start(self) -> None:
        """Keep the privacy ledger wherever the run can be resumed: it checkpoints, resumed, or names a ledger.
        Refuse to train on weights that validate, test or predict loaded from a DP checkpoint whose history this
        session does not account (`check_weights_accounted`)."""
        self.check_weights_accounted()
        super().on_train_start()  # type: ignore[misc]
        self._loaded_outside_fit, self._privacy_state_outside_fit = False, None
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        resumable = self.privacy.run_id is not None or trainer.checkpoint_callbacks  # type: ignore[attr-defined]
        if self.privacy_ledger is not None or resumable:  # type: ignore[attr-defined]
            self.open_privacy_ledger()

    def check_weights_accounted(self) -> None:
        """Raise if the module holds weights that DP steps this session's accountant does not hold trained: loaded
        outside ``fit`` from a DP checkpoint (another run's, or later steps of this one), or trained in memory by a
        fit under another strategy. ``fit`` without ``ckpt_path`` would report only its own steps for weights that
        result from those too."""
        module = self.lightning_module  # type: ignore[attr-defined]
        session = self.privacy  # type: ignore[attr-defined]
        trained = module.__dict__.get(_TRAINED_BY)
        if trained is not None and trained[0] != session.identity:
            raise ValueError(
                f"The module was trained by {trained[1]} DP steps of a fit under another LongShieldStrategy, which"
                " this fit would not account (its epsilon would count only its own steps). Continue that run from"
                " its checkpoint with fit(ckpt_path=...), or fit again with the strategy that trained it. To start a"
                " new run from these weights on data none of whose records that run trained on (a separate"
                " guarantee), build a new module and load the weights yourself (module.load_state_dict)."
            )
        loaded = module.__dict__.get(_LOADED_DP_HISTORY)
        if loaded is None:
            return
        path, state = loaded
        steps = sum(int(run[2]) for run in state["accountant"]["history"])
        run = state.get("run_id")
        if run is not None and run == session.run_id and session.accountant.steps >= steps:
            return  # an earlier checkpoint of the run this session accounts (validate(ckpt_path="best"), fit again)
        raise ValueError(
            f"The module holds the weights of the DP checkpoint {path}, loaded by validate, test or predict: they"
            f" result from its {steps} DP steps, which this fit would not account (its epsilon would count only its"
            f" own steps). Pass fit(ckpt_path={path!r}) to continue that run and its accounting. To start a new run"
            " from these weights on data none of whose records that run trained on (a separate guarantee), build a"
            " new module and load the weights yourself (module.load_state_dict)."
        )

    def open_privacy_ledger(self) -> None:
        """Record every DP step from now on in the privacy ledger (written by global rank 0)."""
        self.privacy.open_ledger(self.privacy_ledger_path(), writer=self.is_global_zero)  # type: ignore[attr-defined]

    def privacy_ledger_path(self) -> str:
        """``privacy_ledger``, else the ledger a restored checkpoint names, else one in ``default_root_dir``."""
        if self.privacy_ledger is not None:  # type: ignore[attr-defined]
            return os.fspath(self.privacy_ledger)  # type: ignore[attr-defined]
        if self.privacy.ledger_path is not None:  # type: ignore[attr-defined]
            return self.privacy.ledger_path  # type: ignore[attr-defined]
        return os.path.join(self.lightning_module.trainer.default_root_dir, LEDGER_FILE)  # type: ignore[attr-defined]

    @property
    def lightning_restore_optimizer(self) -> bool:
        return not self._loaded_sharded  # a sharded checkpoint's optimizers were loaded with the model

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._loaded_sharded:
            return
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_model_state_dict(self.lightning_module, checkpoint["state_dict"], options=options)  # type: ignore[attr-defined]

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full optimizer state keyed by parameter name, so it loads under any CP size (sharded checkpoints write
        it shard by shard instead)."""
        if self.sharded_checkpoints:
            return {}
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.lightning_module, optimizer, options=options)  # type: ignore[attr-defined]

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        options = StateDictOptions(full_state_dict=True)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):  # type: ignore[attr-defined]
            if any(isinstance(key, int) for key in state.get("state", {})):
                raise ValueError(
                    "The checkpoint's optimizer state is keyed by parameter position, as Lightning's other strategies"
                    " save it, not by name: it was not written by LongShieldStrategy, and fit(ckpt_path=...) cannot"
                    " continue it. Load its weights into the module (module.load_state_dict(torch.load(path)"
                    "['state_dict'])) and start a new fit without ckpt_path."
                )
            if not state.get("state"):  # e.g. SGD without momentum: no tensors to place, only hyper-parameters
                load_hyperparameters(optimizer, state["param_groups"])
                continue
            forget_stale_gradients(optimizer)
            set_optimizer_state_dict(self.lightning_module, optimizer, state, options=options)  # type: ignore[attr-defined]


def _drop_empty_loader_states(checkpoint: dict[str, Any]) -> None:
    """Forget the training loader states a checkpoint holds when all are empty, as a Poisson run's are
    (`PoissonDataLoader` keeps nothing): a run resumed with ``poisson_sampling=False`` has no stateful loader to give
    them to, and Lightning would refuse the resume."""
    loop = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    states = loop.get("combined_loader")
    if states and all(state == {} for state in states):
        del loop["combined_loader"]


def _links_last(trainer: Any) -> bool:
    """Whether a ModelCheckpoint of ``trainer`` links ``last.ckpt`` to every checkpoint it saves
    (``save_last="link"``)."""
    return any(getattr(callback, "save_last", None) == "link" for callback in trainer.checkpoint_callbacks)
