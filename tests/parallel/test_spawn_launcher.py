"""Lightning's spawn launcher: a CP 2 run started from this process returns the full trained weights here (into the
model that ``configure_model`` builds here, every key loaded), and rank 0's privacy state (plan, accountant history),
so that epsilon and the guarantee read here as on rank 0. The weights are gathered and written once, after a fit
only."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn, TrainerState, TrainerStatus
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightning_longshield import CausalLMModule, LongShieldStrategy, launcher
from lightning_longshield.models import Llama
from tests.support.helpers import (
    RandomTokens,
    loader,
    make_module,
    make_trainer,
    reference_dp_sgd,
    samples,
    small_config,
)


class RecordRankZero(L.Callback):
    """Writes the full weights at the start of training to ``folder / "initial.pt"``, and rank 0's privacy plan,
    history and guarantee at its end to ``folder / "rank0.json"`` (a worker's view, for the main process to compare
    with)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        initial = get_model_state_dict(pl_module, options=options)  # a collective: every rank
        if trainer.is_global_zero:
            torch.save(initial, self.folder / "initial.pt")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            privacy = trainer.strategy.privacy
            (self.folder / "rank0.json").write_text(json.dumps({
                "plan": privacy.plan.state_dict(), "history": privacy.accountant.history,
                "guarantee": privacy.describe_guarantee()}))


@pytest.mark.slow
def test_spawned_context_parallel_run_returns_full_weights_and_the_privacy_state(tmp_path):
    dataset = RandomTokens(size=8, seq_len=16)
    # The model is built by configure_model in the workers only: before, Lightning's lenient load dropped every key
    # here and left `module.model` None, yet marked trained.
    module = CausalLMModule(small_config(), optimizer="sgd", learning_rate=1.0)
    strategy = LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=0.05, micro_batch_size=2,
                                  poisson_sampling=False, seed=0, start_method="spawn")
    trainer = make_trainer(strategy, max_steps=1, devices=2, callbacks=[RecordRankZero(tmp_path)])
    trainer.fit(module, loader(dataset, 4))
    initial = Llama(small_config())
    initial.load_state_dict({k.removeprefix("model."): v for k, v in torch.load(tmp_path / "initial.pt").items()})
    expected = reference_dp_sgd(initial, [samples(dataset, range(4))], 0.05, 4)
    assert module.model is not None
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(module.model.state_dict()[name], value, rtol=1e-4, atol=1e-6)

    # Before, the main process's strategy had no plan (get_epsilon raised "No delta yet") and no step.
    rank_zero = json.loads((tmp_path / "rank0.json").read_text())
    assert strategy.privacy_plan.state_dict() == rank_zero["plan"]
    assert strategy.accountant.history == [tuple(run) for run in rank_zero["history"]] == [(0.0, 4 / 8, 1)]
    assert strategy.get_epsilon() == float("inf")
    assert strategy.privacy.describe_guarantee() == rank_zero["guarantee"]
    assert "after 1 step" in rank_zero["guarantee"]
    # Lightning refuses a second fit of a spawn Trainer; the strategy's teardown kept that error, not its own
    with pytest.raises(NotImplementedError, match="creating a new Trainer instance"):
        trainer.fit(module, loader(dataset, 4))


def _main_process(module: CausalLMModule) -> tuple[L.Trainer, launcher.GatheringMultiProcessingLauncher]:
    """A spawn trainer in this process (no worker started) holding ``module``, and its launcher."""
    trainer = make_trainer(LongShieldStrategy(start_method="spawn"), max_steps=1, devices=2)
    trainer.strategy.connect(module)
    assert isinstance(trainer.strategy.launcher, launcher.GatheringMultiProcessingLauncher)
    return trainer, trainer.strategy.launcher


def _worker_output(trainer: L.Trainer, weights_path: Path) -> _WorkerOutput:
    state = TrainerState(fn=TrainerFn.FITTING, status=TrainerStatus.FINISHED)
    return _WorkerOutput(None, str(weights_path), state, None, trainer.strategy.launcher.get_extra_results(trainer))


def test_the_trained_weights_load_into_the_model_configure_model_builds_here(tmp_path):
    trained = make_module(small_config(), seed=1)
    weights = tmp_path / "weights.ckpt"
    torch.save(trained.state_dict(), weights)
    module = CausalLMModule(small_config(), optimizer="sgd", learning_rate=1.0)  # no model yet, as after a spawn
    trainer, spawn = _main_process(module)
    spawn._recover_results_in_main_process(_worker_output(trainer, weights), trainer)
    assert module.model is not None
    for name, value in trained.state_dict().items():
        torch.testing.assert_close(module.state_dict()[name], value, rtol=0, atol=0)
    assert not weights.exists()


def test_the_trained_positions_come_back_from_the_workers_and_stay_in_checkpoints(tmp_path):
    """Set in the workers' set-up (the data's seq_len beyond the checkpoint's positions), they were lost in the main
    process, whose export declared the checkpoint's shorter length; a checkpoint keeps them too."""
    worker_module = CausalLMModule(small_config(), optimizer="sgd", learning_rate=1.0)
    worker_module.trained_positions = 8192
    worker_trainer, worker_spawn = _main_process(worker_module)
    extra = worker_spawn.get_extra_results(worker_trainer)
    trained = make_module(small_config(), seed=1)
    weights = tmp_path / "weights.ckpt"
    torch.save(trained.state_dict(), weights)
    module = CausalLMModule(small_config(), optimizer="sgd", learning_rate=1.0)
    trainer, spawn = _main_process(module)
    output = _worker_output(trainer, weights)
    spawn._recover_results_in_main_process(output._replace(extra={**output.extra, **extra}), trainer)
    assert module.trained_positions == 8192
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    reloaded = CausalLMModule(small_config(), optimizer="sgd", learning_rate=1.0)
    reloaded.on_load_checkpoint(checkpoint)
    assert reloaded.trained_positions == 8192


@pytest.mark.parametrize("fits", [True, False], ids=["fits", "does-not-fit"])
def test_the_privacy_state_is_recovered_and_the_module_marked_trained_only_by_weights_that_load(tmp_path, fits):
    """The fit's privacy state (epsilon, the guarantee) reads in the main process whether or not the weights load;
    the module is marked as trained by the fit only once they have. Weights that do not fit are refused and kept."""
    from lightning_longshield.checkpoints import _TRAINED_BY

    fitted = make_trainer(LongShieldStrategy(noise_multiplier=1.0, target_delta=1e-3), max_steps=1)
    fitted.fit(make_module(small_config(n_layers=1)), loader(RandomTokens(size=8), 4))
    privacy = {launcher.PRIVACY_RESULT_KEY: {"state": fitted.strategy.privacy.state_dict(), "noise_device": "cpu"}}
    state = make_module(small_config(), seed=1).state_dict()
    if not fits:
        state["model.layer_the_worker_added.weight"] = torch.zeros(1)
    weights = tmp_path / "weights.ckpt"
    torch.save(state, weights)
    module = CausalLMModule(small_config(), optimizer="sgd", learning_rate=1.0)
    trainer, spawn = _main_process(module)
    output = _worker_output(trainer, weights)
    output = output._replace(extra={**output.extra, **privacy})
    if fits:
        spawn._recover_results_in_main_process(output, trainer)
    else:
        with pytest.raises(RuntimeError, match=rf"(?s)do not fit CausalLMModule .*layer_the_worker_added.* kept in"
                                               rf" {weights}\. Make configure_model\(\) build the same model"):
            spawn._recover_results_in_main_process(output, trainer)
    assert trainer.strategy.accountant.steps == 1 and trainer.strategy.get_epsilon() > 0
    assert (_TRAINED_BY in module.__dict__) == fits and weights.exists() == (not fits)


@pytest.mark.parametrize("fn", [TrainerFn.FITTING, TrainerFn.VALIDATING])
def test_the_weights_are_gathered_and_written_once_after_a_fit_only(fn, monkeypatch):
    gathered, written = [], []
    full_state = {"model.w": torch.ones(2)}
    monkeypatch.setattr(launcher, "get_model_state_dict", lambda module, options: gathered.append(1) or full_state)
    trainer, spawn = _main_process(make_module(small_config()))
    monkeypatch.setattr(trainer.strategy.checkpoint_io, "save_checkpoint", lambda state, path: written.append(state))
    trainer.state.fn = fn
    output = spawn._collect_rank_zero_results(trainer, results=None)
    fitting = fn == TrainerFn.FITTING
    assert len(gathered) == len(written) == int(fitting)  # before, a gather after validate too, and two writes
    assert written == ([full_state] if fitting else [])
    assert (output.weights_path is not None) == fitting
