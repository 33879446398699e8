"""Lightning's spawn/fork launcher, returning the full (gathered) weights of an FSDP2-sharded model."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from typing_extensions import override


class GatheringMultiProcessingLauncher(_MultiProcessingLauncher):
    """After training in spawned workers, hand the main process the full state dict, not rank 0's shards, and close
    the workers' process group."""

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Optional[_WorkerOutput]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered whole: a collective
        full_state = get_model_state_dict(self._strategy.lightning_module, options=options)
        output = super()._collect_rank_zero_results(trainer, results)
        if output is not None and output.weights_path is not None:
            self._strategy.checkpoint_io.save_checkpoint(full_state, output.weights_path)
        # Close the process group in the worker, once every rank is done with it, instead of leaving it to
        # interpreter exit (a worker once aborted there: "terminate called without an active exception").
        self._strategy.barrier()
        _destroy_dist_connection()
        return output
