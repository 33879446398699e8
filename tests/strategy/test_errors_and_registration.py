"""Registration in Lightning and clear errors for bad input (nothing half-done)."""

from __future__ import annotations

import sys
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

import lightning_longshield  # noqa: F401  (registers the strategy)
from lightning_longshield import CausalLMModule, LongShieldStrategy
from lightning_longshield.models import Llama, LlamaConfig
from simulate.specs import get_model_spec
from tests.support.helpers import RandomTokens, full_state, loader, make_module, make_trainer, small_config


def test_registered_names():
    trainer = L.Trainer(strategy="longshield", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, LongShieldStrategy)
    assert trainer.strategy._start_method == "popen"
    trainer = L.Trainer(strategy="longshield_spawn", accelerator="cpu", devices=1, logger=False)
    assert trainer.strategy._start_method == "spawn"


def test_string_strategy_trains_with_defaults():
    trainer = L.Trainer(strategy="longshield", accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(make_module(small_config(n_layers=1)), loader(RandomTokens(size=16, seq_len=8), 4))
    assert trainer.global_step == 1
    assert trainer.strategy.privacy_plan.target_epsilon == 8.0


def test_a_single_process_keeps_plain_tracebacks(monkeypatch):
    """torch.distributed prefixes every traceback line with "[rank0]:"; alone on one process that is noise."""
    monkeypatch.setattr("sys.excepthook", sys.__excepthook__)
    make_trainer(LongShieldStrategy(noise_multiplier=1.0), max_steps=1).fit(
        make_module(small_config(n_layers=1)), loader(RandomTokens(size=8, seq_len=8), 2)
    )
    assert sys.excepthook is sys.__excepthook__


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(noise_multiplier=0.0, target_epsilon=3.0), "conflicts with target_epsilon"),
        (dict(noise_multiplier=-1.0), "noise_multiplier must be >= 0"),
        (dict(target_epsilon=0.0), "target_epsilon must be > 0"),
        (dict(target_delta=1.5), "target_delta must be in"),
        (dict(max_grad_norm=0.0), "max_grad_norm must be > 0"),
        (dict(max_grad_norm=1e-20), "max_grad_norm=1e-20 is below 1e-06: the norms are formed from fp32 squares"),
        (dict(micro_batch_size=0), "micro_batch_size must be an integer >= 1"),
        (dict(accountant="gdp"), "accountant='gdp' is not supported"),
        (dict(exchange="diagonal"), "exchange='diagonal': choose one of"),
        (dict(context_parallel_size=0), "context_parallel_size must be a positive integer"),
        (dict(communication_bucket_mb=-1), "communication_bucket_mb must be >= 0"),
        (dict(secure_mode=True, noise_seed=1), "remove noise_seed"),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LongShieldStrategy(**kwargs)


def fit(strategy, module=None, data=None, **trainer_kwargs):
    module = module or make_module(small_config(n_layers=1))
    data = data if data is not None else loader(RandomTokens(size=8, seq_len=8), 2)
    make_trainer(strategy, max_steps=1, **trainer_kwargs).fit(module, data)
    return module


def test_gradient_clip_val_is_refused():
    with pytest.raises(ValueError, match="remove gradient_clip_val"):
        fit(LongShieldStrategy(noise_multiplier=1.0), gradient_clip_val=1.0)


def test_accumulate_grad_batches_is_refused():
    with pytest.raises(ValueError, match="accumulate_grad_batches must be 1"):
        fit(LongShieldStrategy(noise_multiplier=1.0), accumulate_grad_batches=2)


def test_fp16_grad_scaler_is_refused():
    # On CPU Lightning maps precision="16-mixed" to bf16; pass the fp16 plugin (as on CUDA) explicitly.
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="GradScaler is not supported"):
        fit(LongShieldStrategy(noise_multiplier=1.0), plugins=[plugin])


def test_fp16_without_loss_scaling_is_refused():
    with pytest.raises(ValueError, match="'16-true'.*Use precision='bf16-true'"):
        fit(LongShieldStrategy(noise_multiplier=1.0), precision="16-true")


def test_fp64_parameters_are_refused_before_training():
    """Lightning refuses precision='64-true' for the strategy; a model converted to fp64 by hand is refused too."""
    module = make_module(small_config(n_layers=1)).double()
    with pytest.raises(ValueError, match=r"model.tok_embeddings.weight \(torch.float64\).*precision="):
        fit(LongShieldStrategy(noise_multiplier=1.0), module=module)


def test_unsupported_layer_is_refused_before_training():
    """Refused as the DP engine is built, after the blocks were wrapped for checkpointing: the wrappers are taken off
    again (left on, a later fit's per-sample capture would run inside them)."""
    from lightning_longshield.activation_checkpointing import CheckpointedForward

    module = make_module(small_config(n_layers=1))
    module.model.extra = torch.nn.Conv1d(2, 2, 1)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(TypeError, match=r"model.extra \(Conv1d\)"):
        fit(LongShieldStrategy(noise_multiplier=1.0, activation_checkpointing=True), module=module)
    assert all(torch.equal(v, before[k]) for k, v in full_state(module).items())
    assert not any(isinstance(m.__dict__.get("forward"), CheckpointedForward) for m in module.modules())


def test_embedding_with_max_norm_is_refused_before_training():
    """nn.Embedding(max_norm=...) would renormalise the sampled batch's rows in place, without noise: refused before
    the first forward, the weights untouched."""
    module = make_module(small_config(n_layers=1))
    module.model.tok_embeddings.max_norm = 0.01
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ValueError, match=r"model.tok_embeddings \(max_norm=0.01\).*without max_norm"):
        fit(LongShieldStrategy(noise_multiplier=1.0), module=module)
    assert all(torch.equal(v, before[k]) for k, v in full_state(module).items())


def test_a_trainable_sparse_embedding_is_refused_before_training():
    module = make_module(small_config(n_layers=1))
    module.model.tok_embeddings.sparse = True
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ValueError, match=r"model.tok_embeddings \(sparse=True\).*sparse=False"):
        fit(LongShieldStrategy(noise_multiplier=1.0), module=module)
    assert all(torch.equal(v, before[k]) for k, v in full_state(module).items())


def test_empty_dataset_is_refused():
    with pytest.raises(ValueError, match="training dataset is empty"):
        fit(LongShieldStrategy(noise_multiplier=1.0), data=DataLoader(RandomTokens(size=0), batch_size=2))


def test_missing_labels_are_named():
    class NoLabels(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"input_ids": torch.zeros(8, dtype=torch.long)}

    with pytest.raises(ValueError, match="'input_ids' and 'labels'"):
        fit(LongShieldStrategy(noise_multiplier=1.0, poisson_sampling=False), data=DataLoader(NoLabels(), batch_size=2))


def test_context_parallel_size_must_divide_world_size():
    with pytest.raises(ValueError, match="context_parallel_size=2 must be a positive divisor"):
        fit(LongShieldStrategy(noise_multiplier=1.0, context_parallel_size=2))


def test_manual_optimization_is_refused():
    module = make_module(small_config(n_layers=1))
    module.automatic_optimization = False
    with pytest.raises(ValueError, match="automatic_optimization=True"):
        fit(LongShieldStrategy(noise_multiplier=1.0), module=module)


@pytest.mark.parametrize("policy, error", [(0, ValueError), ("every", TypeError)])
def test_invalid_checkpointing_policy(policy, error):
    with pytest.raises(error, match="activation_checkpointing"):
        LongShieldStrategy(activation_checkpointing=policy)


@pytest.mark.parametrize(
    "name, published",
    [("llama3.2-1b", 1.236e9), ("llama3.2-3b", 3.213e9), ("llama3.1-8b", 8.030e9), ("llama3.1-70b", 70.554e9)],
)
def test_presets_have_the_published_parameter_counts(name, published):
    """Meta's model cards: 1.24B, 3.21B, 8.03B and 70.6B parameters (tied embeddings in 1B and 3B)."""
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name(name))
    count = sum(p.numel() for p in model.parameters())
    assert count == get_model_spec(name).num_parameters
    assert count == pytest.approx(published, rel=2e-3)


def test_an_optimizer_that_evaluates_its_closure_twice_is_refused_after_one_release():
    """LBFGS calls the closure up to ``max_iter`` times per step: each call would release the same Poisson batch
    again with fresh noise, accounted as a new batch. The second evaluation is refused; one release was made."""

    class LBFGSModule(type(make_module(small_config(n_layers=1)))):
        def configure_optimizers(self):
            return torch.optim.LBFGS([p for p in self.parameters() if p.requires_grad], lr=0.1, max_iter=4,
                                     tolerance_grad=0.0, tolerance_change=0.0)

    module = LBFGSModule(small_config(n_layers=1), optimizer="sgd", learning_rate=0.1)
    strategy = LongShieldStrategy(noise_multiplier=1.0)
    with pytest.raises(RuntimeError, match="LBFGS evaluated its closure more than once"):
        fit(strategy, module=module)
    assert strategy.accountant.steps == 1


def test_a_logical_batch_released_twice_is_refused():
    """An ``optimizer_step`` override that steps twice on one batch ran ``training_step`` on it again and released it
    with fresh noise: the same Poisson batch at noise sigma / sqrt(2), accounted as two independent batches (3
    optimizer steps gave 6 accounted steps). The second run of the batch is refused; one release was made."""

    class TwoStepsABatch(type(make_module(small_config(n_layers=1)))):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
            optimizer.step(closure=optimizer_closure)
            optimizer.step(closure=optimizer_closure)

    strategy = LongShieldStrategy(noise_multiplier=1.0)
    module = TwoStepsABatch(small_config(n_layers=1), optimizer="sgd", learning_rate=0.1)
    with pytest.raises(RuntimeError, match="This logical batch was already released"):
        make_trainer(strategy, max_steps=3).fit(module, loader(RandomTokens(size=8, seq_len=8), 2))
    assert strategy.accountant.steps == 1


def test_a_logical_batch_left_unreleased_is_refused_before_the_next_one():
    """Two Poisson batches must never be released as one DP step (a sample drawn in both would add up to 2 C): an
    ``optimizer_step`` override that runs the closure without ``optimizer.step`` on some batches is refused at the
    next batch; gradient accumulation switched on at a later epoch (``GradientAccumulationScheduler``) is refused
    before any step (it was refused only at that epoch, after the first one's releases)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    class ClosureOnly(type(make_module(small_config(n_layers=1)))):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
            if batch_idx % 2:
                optimizer.step(closure=optimizer_closure)
            else:
                optimizer_closure()

    strategy = LongShieldStrategy(noise_multiplier=1.0, poisson_sampling=False)
    module = ClosureOnly(small_config(n_layers=1), optimizer="sgd", learning_rate=0.1)
    with pytest.raises(RuntimeError, match="must call optimizer.step"):
        make_trainer(strategy, max_steps=2).fit(module, loader(RandomTokens(size=8, seq_len=8), 2))
    assert strategy.accountant.steps == 0
    strategy = LongShieldStrategy(noise_multiplier=1.0, poisson_sampling=False)
    with pytest.raises(ValueError, match="no GradientAccumulationScheduler"):
        fit(strategy, callbacks=[GradientAccumulationScheduler({1: 2})])
    assert strategy.accountant.steps == 0


def test_training_data_changed_during_fit_is_refused():
    """A reloaded DataLoader with another batch size (or dataset) would sample at another rate than the plan's: the
    accountant would record the planned rate (epsilon 1.34 reported against 2.69 spent in one such run)."""

    class Curriculum(type(make_module(small_config(n_layers=1)))):
        def train_dataloader(self):
            return loader(RandomTokens(size=16, seq_len=8), 2 if self.trainer.current_epoch == 0 else 8)

    strategy = LongShieldStrategy(noise_multiplier=1.0)
    module = Curriculum(small_config(n_layers=1), optimizer="sgd", learning_rate=0.1)
    trainer = make_trainer(strategy, max_steps=-1, max_epochs=2, reload_dataloaders_every_n_epochs=1)
    with pytest.raises(ValueError, match="The training DataLoader changed during fit"):
        trainer.fit(module)
    assert strategy.privacy_plan.sample_rate == 2 / 16
    strategy = LongShieldStrategy(noise_multiplier=1.0)  # a new fit may take other data
    trainer = make_trainer(strategy, max_steps=1)
    module = make_module(small_config(n_layers=1))
    trainer.fit(module, loader(RandomTokens(size=16, seq_len=8), 2))
    trainer.fit_loop.epoch_loop.max_steps = 2
    trainer.fit(module, loader(RandomTokens(size=16, seq_len=8), 8))
    assert strategy.accountant.steps == 2 and strategy.privacy_plan.sample_rate == 8 / 16


def test_an_iterable_training_dataset_is_refused_with_the_fix():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(RandomTokens(size=8, seq_len=8))

    with pytest.raises(TypeError, match="Use a map-style dataset"):
        fit(LongShieldStrategy(noise_multiplier=1.0), data=torch.utils.data.DataLoader(Stream(), batch_size=2))


@pytest.mark.parametrize("callback", ["LearningRateFinder", "SpikeDetection"])
def test_callbacks_that_act_on_unnoised_training_losses_are_refused(callback, tmp_path):
    """The learning-rate finder's trial steps are DP steps over the private data, and it picks the rate from their
    un-noised losses. SpikeDetection kept the sampled batches' losses in checkpoints, wrote the indices of spiking
    batches to a file and stopped the run on them."""
    from lightning.pytorch import callbacks

    strategy = LongShieldStrategy(noise_multiplier=1.0)
    message = {"LearningRateFinder": "learning-rate finder", "SpikeDetection": "SpikeDetection is not supported"}
    with pytest.raises(ValueError, match=message[callback]):
        fit(strategy, callbacks=[getattr(callbacks, callback)()], default_root_dir=tmp_path)
    assert strategy.accountant.steps == 0 and not (tmp_path / "skip_batches.json").exists()


@pytest.mark.parametrize("minimum", [dict(min_steps=50), dict(min_epochs=20)])
def test_minimums_beyond_the_budget_are_refused_before_any_step(minimum):
    """Lightning keeps training past the budget's stop until min_steps / min_epochs are met; the release beyond the
    budget is refused, so the fit crashed mid-way. Refused at the start, with the numbers."""
    strategy = LongShieldStrategy(noise_multiplier=0.8, target_epsilon=3.0)
    with pytest.raises(ValueError, match="asks for more steps than the privacy budget allows"):
        make_trainer(strategy, max_steps=50, **minimum).fit(make_module(small_config(n_layers=1)),
                                                             loader(RandomTokens(size=16, seq_len=8), 4))
    assert strategy.accountant.steps == 0


def test_minimums_within_max_steps_and_the_budget_train():
    """``max_steps`` ends a fit before the minimums (Lightning sets ``min_epochs=1`` with ``min_steps``): a minimum
    the budget covers up to ``max_steps`` is not refused, even where an epoch is longer than the run."""
    strategy = LongShieldStrategy(target_epsilon=8.0)
    make_trainer(strategy, max_steps=3, min_steps=2).fit(make_module(small_config(n_layers=1)),
                                                         loader(RandomTokens(size=64, seq_len=8), 4))
    assert strategy.accountant.steps == 3


@pytest.mark.parametrize("arguments", [dict(target_epsilon=8.0), dict(noise_multiplier=1.0, target_epsilon=50.0)],
                         ids=["calibrated", "given-noise"])
def test_a_second_fit_continues_the_first_fits_plan_as_a_resume_does(arguments):
    """Calibrated to target_epsilon on its first fit, the strategy's second fit keeps that noise, budget and delta
    (it does not calibrate again over steps already taken). On a smaller dataset the default delta, 1 / (10 N), would
    have been larger: the first fit's smaller one states the guarantee of every step, with a warning that the data
    changed."""
    strategy = LongShieldStrategy(**arguments)
    trainer = make_trainer(strategy, max_steps=2)
    module = make_module(small_config(n_layers=1))
    trainer.fit(module, loader(RandomTokens(size=16, seq_len=8), 2))
    first = strategy.privacy_plan
    assert first.delta == pytest.approx(1 / 160) and strategy.accountant.steps == 2
    trainer.fit_loop.epoch_loop.max_steps = 3
    with pytest.warns(UserWarning, match="trained on 16 records with 8"):
        trainer.fit(module, loader(RandomTokens(size=8, seq_len=8), 2))
    second = strategy.privacy_plan
    assert (second.noise_multiplier, second.delta, second.target_epsilon) == (
        first.noise_multiplier, first.delta, first.target_epsilon)
    assert strategy.accountant.steps <= 3 and strategy.get_epsilon() <= arguments["target_epsilon"]


def test_the_throughput_monitor_is_warned_about():
    """It logs the running count of sampled samples (e.g. 18, 35, 59, 75) through the logger connector, which the
    metric guard does not see."""
    from lightning.pytorch.callbacks import ThroughputMonitor

    # A Poisson batch can be empty, and Lightning's Throughput refuses a running sample count below the batch count.
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: max(1, batch["input_ids"].shape[0]))
    with pytest.warns(UserWarning, match="ThroughputMonitor logs the samples of every training batch"):
        fit(LongShieldStrategy(noise_multiplier=1.0), callbacks=[monitor])


@pytest.mark.parametrize("monitor", ["profiler", "device_stats"])
def test_monitors_that_count_the_micro_batches_are_warned_about(monitor, tmp_path):
    """A profiler's report counts the per-micro-batch hooks (the sampled records, at micro-batch size 1) and
    DeviceStatsMonitor's allocation counts grow with them: the Poisson batch sizes, outside the guarantee."""
    from lightning.pytorch.callbacks import DeviceStatsMonitor
    from lightning.pytorch.loggers import CSVLogger

    if monitor == "profiler":
        with pytest.warns(UserWarning, match=r"profiler \(SimpleProfiler\) .* counts the sampled records"):
            fit(LongShieldStrategy(noise_multiplier=1.0), profiler="simple")
    else:
        with pytest.warns(UserWarning, match="DeviceStatsMonitor logs the device's memory statistics"):
            fit(LongShieldStrategy(noise_multiplier=1.0), callbacks=[DeviceStatsMonitor(cpu_stats=False)],
                logger=CSVLogger(tmp_path))


@pytest.mark.parametrize("sanity_steps", [0, 1], ids=["validation-after-training-data", "sanity-check-first"])
def test_validation_on_the_training_dataset_is_warned_about(sanity_steps):
    """Its loss on the private training records is logged without noise; a held-out dataset is not flagged."""
    training = RandomTokens(size=8, seq_len=8)
    with pytest.warns(UserWarning, match="A validation DataLoader reads the training dataset itself"):
        make_trainer(LongShieldStrategy(noise_multiplier=1.0), max_steps=1, num_sanity_val_steps=sanity_steps,
                     limit_val_batches=1).fit(make_module(small_config(n_layers=1)), loader(training, 2),
                                              loader(training, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(LongShieldStrategy(noise_multiplier=1.0), max_steps=1, num_sanity_val_steps=sanity_steps,
                     limit_val_batches=1).fit(make_module(small_config(n_layers=1)), loader(training, 2),
                                              loader(RandomTokens(size=4, seq_len=8), 2))
    assert not any("reads the training dataset" in str(w.message) for w in caught)


def test_a_micro_batch_size_above_the_batch_size_is_warned_about():
    with pytest.warns(UserWarning, match=r"micro_batch_size=64 is above the DataLoader.s batch_size=2.*at or below"):
        fit(LongShieldStrategy(noise_multiplier=1.0, micro_batch_size=64))


def test_training_data_that_differs_across_ranks_is_refused(monkeypatch):
    """The strategy compares every rank's dataset size and batch size before the plan (here another rank's, as the
    all-gather would return it); the collective itself runs in tests/parallel/test_same_training_data.py."""
    monkeypatch.setattr("lightning_longshield.trainer_checks.all_gathered", lambda value: [value, (15, *value[1:])])
    strategy = LongShieldStrategy(noise_multiplier=1.0)
    with pytest.raises(ValueError, match="rank 0: 16 samples, batch_size=2; rank 1: 15 samples, batch_size=2"):
        make_trainer(strategy, max_steps=1).fit(make_module(small_config(n_layers=1)),
                                                loader(RandomTokens(size=16, seq_len=8), 2))
    assert strategy.accountant.steps == 0


@pytest.mark.parametrize("limits", [dict(), dict(max_steps=3), dict(noise_multiplier=1.0)], ids=str)
def test_noise_calibrated_to_lightnings_default_of_1000_epochs_is_warned(limits):
    """With neither max_steps nor max_epochs Lightning plans 1000 epochs, and target_epsilon alone calibrates the
    noise to spend the budget over all of them. Warned with the fix; not with a step limit or a given noise."""
    class StopAtOnce(L.Callback):
        def on_train_start(self, trainer, pl_module):
            trainer.should_stop = True

    noise = {"noise_multiplier": limits.pop("noise_multiplier")} if "noise_multiplier" in limits else {}
    strategy = LongShieldStrategy(target_epsilon=8.0, **noise)
    trainer = make_trainer(strategy, max_steps=limits.get("max_steps", -1), callbacks=[StopAtOnce()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(make_module(small_config(n_layers=1)), loader(RandomTokens(size=16, seq_len=8), 4))
    warned = [str(w.message) for w in caught if "Neither max_steps nor max_epochs is set" in str(w.message)]
    if limits or noise:
        assert not warned
    else:
        assert len(warned) == 1 and "plans 4000 steps" in warned[0] and "Set max_steps" in warned[0]
    assert trainer.global_step == 0


def test_an_optimizer_tensor_the_module_does_not_register_is_refused():
    """A trainable tensor kept as a plain attribute and handed to the optimizer got its summed, unclipped gradient
    applied without noise (with ``optimizer_zero_grad`` overridden; else it silently never trained)."""

    class WithTemperature(type(make_module(small_config(n_layers=1)))):
        def configure_optimizers(self):
            self.temperature = torch.ones((), requires_grad=True)
            return torch.optim.SGD([*self.parameters(), self.temperature], lr=0.1)

    strategy = LongShieldStrategy(noise_multiplier=1.0)
    module = WithTemperature(small_config(n_layers=1), optimizer="sgd", learning_rate=0.1)
    with pytest.raises(ValueError, match=r"holds 1 trainable tensor\(s\) that are not parameters of the module"):
        fit(strategy, module=module)
    assert strategy.accountant.steps == 0


def test_a_parameter_unfrozen_during_a_step_gets_no_raw_update():
    """Unfrozen inside ``training_step`` (after the step's check), a parameter's backward gave it a summed, unclipped
    ``.grad``; with ``optimizer_zero_grad`` overridden the optimizer applied it. It is dropped before the release,
    and the next step refuses the change."""

    class Unfreezes(type(make_module(small_config(n_layers=1)))):
        def training_step(self, batch, batch_idx):
            self.model.norm.weight.requires_grad_(True)
            return super().training_step(batch, batch_idx)

        def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
            pass

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Unfreezes(small_config(n_layers=1), optimizer="sgd", learning_rate=0.1)
    module.configure_model()
    module.model.norm.weight.requires_grad_(False)
    before = module.model.norm.weight.detach().clone()
    make_trainer(LongShieldStrategy(noise_multiplier=1.0), max_steps=1).fit(module, loader(RandomTokens(8, 8), 2))
    assert torch.equal(module.model.norm.weight.detach(), before)


def _plateau_module() -> CausalLMModule:
    class OnPlateau(CausalLMModule):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": scheduler, "monitor": "train_loss", "interval": "step"}}

    torch.manual_seed(0)
    module = OnPlateau(small_config(n_layers=1), log_train_loss=True)
    module.configure_model()
    return module


@pytest.mark.parametrize("consumer", ["ReduceLROnPlateau", "EarlyStopping", "ModelCheckpoint"])
def test_training_metrics_that_steer_training_are_refused(consumer, tmp_path):
    """A learning rate reduced on the training loss, a run stopped on it, or the checkpoint kept by it depend on the
    sampled records' un-noised losses: the parameters released are then outside the guarantee. Each was accepted
    with a warning that the logged values (only) are not covered."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    strategy = LongShieldStrategy(noise_multiplier=1.0, poisson_sampling=False)  # no empty batch: a step logs
    module = _plateau_module() if consumer == "ReduceLROnPlateau" else make_module(small_config(n_layers=1),
                                                                                   log_train_loss=True)
    callbacks = {"ReduceLROnPlateau": [], "EarlyStopping": [EarlyStopping(monitor="train_loss")],
                 "ModelCheckpoint": [ModelCheckpoint(dirpath=tmp_path, monitor="train_loss")]}[consumer]
    with pytest.raises(ValueError, match=rf"'train_loss'.*{consumer} monitors it.*held-out data"):
        fit(strategy, module=module, callbacks=callbacks, enable_checkpointing=consumer == "ModelCheckpoint")
    assert strategy.accountant.steps == 0  # refused at the first micro-batch's log, before its release


def test_an_epoch_mean_of_a_training_metric_weighs_each_micro_batch_by_its_samples():
    """Logged without batch_size in training_step, each micro-batch's value counted as the whole logical batch's
    samples in the epoch's mean: micro-batches of 2 and 1 sample logging 1 and -2 gave -0.5, not 0."""
    logged = {}

    class LogsItsSize(CausalLMModule):
        def training_step(self, batch, batch_idx):
            size = batch["input_ids"].shape[0]
            self.log("size_metric", float(3 * size - 5), on_step=False, on_epoch=True)  # 1 for 2 samples, -2 for 1
            return super().training_step(batch, batch_idx)

        def on_train_epoch_end(self):
            logged["mean"] = float(self.trainer.callback_metrics["size_metric"])

    torch.manual_seed(0)
    module = LogsItsSize(small_config(n_layers=1), optimizer="sgd", learning_rate=0.1)
    strategy = LongShieldStrategy(noise_multiplier=1.0, micro_batch_size=2, poisson_sampling=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(strategy, max_steps=1).fit(module, loader(RandomTokens(size=3, seq_len=8), 3))
    assert logged["mean"] == pytest.approx((2 * 1 + 1 * -2) / 3)


def test_a_training_step_dict_without_a_loss_is_refused_by_name():
    class NoLoss(CausalLMModule):
        def training_step(self, batch, batch_idx):
            return {"loss_value": super().training_step(batch, batch_idx)}

    torch.manual_seed(0)
    module = NoLoss(small_config(n_layers=1))
    module.configure_model()
    with pytest.raises(TypeError, match=r"dict without 'loss' \(keys \['loss_value'\]\)"):
        fit(LongShieldStrategy(noise_multiplier=1.0, poisson_sampling=False), module=module)


def test_overfit_batches_under_poisson_sampling_is_warned_about():
    with pytest.warns(UserWarning, match="overfit_batches is set, but every training batch is a fresh Poisson"):
        fit(LongShieldStrategy(noise_multiplier=1.0), overfit_batches=1)
