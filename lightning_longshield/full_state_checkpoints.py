"""Checkpoints as one full, unsharded file whose optimizer state is keyed by parameter name (loads at any CP size),
with the strategy's privacy state (plan, accountant history, the run's privacy ledger) under `CHECKPOINT_KEY`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional

from lightning.pytorch.strategies import ParallelStrategy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_longshield.privacy.ledger import LEDGER_FILE

CHECKPOINT_KEY = "longshield"


class FullStateCheckpoints:
    """Strategy mix-in: gather the full model and optimizer state to save, scatter it back into shards to load.

    The model's state comes from `ModelParallelStrategy` with ``save_distributed_checkpoint=False``; this class
    makes the optimizer state portable (by parameter name, not position) and loads both through Lightning's own
    restore path instead of `ModelParallelStrategy`'s sharded-folder loader. The strategy's ``privacy``
    (`PrivacySession`) travels with them, and a restored run adds the steps its privacy ledger recorded after the
    checkpoint.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if self.privacy.ledger_path is None and self.privacy.plan is not None:  # type: ignore[attr-defined]
            self.open_privacy_ledger()  # type: ignore[attr-defined]  # a run that can be resumed keeps a ledger
        state = self.privacy.state_dict()  # type: ignore[attr-defined]
        if state is not None:
            checkpoint[CHECKPOINT_KEY] = state
        super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """One full checkpoint file (not the sharded folder of `ModelParallelStrategy`), and the privacy state."""
        checkpoint = ParallelStrategy.load_checkpoint(self, checkpoint_path, weights_only=False)  # type: ignore[arg-type]
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is not None and self.privacy.noise is not None:  # type: ignore[attr-defined]
            self.privacy.load_state_dict(state)  # type: ignore[attr-defined]
            self.privacy.resume_from_ledger(self.privacy_ledger, self.broadcast)  # type: ignore[attr-defined]
        return checkpoint

    def on_train_start(self) -> None:
        """Keep the privacy ledger wherever the run can be resumed: it checkpoints, resumed, or names a ledger."""
        super().on_train_start()  # type: ignore[misc]
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        resumable = self.privacy.run_id is not None or trainer.checkpoint_callbacks  # type: ignore[attr-defined]
        if self.privacy_ledger is not None or resumable:  # type: ignore[attr-defined]
            self.open_privacy_ledger()

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
        return True

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_model_state_dict(self.lightning_module, checkpoint["state_dict"], options=options)  # type: ignore[attr-defined]

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full optimizer state keyed by parameter name, so it loads under any CP size."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.lightning_module, optimizer, options=options)  # type: ignore[attr-defined]

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        options = StateDictOptions(full_state_dict=True)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):  # type: ignore[attr-defined]
            if not state.get("state"):  # e.g. SGD without momentum: no tensors to place, only hyper-parameters
                load_hyperparameters(optimizer, state["param_groups"])
                continue
            set_optimizer_state_dict(self.lightning_module, optimizer, state, options=options)  # type: ignore[attr-defined]


def load_hyperparameters(optimizer: Optimizer, saved_groups: list[dict[str, Any]]) -> None:
    """Set each parameter group's hyper-parameters (learning rate, ...) from a saved optimizer state without
    per-parameter state, which torch's distributed loader cannot place (it takes the device from that state)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"The checkpoint's optimizer has {len(saved_groups)} parameter groups, this one"
                         f" {len(optimizer.param_groups)}: configure_optimizers must build the same groups.")
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update({key: value for key, value in saved.items() if key != "params"})
