"""What a user's LightningModule must give the DP step, and what is refused: the loss as each sample's loss or their
mean (a token mean over the micro-batch is warned about), batch-first layers called with their input, the
trainable parameters fixed for the whole fit, and no trainable sparse embedding."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, default_collate

from lightning_longshield import CausalLMModule, LongShieldStrategy, StrategyConfig
from lightning_longshield.loss import loss_divisors
from lightning_longshield.module import unpack_batch
from lightning_longshield.privacy import DPSGDEngine, GaussianNoise, PerSampleGradCapture, PrivacyAccountant
from lightning_longshield.privacy.metric_guard import SampledBatchMetricGuard, guard_logging, unguard_logging
from lightning_longshield.privacy.randomness import SecretKey
from tests.support.helpers import RandomTokens, loader, make_module, make_trainer, small_config

DATA = RandomTokens(size=8, seq_len=8)


def _strategy() -> LongShieldStrategy:
    return LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=0.05, micro_batch_size=4, poisson_sampling=False)


class PerSampleLosses(CausalLMModule):
    """Returns each sample's loss, a vector, instead of their mean."""

    per_sample_mean_loss = False

    def training_step(self, batch, batch_idx):
        input_ids, labels, position_ids, token_counts = unpack_batch(batch)
        return self._token_loss_sums(input_ids, labels, position_ids) / loss_divisors(labels, token_counts)


class TokenMean(CausalLMModule):
    """A scalar loss the module does not declare a mean over samples (here it is one, only undeclared)."""

    per_sample_mean_loss = False


def _trained(module: CausalLMModule) -> dict[str, torch.Tensor]:
    make_trainer(_strategy(), max_steps=1).fit(module, loader(DATA, 8))
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def test_a_vector_of_per_sample_losses_trains_as_their_mean():
    kwargs = dict(optimizer="sgd", learning_rate=1.0)
    reference = _trained(make_module(small_config(n_layers=1), **kwargs))
    torch.manual_seed(0)
    vector = PerSampleLosses(small_config(n_layers=1), **kwargs)
    vector.configure_model()
    for name, value in _trained(vector).items():
        torch.testing.assert_close(value, reference[name], rtol=1e-6, atol=1e-7)


@pytest.mark.filterwarnings("ignore:noise_seed")
@pytest.mark.parametrize("poisson", [False, True], ids=["batches", "poisson"])
@pytest.mark.parametrize("shape", [(-1,), (1, -1)], ids=["T", "1xT"])
def test_positions_shared_by_the_samples_train_as_expanded_ones(poisson: bool, shape: tuple[int, ...]):
    """``position_ids`` (T,) or (1, T) from the collate_fn train as the same positions expanded to (B, T), over
    micro-batches of 4 (without Poisson sampling B = T = 8: a (T,) one is not split as if it were samples)."""
    positions = torch.arange(8) * 3 + 1

    def trained(shared: Optional[tuple[int, ...]]) -> dict[str, torch.Tensor]:
        def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
            batch = default_collate(samples)
            form = positions.reshape(shared) if shared else positions.expand(len(samples), -1)
            return {**batch, "position_ids": form}

        module = make_module(small_config(n_layers=1))
        strategy = LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=0.05, micro_batch_size=4,
                                      poisson_sampling=poisson, noise_seed=0 if poisson else None)
        data = DataLoader(DATA, batch_size=4 if poisson else 8, collate_fn=collate)
        make_trainer(strategy, max_steps=2).fit(module, data)
        return {name: p.detach().clone() for name, p in module.named_parameters()}

    reference = trained(None)
    for name, value in trained(shape).items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0)


def test_a_one_element_loss_is_a_scalar_and_other_shapes_are_refused():
    from lightning_longshield.dp_step_loop import checked_loss_shape

    assert checked_loss_shape(torch.ones(1), 4).shape == () and checked_loss_shape(torch.ones(()), 4).shape == ()
    assert checked_loss_shape(torch.ones(4), 4).shape == (4,)
    for wrong in (torch.ones(3), torch.ones(2, 2)):
        with pytest.raises(ValueError, match="return each sample's loss"):
            checked_loss_shape(wrong, 4)


def test_an_undeclared_scalar_loss_of_several_samples_is_warned_about_once():
    torch.manual_seed(0)
    module = TokenMean(small_config(n_layers=1), optimizer="sgd")
    module.configure_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(_strategy(), max_steps=2).fit(module, loader(DATA, 8))
    flagged = [w for w in caught if "scalar loss for a micro-batch of several samples" in str(w.message)]
    assert len(flagged) == 1 and "per_sample_mean_loss = True" in str(flagged[0].message)


def test_a_subclass_that_overrides_training_step_states_its_loss_anew():
    """``per_sample_mean_loss`` of `CausalLMModule` speaks for its own ``training_step``, not an override's."""
    from lightning_longshield.dp_step_loop import declares_per_sample_mean_loss

    class Override(CausalLMModule):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx)

    class Restated(Override):
        per_sample_mean_loss = True

    class Inherits(CausalLMModule):
        pass

    config = small_config(n_layers=1)
    assert declares_per_sample_mean_loss(CausalLMModule(config)) and declares_per_sample_mean_loss(Inherits(config))
    assert not declares_per_sample_mean_loss(Override(config)) and declares_per_sample_mean_loss(Restated(config))
    stated = Override(config)
    stated.per_sample_mean_loss = True
    assert declares_per_sample_mean_loss(stated)


def test_parameters_frozen_or_unfrozen_during_fit_are_refused():
    """An unfrozen parameter would get an unclipped summed gradient; a frozen one would still be noised."""
    class Unfreeze(Callback):
        def on_train_batch_start(self, trainer, module, *_):
            if trainer.global_step == 1:
                module.model.norm.weight.requires_grad_(True)

    module = make_module(small_config(n_layers=1), optimizer="sgd")
    module.model.norm.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"frozen or unfrozen after fit began: \['model.norm.weight'\]"):
        make_trainer(_strategy(), max_steps=3, callbacks=[Unfreeze()]).fit(module, loader(DATA, 8))


class KeywordCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(input=self.lin(input=x))


def test_a_layer_called_with_its_input_by_keyword_is_captured():
    torch.manual_seed(0)
    model, x = KeywordCalls().double(), torch.randn(3, 5, 4, dtype=torch.float64)
    capture = PerSampleGradCapture(model)
    capture.start_microbatch(3)
    model(x).square().sum().backward()
    got = capture.collect()
    for i in range(3):
        expected = torch.autograd.grad(model(x[i : i + 1]).square().sum(), list(model.parameters()))
        for (name, _), value in zip(model.named_parameters(), expected):
            torch.testing.assert_close(got[name][i], value)


def test_a_layer_that_takes_the_samples_second_is_refused_with_the_fix():
    class SequenceFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x.transpose(0, 1)).transpose(0, 1)  # (B, T, d) -> (T, B, d) through the layer

    model = SequenceFirst()
    capture = PerSampleGradCapture(model)
    capture.start_microbatch(2)
    loss = model(torch.randn(2, 5, 4)).sum()
    with pytest.raises(RuntimeError, match="batch-first, the samples along dimension 0") as error:
        loss.backward()  # refused as the layer's gradient arrives, on every path (materialised, book-kept, fused)
    assert not any(digit in str(error.value) for digit in "0123456789".replace("0", ""))


@pytest.mark.parametrize("norms", ["materialize", "ghost", "mixed"])
def test_a_table_looked_up_with_ids_shared_by_the_batch_is_refused(norms):
    """A GPT-2 style positional table looked up with ``arange(T)[None]``, broadcast over the batch: its gradient is the
    whole batch's, so one sample would move every sample's norm (book-kept norms broadcast it to every sample: 5.1 C
    between neighbouring batches at C, against DP-SGD's 2 C). Refused on every path, even with nothing else
    materialised."""
    from lightning_longshield.privacy import DPSGDEngine, GaussianNoise, PrivacyAccountant
    from simulate.strategy_config import StrategyConfig

    class SharedPositions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(16, 8), nn.Embedding(6, 8)
            self.tok.weight.requires_grad_(False)  # only the table (and the norm) train
            self.norm = nn.LayerNorm(8)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.norm(self.tok(ids) + self.pos(torch.arange(ids.shape[1])[None]))

    model = SharedPositions()
    engine = DPSGDEngine(model, 1.0, GaussianNoise(torch.device("cpu")), PrivacyAccountant("rdp"),
                         config=StrategyConfig(norms=norms))
    engine.begin_logical_batch()
    engine.prepare_microbatch(4)
    loss = model(torch.randint(0, 16, (4, 6))).square().sum()
    with pytest.raises(RuntimeError, match="an input shared by the batch"):
        loss.backward()


@pytest.mark.parametrize("register", ["register_hook", "register_post_accumulate_grad_hook"])
def test_gradient_hooks_on_trainable_parameters_are_refused(register):
    """Per-sample gradients never pass through a parameter's gradient hooks (a one-sample micro-batch's ``.grad``
    would): a hook masking rows zeroed them at micro-batch 1 and not at 2 or 4. Refused at the start and, for a hook
    added during a fit, at the next step."""
    model = nn.Sequential(nn.Embedding(16, 4), nn.Linear(4, 16))
    getattr(model[0].weight, register)(lambda grad: None)
    with pytest.raises(RuntimeError, match=r"gradient hooks .*\['0.weight'\].*on_before_optimizer_step"):
        PerSampleGradCapture(model)
    model = nn.Sequential(nn.Embedding(16, 4), nn.Linear(4, 16))
    capture = PerSampleGradCapture(model)
    capture.check_trainable_unchanged()
    getattr(model[1].weight, register)(lambda grad: None)
    with pytest.raises(RuntimeError, match=r"\['1.weight'\]"):
        capture.check_trainable_unchanged()


@pytest.mark.parametrize("form", ["tensor", "dict", "array", "metric"])
def test_logging_a_per_sample_vector_is_refused_without_its_values(form):
    """Lightning's own error for a non-scalar ``self.log`` prints the value: in ``training_step`` the sampled
    records' losses (as a tensor, a dict of them or a NumPy array), or a torchmetrics metric's per-element result
    (here a metric of each sample's loss; a per-class accuracy alike). The strategy's refusal quotes none of them."""
    from torchmetrics import CatMetric

    class LogsVector(PerSampleLosses):
        def training_step(self, batch, batch_idx):
            losses = super().training_step(batch, batch_idx)
            vector = losses.detach()
            if form == "metric":
                self.losses = getattr(self, "losses", None) or CatMetric()
                self.losses(vector)  # forward: its result is the sampled records' losses
                self.log("per_sample", self.losses)
                return losses
            self.log("per_sample", {"tensor": vector, "dict": {"losses": vector}, "array": vector.numpy()}[form])
            return losses

    refused = LogsVector(small_config(n_layers=1))
    with pytest.raises(ValueError, match=r"in training_step got \w+ of more than one value") as error:
        make_trainer(_strategy(), max_steps=1).fit(refused, loader(DATA, 4))
    assert not any(character.isdigit() for character in str(error.value))
    module = make_module(small_config(n_layers=1))
    make_trainer(_strategy(), max_steps=1).fit(module, loader(DATA, 4))
    assert "log" not in module.__dict__ and "log" not in refused.__dict__  # the method is the class's again


class TokenCounts(Callback):
    """Logs the sampled records' labelled-token counts from the batch at the end of its step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.log("tokens_per_sample", (batch["labels"] != -100).sum(dim=1).float())


class TokenCountsAtStart(CausalLMModule):
    """Logs the sampled records' labelled-token counts before the step runs."""

    def on_train_batch_start(self, batch, batch_idx):
        self.log("tokens_per_sample", (batch["labels"] != -100).sum(dim=1).float())


@pytest.mark.parametrize("hook", ["on_train_batch_start", "on_train_batch_end"])
def test_logging_a_per_sample_vector_in_a_batch_hook_is_refused_without_its_values(hook: str):
    """Lightning's own error quoted the vector (``self.log(tokens_per_sample, tensor([6., 8.]))``) logged in any
    training hook but ``training_step``: the batch's hooks (a module's or a callback's) are refused alike."""
    if hook == "on_train_batch_start":
        module, callbacks = TokenCountsAtStart(small_config(n_layers=1)), []
    else:
        module, callbacks = CausalLMModule(small_config(n_layers=1)), [TokenCounts()]
    with pytest.raises(ValueError, match=rf"'tokens_per_sample', ...\) in {hook} got Tensor of more than one") as error:
        make_trainer(_strategy(), max_steps=1, callbacks=callbacks).fit(module, loader(DATA, 4))
    assert not any(character.isdigit() for character in str(error.value))


@pytest.mark.parametrize("config", [
    StrategyConfig(), StrategyConfig(clipping="per_layer"), StrategyConfig(norms="ghost"),
    StrategyConfig(norms="mixed"), StrategyConfig(norms="hutchinson"),
], ids=["flat", "per-layer", "ghost", "mixed", "hutchinson"])
def test_a_trainable_sparse_embedding_is_refused_on_every_path_with_the_fix(config: StrategyConfig):
    """``nn.Embedding(sparse=True)`` gives a sparse ``.grad``: a one-sample micro-batch's (a random event under
    Poisson sampling) failed to reshape, and ghost norms failed in the first backward. Refused when the engine is
    built; a frozen one has no gradient and is kept."""
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 3))

    def engine() -> DPSGDEngine:
        return DPSGDEngine(model, 1.0, GaussianNoise(torch.device("cpu")), PrivacyAccountant("rdp"), config=config,
                           projection_key=SecretKey(b"p" * 32))

    with pytest.raises(ValueError, match=r"0 \(sparse=True\).*sparse=False"):
        engine()
    model[0].weight.requires_grad_(False)
    engine()


@pytest.mark.parametrize("hook", ["training_step", "on_before_backward", "on_after_backward"])
def test_a_sync_at_every_call_in_a_per_microbatch_hook_is_refused_with_several_data_parallel_groups(hook: str):
    """Each group runs these hooks once per micro-batch of its Poisson draw: a per-call sync across processes
    (sync_dist=True, on_step) would meet another step's sync, or the noisy gradient's all-reduce. One group, one sync
    at the epoch's end, or a hook run once per logical batch on every group is left alone."""
    logged = []

    class Logging(nn.Module):
        _trainer = SimpleNamespace(training=True)

        def log(self, name, value, prog_bar=False, logger=None, on_step=None, on_epoch=None, reduce_fx="mean",
                enable_graph=False, sync_dist=False, sync_dist_group=None):
            logged.append((name, sync_dist, on_step))

    module, groups = Logging(), [2]
    guard_logging(module, lambda: groups[0], SampledBatchMetricGuard())
    module._current_fx_name = hook
    with pytest.raises(ValueError, match=rf"self.log\('loss', ..., sync_dist=True\) in {hook} .* 2 data-parallel"):
        module.log("loss", 1.0, sync_dist=True)
    with pytest.raises(ValueError, match="would hang"):
        module.log("loss", 1.0, False, None, None, None, "mean", False, True)  # sync_dist given positionally
    module.log("epoch_loss", 1.0, on_step=False, on_epoch=True, sync_dist=True)
    module.log("own_loss", 1.0)
    module._current_fx_name = "on_train_batch_end"
    module.log("batch_loss", 1.0, sync_dist=True)
    module._current_fx_name, groups[0] = hook, 1
    module.log("loss", 1.0, sync_dist=True)
    unguard_logging(module)
    assert "log" not in module.__dict__
    assert logged == [("epoch_loss", True, False), ("own_loss", False, None), ("batch_loss", True, None),
                      ("loss", True, None)]


@pytest.mark.parametrize("hook", ["on_before_backward", "on_after_backward"])
def test_a_sync_at_every_backward_hook_call_is_refused_in_a_fit_with_several_data_parallel_groups(hook: str,
                                                                                                 monkeypatch):
    """The backward hooks run per micro-batch from the DP step, outside ``training_step``: in a 2-process run a
    sync there met the other rank's all-reduce of the noisy gradient, and both died. The group count is made 2 once
    training runs (one process holds one group; the check asks the strategy at each logged sync)."""

    class SyncsInBackwardHook(CausalLMModule):
        def on_before_backward(self, loss):
            if hook == "on_before_backward":
                self.log("loss_seen", loss.detach(), sync_dist=True, batch_size=1)

        def on_after_backward(self):
            if hook == "on_after_backward":
                self.log("backward_calls", 1.0, sync_dist=True, batch_size=1)

    class TwoGroups(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            monkeypatch.setattr(LongShieldStrategy, "data_parallel_size", property(lambda self: 2))

    module = SyncsInBackwardHook(small_config(n_layers=1))
    with pytest.raises(ValueError, match=rf"sync_dist=True\) in {hook} .* 2 data-parallel groups"):
        make_trainer(_strategy(), max_steps=1, callbacks=[TwoGroups()]).fit(module, loader(DATA, 4))
    assert "log" not in module.__dict__  # given back after the error too


def test_a_module_saved_whole_mid_run_pickles_with_its_logging_guard():
    """A callback that saves the whole module during a fit (``torch.save(module)``, a logger's model upload): the
    guard goes along without the strategy's closure, and the copy logs as a plain module outside the run."""
    import io
    import pickle

    from lightning_longshield.privacy.metric_guard import GuardedLog

    saved = {}

    class SaveWhole(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            saved["bytes"] = pickle.dumps(pl_module)
            torch.save(pl_module, io.BytesIO())

    module = make_module(small_config(n_layers=1))
    make_trainer(_strategy(), max_steps=1, callbacks=[SaveWhole()]).fit(module, loader(DATA, 4))
    copy = pickle.loads(saved["bytes"])
    assert isinstance(copy.__dict__["log"], GuardedLog) and copy.__dict__["log"].data_parallel_groups() == 1
