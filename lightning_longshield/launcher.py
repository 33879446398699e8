"""Lightning's spawn/fork launcher, returning the full (gathered) weights of an FSDP2-sharded model and the privacy
state of the fit."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from typing_extensions import override

from lightning_longshield.checkpoints import mark_trained
from lightning_longshield.privacy.session import PrivacySession

#: Where rank 0's privacy state travels in the launcher's extra results.
PRIVACY_RESULT_KEY = "longshield_privacy"


class GatheringMultiProcessingLauncher(_MultiProcessingLauncher):
    """After training in spawned (or forked) workers, hand the main process the full state dict, not rank 0's shards,
    and rank 0's privacy state (plan and accountant history: what a checkpoint keeps, never a secret), so that
    ``strategy.get_epsilon()`` and the guarantee read there as on rank 0; and close the workers' process group."""

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

    @override
    def get_extra_results(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Lightning's (the callback metrics) and, after a fit, the privacy session's `state_dict` with the device its
        noise was drawn on (rank 0 only)."""
        extra = super().get_extra_results(trainer)
        session = self._privacy_session()
        state = session.state_dict() if session is not None and trainer.state.fn == TrainerFn.FITTING else None
        if session is not None and state is not None and session.noise is not None:
            extra[PRIVACY_RESULT_KEY] = {"state": state, "noise_device": str(session.noise.device)}
        return extra

    @override
    def update_main_process_results(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        """Restore Lightning's results, load rank 0's privacy state into this process's session, and mark the module
        as trained by it (`mark_trained`)."""
        super().update_main_process_results(trainer, extra)
        result = extra.get(PRIVACY_RESULT_KEY)
        session = self._privacy_session()
        if result is not None and session is not None:
            session.load_finished_fit(result["state"], result["noise_device"])
            mark_trained(trainer.lightning_module, session)

    def _privacy_session(self) -> Optional[PrivacySession]:
        session = getattr(self._strategy, "privacy", None)
        return session if isinstance(session, PrivacySession) else None
