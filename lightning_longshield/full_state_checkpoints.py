"""Checkpoints as one full, unsharded file whose optimizer state is keyed by parameter name (loads at any CP size)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer


class FullStateCheckpoints:
    """Strategy mix-in: gather the full model and optimizer state to save, scatter it back into shards to load.

    The model's state comes from `ModelParallelStrategy` with ``save_distributed_checkpoint=False``; this class
    makes the optimizer state portable (by parameter name, not position) and loads both through Lightning's own
    restore path instead of `ModelParallelStrategy`'s sharded-folder loader.
    """

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
            set_optimizer_state_dict(self.lightning_module, optimizer, state, options=options)  # type: ignore[attr-defined]
