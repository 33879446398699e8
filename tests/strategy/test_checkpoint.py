"""Checkpoints (one full file, or sharded on the distributed checkpoint engine) hold the model, the optimizer and the DP
state; a resumed run continues exactly where it stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_longshield import LongShieldStrategy, preemption
from lightning_longshield.durable_checkpoints import is_whole_checkpoint
from lightning_longshield.sharded_checkpoints import is_whole_sharded_checkpoint, read_model_state
from tests.support.helpers import RandomTokens, loader, make_module, make_trainer, small_config

DATA = RandomTokens(size=32, seq_len=8)


def strategy(checkpoint_format: str = "auto"):
    # Exact resumption needs the same noise and Poisson draws: the explicit (test-only) reproducible mode.
    return LongShieldStrategy(noise_multiplier=0.8, max_grad_norm=0.5, micro_batch_size=2, accountant="rdp",
                              target_delta=1e-3, noise_seed=5, checkpoint_format=checkpoint_format)


def module(optimizer: str = "adamw", momentum: float = 0.0):
    return make_module(small_config(n_layers=1), optimizer=optimizer, learning_rate=1e-2, momentum=momentum)


# SGD without momentum keeps no optimizer state (only its hyper-parameters); with momentum, one buffer per parameter.
@pytest.mark.parametrize("checkpoint_format", ["full", "sharded"])
@pytest.mark.parametrize("optimizer, momentum", [("adamw", 0.0), ("sgd", 0.0), ("sgd", 0.9)],
                         ids=["adamw", "sgd", "sgd-momentum"])
def test_resume_continues_the_same_run(tmp_path, optimizer, momentum, checkpoint_format):
    uninterrupted = module(optimizer, momentum)
    reference_strategy = strategy()
    make_trainer(reference_strategy, max_steps=4).fit(uninterrupted, loader(DATA, 4))

    first_half = module(optimizer, momentum)
    first_strategy = strategy(checkpoint_format)
    trainer = make_trainer(first_strategy, max_steps=2)
    trainer.fit(first_half, loader(DATA, 4))
    path = tmp_path / "dp.ckpt"
    trainer.save_checkpoint(path)

    if checkpoint_format == "sharded":
        assert path.is_dir() and (path / "manifest.json").is_file()
        checkpoint = torch.load(path / "meta.pt", weights_only=False)
        state_dict = read_model_state(path)
    else:
        checkpoint = torch.load(path, weights_only=False)
        state_dict = checkpoint["state_dict"]
    assert set(state_dict) == {f"model.{k}" for k in first_half.model.state_dict()}
    for name, value in first_half.model.state_dict().items():
        torch.testing.assert_close(state_dict[f"model.{name}"], value, rtol=0, atol=0)
    assert checkpoint["longshield"]["accountant"]["history"] == [(0.8, 4 / 32, 2)]

    resumed = module(optimizer, momentum)
    resumed_strategy = strategy()  # the seed is the caller's, never read back from the checkpoint
    make_trainer(resumed_strategy, max_steps=4).fit(resumed, loader(DATA, 4), ckpt_path=path)

    assert resumed_strategy.accountant.history == [(0.8, 4 / 32, 4)]
    assert resumed_strategy.get_epsilon() == reference_strategy.get_epsilon()
    for (name, value), expected in zip(resumed.state_dict().items(), uninterrupted.state_dict().values()):
        torch.testing.assert_close(value, expected, msg=lambda m, name=name: f"{name}: {m}")
    if momentum and checkpoint_format == "full":
        assert all("momentum_buffer" in state for state in checkpoint["optimizer_states"][0]["state"].values())


@pytest.mark.parametrize("checkpoint_format", ["full", "sharded"])
def test_a_resume_into_the_module_of_an_earlier_fit_restores_the_optimizer_state(tmp_path, checkpoint_format):
    """The module of the fit that saved (a notebook, a retry loop) still holds that fit's last noisy gradient, and
    torch builds a fresh optimizer's state only while no ``.grad`` is set: a sharded resume read AdamW's moments
    into an empty state and went on without them, silently. Both formats continue the run exactly."""
    uninterrupted = module()
    make_trainer(strategy(), max_steps=4).fit(uninterrupted, loader(DATA, 4))
    same = module()
    trainer = make_trainer(strategy(checkpoint_format), max_steps=2)
    trainer.fit(same, loader(DATA, 4))
    assert any(p.grad is not None for p in same.parameters())
    trainer.save_checkpoint(tmp_path / "dp.ckpt")
    make_trainer(strategy(), max_steps=4).fit(same, loader(DATA, 4), ckpt_path=tmp_path / "dp.ckpt")
    for (name, value), expected in zip(same.state_dict().items(), uninterrupted.state_dict().values()):
        torch.testing.assert_close(value, expected, msg=lambda m, name=name: f"{name}: {m}")


class _TwoProcesses(LongShieldStrategy):
    """The strategy as two processes see it, holding ``lightning_module``, for the choice of format alone."""

    world_size = 2
    lightning_module = None


@pytest.mark.parametrize("parameters, sharded", [(1000, False), (2**27, False), (2**27 + 1, True)])
def test_auto_writes_one_file_for_a_smaller_model_and_shards_a_larger_one(parameters, sharded):
    """``"auto"``: one ``torch.load``-able file (the contract) up to 2^27 parameters, whose full state costs rank 0
    under about 2 GiB; sharded above that with several processes. One process always writes one file."""
    two = _TwoProcesses(noise_multiplier=1.0)
    two.lightning_module = torch.nn.Linear(parameters, 1, bias=False, device="meta")
    assert two.sharded_checkpoints == sharded
    assert _TwoProcesses(noise_multiplier=1.0, checkpoint_format="full").sharded_checkpoints is False
    assert LongShieldStrategy(noise_multiplier=1.0).sharded_checkpoints is False  # one process


def test_momentum_is_sgds_only():
    with pytest.raises(ValueError, match="momentum=0.9 is SGD's"):
        module("adamw", 0.9)


def test_resume_respects_spent_budget(tmp_path):
    """A resumed run counts the steps already taken: it stops when the total reaches the budget."""
    first = LongShieldStrategy(noise_multiplier=1.5, target_epsilon=2.0, target_delta=1e-4, accountant="rdp")
    trainer = make_trainer(first, max_steps=3)
    trainer.fit(module(), loader(DATA, 4))
    trainer.save_checkpoint(tmp_path / "budget.ckpt")
    budget = first.accountant.steps_within_budget(2.0, 1.5, 4 / 32, 1e-4, limit=1000) + 3

    second = LongShieldStrategy(noise_multiplier=1.5, target_epsilon=2.0, target_delta=1e-4, accountant="rdp")
    trainer = make_trainer(second, max_steps=budget + 20)
    trainer.fit(module(), loader(DATA, 4), ckpt_path=tmp_path / "budget.ckpt")
    assert second.accountant.steps == budget == trainer.global_step
    assert second.get_epsilon() <= 2.0


def test_validating_a_checkpoint_keeps_the_runs_accounting_and_a_save_carries_the_checkpoints(tmp_path):
    """``validate(ckpt_path=...)`` after a fit leaves the run's accountant as it was (no step "rolled back"), and a
    save outside fit writes the privacy state of the weights it holds, the loaded checkpoint's."""
    run = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3)
    saves = ModelCheckpoint(dirpath=tmp_path / "checkpoints", filename="{step}", every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(run, max_steps=6, enable_checkpointing=True, callbacks=[saves],
                           default_root_dir=tmp_path)
    model = module()
    trainer.fit(model, loader(DATA, 4))
    guarantee = run.privacy.describe_guarantee()
    trainer.validate(model, loader(DATA, 4), ckpt_path=tmp_path / "checkpoints" / "step=2.ckpt")
    assert run.accountant.steps == 6 and run.privacy.describe_guarantee() == guarantee
    trainer.save_checkpoint(tmp_path / "copy.ckpt")
    history = torch.load(tmp_path / "copy.ckpt", weights_only=False)["longshield"]["accountant"]["history"]
    assert [tuple(entry) for entry in history] == [(1.0, 0.125, 2)]

    fresh = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3)
    validator = make_trainer(fresh, max_steps=1)
    validator.validate(module(), loader(DATA, 4), ckpt_path=tmp_path / "checkpoints" / "step=4.ckpt")
    validator.save_checkpoint(tmp_path / "resaved.ckpt")  # a Trainer that never fitted: the weights' DP history kept
    resumed = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3)
    trainer = make_trainer(resumed, max_steps=2)
    trainer.fit(module(), loader(DATA, 4), ckpt_path=tmp_path / "resaved.ckpt")  # global step 0: the validator's
    assert resumed.accountant.steps == 4 + 2 + 2  # the checkpoint's, the two its ledger holds after it, this fit's


def test_fit_refuses_weights_that_validate_loaded_from_a_run_it_does_not_account(tmp_path):
    """``validate(ckpt_path=...)`` leaves the checkpoint's weights in the module: a ``fit`` without ``ckpt_path`` on
    them would report only its own steps. Refused, naming the fix; ``fit(ckpt_path=...)`` continues that run, and
    the run that wrote the checkpoint may go on training after validating one of its own checkpoints."""
    first = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3)
    trainer = make_trainer(first, max_steps=3)
    trained = module()
    trainer.fit(trained, loader(DATA, 4))
    trainer.save_checkpoint(tmp_path / "run.ckpt")

    second = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3)
    other = make_trainer(second, max_steps=2)
    model = module()
    other.validate(model, loader(DATA, 4), ckpt_path=tmp_path / "run.ckpt")
    with pytest.raises(ValueError, match=r"weights of the DP checkpoint .*run\.ckpt.* its 3 DP steps.*fit\(ckpt_path="):
        other.fit(model, loader(DATA, 4))
    assert second.accountant.steps == 0

    continued = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3)
    make_trainer(continued, max_steps=5).fit(model, loader(DATA, 4), ckpt_path=tmp_path / "run.ckpt")
    assert continued.accountant.steps == 5

    trainer.validate(trained, loader(DATA, 4), ckpt_path=tmp_path / "run.ckpt")  # its own run's checkpoint
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(trained, loader(DATA, 4))
    assert first.accountant.steps == 4


def test_fit_refuses_a_module_another_strategys_fit_trained(tmp_path):
    """A module trained in memory by one strategy's fit, then fit under a new strategy without ``ckpt_path``: the new
    accountant would count only its own steps. Refused, naming the fix; the strategy that trained it fits it again,
    and a resume from its checkpoint takes over its history."""
    first = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3)
    trainer = make_trainer(first, max_steps=2)
    trained = module()
    trainer.fit(trained, loader(DATA, 4))
    trainer.save_checkpoint(tmp_path / "run.ckpt")

    second = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3)
    with pytest.raises(ValueError, match=r"trained by 2 DP steps of a fit under another LongShieldStrategy.*ckpt_path"):
        make_trainer(second, max_steps=2).fit(trained, loader(DATA, 4))
    assert second.accountant.steps == 0

    trainer.fit_loop.epoch_loop.max_steps = 3
    trainer.fit(trained, loader(DATA, 4))  # the strategy that trained it
    assert first.accountant.steps == 3

    resumed = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3)
    make_trainer(resumed, max_steps=4).fit(trained, loader(DATA, 4), ckpt_path=tmp_path / "run.ckpt")
    assert resumed.accountant.steps == 2 + 1 + 2  # the checkpoint's, the one its ledger holds after it, this fit's


def test_a_poisson_run_resumes_with_fixed_batches(tmp_path):
    """The Poisson loader's (empty) state has no loader to go to when the resumed run samples no Poisson batches:
    it is dropped (Lightning refused the resume: "The CombinedLoader has 0 stateful loaders")."""
    first = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3)
    trainer = make_trainer(first, max_steps=2)
    trainer.fit(module(), loader(DATA, 4))
    trainer.save_checkpoint(tmp_path / "poisson.ckpt")
    resumed = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3, poisson_sampling=False)
    with pytest.warns(UserWarning, match="poisson_sampling=False"):
        make_trainer(resumed, max_steps=3).fit(module(), loader(DATA, 4), ckpt_path=tmp_path / "poisson.ckpt")
    assert resumed.accountant.steps == 3


def test_a_checkpoint_of_another_strategy_is_refused_naming_the_fix(tmp_path):
    """Lightning's other strategies key the optimizer state by position: named, not a KeyError from deep inside."""
    import lightning as L

    plain = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    plain.fit(module(), loader(DATA, 4))
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    strategy_ = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3)
    with pytest.raises(ValueError, match="not written by LongShieldStrategy.*load_state_dict.*without ckpt_path"):
        make_trainer(strategy_, max_steps=2).fit(module(), loader(DATA, 4), ckpt_path=tmp_path / "plain.ckpt")


def test_an_asynchronous_save_holds_the_state_of_its_step(tmp_path):
    """A save every 2 steps written in the background while training goes on: after a third step ran, the step-2
    checkpoint is in place, whole, and holds exactly step 2's parameters (the engine copied them when the save
    started), with nothing partial left behind."""
    at_step_2 = module("sgd", 0.9)
    make_trainer(strategy(), max_steps=2).fit(at_step_2, loader(DATA, 4))

    background = LongShieldStrategy(noise_multiplier=0.8, max_grad_norm=0.5, micro_batch_size=2, accountant="rdp",
                                    target_delta=1e-3, noise_seed=5, async_checkpoints=True)
    saves = ModelCheckpoint(dirpath=tmp_path / "checkpoints", filename="{step}", every_n_train_steps=2, save_top_k=-1)
    trained = module("sgd", 0.9)
    make_trainer(background, max_steps=3, enable_checkpointing=True, callbacks=[saves]).fit(trained, loader(DATA, 4))
    path = tmp_path / "checkpoints" / "step=2.ckpt"
    assert is_whole_sharded_checkpoint(path) and not list(path.parent.glob(".*.partial"))
    assert torch.load(path / "meta.pt", weights_only=False)["global_step"] == 2
    saved = read_model_state(path)
    for name, value in at_step_2.model.state_dict().items():
        torch.testing.assert_close(saved[f"model.{name}"], value, rtol=0, atol=0)
    assert any(not torch.equal(saved[f"model.{name}"], value) for name, value in trained.model.state_dict().items())


def test_asynchronous_saves_are_sharded():
    with pytest.raises(ValueError, match="checkpoint_format='sharded'"):
        LongShieldStrategy(noise_multiplier=1.0, async_checkpoints=True, checkpoint_format="full")


class _Sigterm(Callback):
    """Lightning's signal connector as SIGTERM leaves it, after the ``after``-th training or validation batch."""

    def __init__(self, during: str, after: int) -> None:
        self.during, self.after, self.seen = during, after, 0

    def _count(self, trainer) -> None:
        self.seen += 1
        if self.seen == self.after:
            trainer._signal_connector.received_sigterm = True

    def on_train_batch_end(self, trainer, *_) -> None:
        if self.during == "training":
            self._count(trainer)

    def on_validation_batch_end(self, trainer, *_) -> None:
        if self.during == "validation":
            self._count(trainer)


@pytest.mark.parametrize("during, asynchronous", [("training", True), ("validation", False)])
def test_sigterm_leaves_a_whole_last_checkpoint(tmp_path, during, asynchronous):
    """Asynchronous saves: the save at SIGTERM is committed before the process exits (it was left partial, and the
    requeued run started afresh). During a fit's validation: saved too (nothing was, and the job exited 0)."""
    run = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3,
                             async_checkpoints=asynchronous)
    saves = ModelCheckpoint(dirpath=tmp_path / "checkpoints", filename="{step}", every_n_train_steps=100)
    trainer = make_trainer(run, max_steps=6, enable_checkpointing=True, callbacks=[saves, _Sigterm(during, 2)],
                           val_check_interval=2, limit_val_batches=3)
    with pytest.raises(SystemExit):
        trainer.fit(module(), loader(DATA, 4), loader(DATA, 4))
    last = tmp_path / "checkpoints" / "last.ckpt"
    whole = is_whole_sharded_checkpoint(last) if asynchronous else is_whole_checkpoint(last)
    assert whole and not list(last.parent.glob(".*.partial"))
    resumed = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3)
    make_trainer(resumed, max_steps=6).fit(module(), loader(DATA, 4), ckpt_path=last)
    assert resumed.accountant.steps == 6


def test_sigterm_names_the_absolute_path_to_resume_from_under_a_versioned_logger(tmp_path, monkeypatch):
    """A ModelCheckpoint without ``dirpath`` saves in the logger's version folder, which a requeued run's
    ``ckpt_path="last"`` does not search (it starts afresh in the next version): the message names the file itself,
    saved under the ModelCheckpoint's own last-checkpoint name."""
    messages: list[str] = []
    monkeypatch.setattr(preemption, "rank_zero_info", messages.append)
    saves = ModelCheckpoint(filename="{step}", every_n_train_steps=100)
    saves.CHECKPOINT_NAME_LAST = "preempted"
    trainer = make_trainer(LongShieldStrategy(noise_multiplier=1.0), max_steps=4, enable_checkpointing=True,
                           logger=CSVLogger(tmp_path), callbacks=[saves, _Sigterm("training", 1)])
    with pytest.raises(SystemExit):
        trainer.fit(module(), loader(DATA, 4))
    path = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "preempted.ckpt"
    assert is_whole_checkpoint(path)
    assert f"fit(ckpt_path={str(path)!r})" in messages[-1] and "'last'" in messages[-1] and "dirpath" in messages[-1]
    # The end of fit, which states the guarantee, does not come: the steps before the stop are stated here.
    assert messages[-2].startswith("SIGTERM at step 1. Privacy guarantee: (epsilon=") and "after 1 steps run" in \
        messages[-2]


def test_an_asynchronous_save_removes_the_checkpoint_it_supersedes_once_committed(tmp_path):
    """``save_top_k=1``: the superseded checkpoint stays until the newer one is whole, so a crash at any moment after
    the first save finds one whole checkpoint (the superseded one was removed as soon as the next save began)."""
    folder = tmp_path / "checkpoints"
    seen: list[list[str]] = []

    class Listing(Callback):
        def on_train_batch_start(self, trainer, *_) -> None:
            if trainer.global_step:
                seen.append(sorted(p.name for p in folder.iterdir() if is_whole_sharded_checkpoint(p)))

    run = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3, async_checkpoints=True)
    saves = ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=1, save_top_k=1,
                            monitor="step", mode="max")
    make_trainer(run, max_steps=4, enable_checkpointing=True, callbacks=[saves, Listing()]).fit(module(),
                                                                                              loader(DATA, 4))
    assert len(seen) == 3 and all(seen[1:]), seen  # before step 2 the first save may still be under way
    assert sorted(p.name for p in folder.iterdir()) == ["step=4.ckpt"]


def test_an_asynchronous_save_that_last_ckpt_links_to_is_whole_before_the_link(tmp_path):
    """``save_last="link"`` links ``last.ckpt`` to a save as soon as it returns: a crash before a background save was
    committed left the link dangling, and ``fit(ckpt_path="last")`` then started from scratch. Such saves are
    committed before they return."""
    folder = tmp_path / "checkpoints"

    class Crash(Callback):
        def on_train_batch_start(self, trainer, *_) -> None:
            if trainer.global_step == 2:
                raise RuntimeError("crash")

    run = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3, async_checkpoints=True)
    saves = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=1, save_last="link")
    with pytest.raises(RuntimeError, match="crash"):
        make_trainer(run, max_steps=4, enable_checkpointing=True, callbacks=[saves, Crash()]).fit(module(),
                                                                                                  loader(DATA, 4))
    last = folder / "last.ckpt"
    assert last.is_symlink() and is_whole_sharded_checkpoint(last.resolve())
    assert torch.load(last / "meta.pt", weights_only=False)["global_step"] == 2


def test_an_asynchronous_save_holds_lightnings_state_of_its_step(tmp_path):
    """Lightning's state (``meta.pt``) was serialised at the commit, a step later, from objects that live on: the
    step-1 checkpoint's ModelCheckpoint state listed the step-2 checkpoint among its best, which a resume would keep
    (and later delete files by)."""
    folder = tmp_path / "checkpoints"
    run = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3, async_checkpoints=True)
    saves = ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=1, save_top_k=-1, monitor="step",
                            mode="max")
    make_trainer(run, max_steps=3, enable_checkpointing=True, callbacks=[saves]).fit(module(), loader(DATA, 4))
    for step in (1, 2, 3):
        meta = torch.load(folder / f"step={step}.ckpt" / "meta.pt", weights_only=False)
        state = next(value for key, value in meta["callbacks"].items() if key.startswith("ModelCheckpoint"))
        assert sorted(Path(name).name for name in state["best_k_models"]) == [f"step={s}.ckpt" for s in
                                                                               range(1, step + 1)]


def test_several_processes_stop_together_on_sigterm_even_without_checkpointing():
    """Lightning's SIGTERM handler deadlocks several processes signalled apart: every fit of several processes gets a
    `PreemptionCheckpoint`, which without checkpointing stops them together and saves nothing; one process without
    checkpointing keeps Lightning's own (no collective there)."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_longshield.callbacks import PrivacyMonitor, add_training_callbacks

    def added(world_size: int, checkpointing: bool) -> list[type]:
        trainer = SimpleNamespace(callbacks=[], world_size=world_size,
                                  checkpoint_callbacks=[ModelCheckpoint()] if checkpointing else [])
        add_training_callbacks(trainer)
        return [type(callback) for callback in trainer.callbacks]

    assert added(2, checkpointing=False) == [PrivacyMonitor, preemption.PreemptionCheckpoint]
    assert added(1, checkpointing=True) == [PrivacyMonitor, preemption.PreemptionCheckpoint]
    assert added(1, checkpointing=False) == [PrivacyMonitor]

    saved = []
    trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING), sanity_checking=False, global_step=3,
                              checkpoint_callbacks=[], save_checkpoint=saved.append, world_size=2,
                              _signal_connector=SimpleNamespace())
    preemption.PreemptionCheckpoint().on_exception(trainer, None, SIGTERMException())
    assert saved == []


def test_resuming_a_checkpoint_without_privacy_state_is_warned_about(tmp_path):
    """A checkpoint whose privacy state was taken out (or never written: saved outside a DP fit) started the
    accounting at 0 in silence, the guarantee printed for the resumed fit's steps alone."""
    trainer = make_trainer(strategy(), max_steps=2)
    trainer.fit(module(), loader(DATA, 4))
    trainer.save_checkpoint(tmp_path / "dp.ckpt")
    checkpoint = torch.load(tmp_path / "dp.ckpt", weights_only=False)
    del checkpoint["longshield"]
    torch.save(checkpoint, tmp_path / "stripped.ckpt")
    resumed = strategy()
    with pytest.warns(UserWarning, match=r"holds no privacy state .* after 2 steps: they are not accounted"):
        make_trainer(resumed, max_steps=3).fit(module(), loader(DATA, 4), ckpt_path=tmp_path / "stripped.ckpt")
    assert resumed.accountant.steps == 1
