"""Lightning's spawn/fork launcher, returning the full (gathered) weights of an FSDP2-sharded model and the privacy
state of the fit."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from typing_extensions import override

from lightning_longshield.checkpoints import mark_trained
from lightning_longshield.privacy.session import PrivacySession

#: Where rank 0's privacy state travels in the launcher's extra results.
PRIVACY_RESULT_KEY = "longshield_privacy"
#: Where `CausalLMModule.trained_positions` travels (set in the workers' set-up, read by an export here).
TRAINED_POSITIONS_RESULT_KEY = "longshield_trained_positions"


class GatheringMultiProcessingLauncher(_MultiProcessingLauncher):
    """After training in spawned (or forked) workers, hand the main process the full state dict, not rank 0's shards,
    and rank 0's privacy state (plan and accountant history: what a checkpoint keeps, never a secret), so that
    ``strategy.get_epsilon()`` and the guarantee read there as on rank 0; and close the workers' process group.

    The main process builds the module's model (``configure_model``, on the CPU) and loads the trained weights into it
    strictly: a module is never marked as trained with weights that were not loaded."""

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Optional[_WorkerOutput]:
        """Lightning's, with the weights gathered whole (a collective) and written once by rank 0, after a fit only."""
        full_state = None
        if trainer.state.fn == TrainerFn.FITTING:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            full_state = get_model_state_dict(self._strategy.lightning_module, options=options)
        output = None
        if self._strategy.local_rank == 0:
            weights_path = None
            if full_state is not None:
                # A folder of its own: the file system may be shared between nodes.
                weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
                self._strategy.checkpoint_io.save_checkpoint(full_state, weights_path)
            callback = trainer.checkpoint_callback
            best_model_path = getattr(callback, "best_model_path", None) if callback is not None else None
            output = _WorkerOutput(best_model_path, weights_path, trainer.state, results,
                                   self.get_extra_results(trainer))
        # Close the process group in the worker, once every rank is done with it, instead of leaving it to
        # interpreter exit (a worker once aborted there: "terminate called without an active exception").
        self._strategy.barrier()
        _destroy_dist_connection()
        return output

    @override
    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: pl.Trainer) -> None:
        """Lightning's results and `update_main_process_results` (the privacy state: the guarantee reads here even if
        the weights do not load), then the trained weights, loaded strictly (Lightning's load is lenient: into a model
        that ``configure_model`` never built here it dropped every key); only then is the module marked trained."""
        weights_path = worker_output.weights_path
        super()._recover_results_in_main_process(worker_output._replace(weights_path=None), trainer)
        if weights_path is None:
            return
        load_trained_weights(trainer, weights_path)
        self._strategy.checkpoint_io.remove_checkpoint(weights_path)
        session = self._privacy_session()
        if session is not None and session.plan is not None:
            mark_trained(trainer.lightning_module, session)

    @override
    def get_extra_results(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Lightning's (the callback metrics), the module's ``trained_positions`` where it has them and, after a fit,
        the privacy session's `state_dict` with the device its noise was drawn on (rank 0 only)."""
        extra = super().get_extra_results(trainer)
        positions = getattr(trainer.lightning_module, "trained_positions", None)  # `CausalLMModule`'s, for its export
        if positions is not None:
            extra[TRAINED_POSITIONS_RESULT_KEY] = positions
        session = self._privacy_session()
        state = session.state_dict() if session is not None and trainer.state.fn == TrainerFn.FITTING else None
        if session is not None and state is not None and session.noise is not None:
            extra[PRIVACY_RESULT_KEY] = {"state": state, "noise_device": str(session.noise.device)}
        return extra

    @override
    def update_main_process_results(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        """Restore Lightning's results and the module's ``trained_positions``, and load rank 0's privacy state into
        this process's session (the module is marked trained by it, `mark_trained`, once its weights have loaded)."""
        super().update_main_process_results(trainer, extra)
        if TRAINED_POSITIONS_RESULT_KEY in extra:
            trainer.lightning_module.trained_positions = extra[TRAINED_POSITIONS_RESULT_KEY]
        result = extra.get(PRIVACY_RESULT_KEY)
        session = self._privacy_session()
        if result is not None and session is not None:
            session.load_finished_fit(result["state"], result["noise_device"])

    def _privacy_session(self) -> Optional[PrivacySession]:
        session = getattr(self._strategy, "privacy", None)
        return session if isinstance(session, PrivacySession) else None


def load_trained_weights(trainer: pl.Trainer, weights_path: str) -> None:
    """Build the module's model in this process (``configure_model`` on the CPU, in the precision's dtype; a model
    built already stays) and load the weights the workers trained into it, every key. A mismatch raises, naming the
    file the weights stay in."""
    module = trainer.lightning_module
    state = trainer.strategy.checkpoint_io.load_checkpoint(weights_path)
    with torch.device("cpu"), trainer.precision_plugin.module_init_context():
        module.configure_model()
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise RuntimeError(
            f"The weights trained in the spawned processes do not fit {type(module).__name__} in the main process"
            f" ({error}); they are kept in {weights_path}. Make configure_model() build the same model in every"
            " process (here it runs on the CPU before the weights are loaded; it must be idempotent), or launch"
            " without spawning: LongShieldStrategy(start_method='popen') with torchrun."
        ) from error
