"""Checkpoints as one full, unsharded file whose optimizer state is keyed by parameter name (loads at any CP size),
with the strategy's privacy state (plan and accountant history) under `CHECKPOINT_KEY`."""

from __future__ import annotations

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

CHECKPOINT_KEY = "longshield"


class FullStateCheckpoints:
    """Strategy mix-in: gather the full model and optimizer state to save, scatter it back into shards to load.

    The model's state comes from `ModelParallelStrategy` with ``save_distributed_checkpoint=False``; this class
    makes the optimizer state portable (by parameter name, not position) and loads both through Lightning's own
    restore path instead of `ModelParallelStrategy`'s sharded-folder loader. The strategy's ``privacy``
    (`PrivacySession`) travels with them.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
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
        return checkpoint

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
