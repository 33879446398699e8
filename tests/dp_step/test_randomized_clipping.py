"""Randomized clipping in the strategy (``norms="hutchinson" / "hutchpp"``, or `ProjectedNorms`): with many
projections the update approaches the per-sample loop's exact-norm update and with few it does not; the run is
accounted and calibrated by the randomized-clipping accountant; the projections are fresh per micro-batch, secret
and never stored; combinations it does not cover are refused with the fix."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_longshield import LongShieldStrategy, ProjectedNorms, StrategyConfig
from lightning_longshield.privacy import DPSGDEngine, GaussianNoise, PrivacyAccountant
from lightning_longshield.privacy.epsilon import calibrate_noise_multiplier, epsilon
from lightning_longshield.privacy.randomized.accountant import RandomizedClippingAccountant
from lightning_longshield.privacy.randomness import SecretKey
from tests.support.helpers import (
    RandomTokens,
    full_state,
    loader,
    make_module,
    make_trainer,
    reference_dp_sgd,
    samples,
    small_config,
)

CLIP = 0.05
BATCH = 4
STEPS = 2


def fit(module, steps: int = STEPS, dataset_size: int = BATCH * STEPS, **kwargs) -> LongShieldStrategy:
    arguments = dict(noise_multiplier=0.0, max_grad_norm=CLIP, poisson_sampling=False, seed=0, noise_seed=5,
                     micro_batch_size=BATCH)
    strategy = LongShieldStrategy(**{**arguments, **kwargs})
    make_trainer(strategy, max_steps=steps).fit(module, loader(RandomTokens(size=dataset_size, seq_len=16), BATCH))
    return strategy


def relative_error(actual: torch.nn.Module, expected: torch.nn.Module, initial: torch.nn.Module) -> float:
    """``||update - expected update|| / ||expected update||`` over all parameters."""
    start, got, want = full_state(initial), full_state(actual), full_state(expected)
    difference = sum((got[n].double() - want[n].double()).square().sum() for n in start)
    size = sum((want[n].double() - start[n].double()).square().sum() for n in start)
    return float((difference / size).sqrt())


@pytest.mark.filterwarnings("ignore:noise_seed")
@pytest.mark.parametrize("estimator", ["hutchinson", "hutchpp"])
def test_many_projections_approach_the_exact_update_and_few_do_not(estimator):
    """Noise 0, clipping active (C = 0.05, every sample clipped): k = 1024 is within 2% of the exact-norm reference
    (theory: a norm off by sqrt(2 / k) ~ 4.4% at worst moves a clip factor by about half that), k = 4 is several
    times further off."""
    config = small_config(tie_embeddings=True)
    initial = make_module(config).model
    dataset = RandomTokens(size=BATCH * STEPS, seq_len=16)
    batches = [samples(dataset, range(k * BATCH, (k + 1) * BATCH)) for k in range(STEPS)]
    expected = reference_dp_sgd(initial, batches, CLIP, BATCH)
    errors = {}
    for k in (4, 1024):
        module = make_module(config)
        strategy = fit(module, norms=ProjectedNorms(estimator, projection_dim=k))
        errors[k] = relative_error(module.model, expected, initial)
        methods = strategy.dp_engine.per_sample_methods()
        assert methods["model.tok_embeddings.weight"] == "ghost" and methods["model.norm.weight"] == "materialize"
    assert errors[1024] < 0.02, errors
    assert errors[4] > 3 * errors[1024], errors


def clipped_sums_over(model: torch.nn.Module, inputs: torch.Tensor, micro_batch_size: int, estimator: str):
    """The engine's clipped sum of ``inputs`` (one logical batch, step 0) in micro-batches of ``micro_batch_size``,
    projections keyed by one fixed key; loss per sample: the sum of squared outputs."""
    model = copy.deepcopy(model)
    engine = DPSGDEngine(model, CLIP, GaussianNoise(torch.device("cpu")), PrivacyAccountant("rdp"),
                         config=StrategyConfig(norms=ProjectedNorms(estimator, projection_dim=3)),
                         projection_key=SecretKey(b"p" * 32))
    engine.begin_logical_batch()
    for start in range(0, inputs.shape[0], micro_batch_size):
        chunk = inputs[start:start + micro_batch_size]
        engine.prepare_microbatch(chunk.shape[0])
        model(chunk).square().sum().backward()
        engine.accumulate_microbatch(chunk.shape[0])
    return {name: total.double() for name, total in engine.accumulator.sums.items()}


@pytest.mark.parametrize("estimator", ["hutchinson", "hutchpp"])
def test_a_sample_is_clipped_alike_whoever_else_was_drawn(estimator):
    """Adding a zero-gradient neighbour regroups the other samples into micro-batches (one of them alone): their
    clipped sum must not change, so neither may any of their clip factors. Projections are keyed by (step,
    parameter), shared by every micro-batch, and a one-sample micro-batch is estimated like the others. (Before,
    projections were keyed by the micro-batch index and a lone sample got its exact norm: with k = 2 the sums
    differed by 1-13%.) Equality is exact up to summation order, which implies equality in distribution
    over the projections: a statistical test could only be weaker."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4, bias=False))
    others = torch.randn(5, 6, 8)
    with_neighbour = torch.cat([torch.zeros(1, 6, 8), others])
    without = clipped_sums_over(model, others, 2, estimator)  # micro-batches {1,2} {3,4} {5}
    regrouped = clipped_sums_over(model, with_neighbour, 2, estimator)  # {0,1} {2,3} {4,5}
    alone = clipped_sums_over(model, others, 1, estimator)  # five one-sample micro-batches
    assert set(without) == set(regrouped) == set(alone) == {"0.weight", "2.weight"}
    for name, total in without.items():
        assert total.norm() > 0
        torch.testing.assert_close(regrouped[name], total, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(alone[name], total, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("estimator", ["hutchinson", "hutchpp"])
def test_a_non_finite_sample_adds_zero_and_leaves_the_others_alone(estimator):
    """A sample whose gradient is inf / NaN gets factor 0; the other samples of its micro-batch are clipped as if it
    were a zero-gradient sample. (Before, Hutch++ bounded every sample's sketch rounding by the largest basis of the
    micro-batch: one NaN basis made every sample's factor 0, removing up to (B - 1) C from the sum.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4, bias=False))
    others = torch.randn(5, 6, 8)
    poisoned = torch.full((1, 6, 8), float("inf"))
    with_poison = clipped_sums_over(model, torch.cat([poisoned, others]), 3, estimator)  # {p,1,2} {3,4,5}
    with_zero = clipped_sums_over(model, torch.cat([torch.zeros(1, 6, 8), others]), 3, estimator)
    for name, total in with_zero.items():
        assert total.norm() > 0 and torch.isfinite(with_poison[name]).all()
        torch.testing.assert_close(with_poison[name], total, rtol=1e-5, atol=1e-9)


@pytest.mark.slow
def test_accounted_and_calibrated_by_the_randomized_accountant():
    """target_epsilon calibrates sigma with the randomized accountant: above the exact-clipping sigma and within
    the target; epsilon comes from it; Hutch++ accounts its k - k // 3 residual projections."""
    module = make_module(small_config(n_layers=1))
    strategy = fit(module, steps=4, dataset_size=40, noise_multiplier=None, target_epsilon=4.0, target_delta=1e-3,
                   noise_seed=None, norms=ProjectedNorms("hutchinson", projection_dim=8))
    accountant = strategy.accountant
    assert isinstance(accountant, RandomizedClippingAccountant)
    assert (accountant.envelope.estimator, accountant.envelope.projections) == ("hutchinson", 8)
    plan = strategy.privacy.plan
    exact = calibrate_noise_multiplier(4.0, 1e-3, plan.sample_rate, 4, "prv")
    assert plan.noise_multiplier > exact * 1.01
    assert 4.0 * 0.95 <= strategy.get_epsilon() <= 4.0
    assert strategy.get_epsilon() > epsilon([(plan.noise_multiplier, plan.sample_rate, 4)], 1e-3, "prv")
    hutchpp = LongShieldStrategy(noise_multiplier=1.0, norms="hutchpp")
    assert hutchpp.accountant.envelope.projections == 32 - 32 // 3


def test_projections_are_fresh_secret_and_never_stored():
    """Every (step, parameter) has its own projections; without noise_seed two fits draw unrelated keys; a
    checkpoint's privacy state holds no key; with noise_seed the projections are reproducible."""
    key = SecretKey(b"k" * 32)
    drawn = {torch.randn(4, generator=key.generators("cpu", "projection", step, name)[0]).sum().item()
             for step in range(3) for name in ("a.weight", "b.weight", "c.weight")}
    assert len(drawn) == 9
    keys = []
    for _ in range(2):
        strategy = LongShieldStrategy(noise_multiplier=1.0, norms="hutchinson")
        strategy.privacy.open_fit(torch.device("cpu"), (0, 0), lambda value: value)
        keys.append(strategy.privacy.projection_key._key)
    assert keys[0] != keys[1]
    module = make_module(small_config(n_layers=1))
    with pytest.warns(UserWarning, match="noise_seed"):
        strategy = fit(module, steps=1, noise_multiplier=1.0, norms=ProjectedNorms("hutchinson", projection_dim=4))
    state = strategy.privacy.state_dict()
    assert "key" not in repr(state) and set(state) == {"plan", "accountant", "run_id", "ledger", "ledger_since",
                                                    "ledger_marked", "without_lines", "damaged_counted",
                                                    "beside_counted", "rolled_back_steps", "accounting_incomplete",
                                                    "ran_without_poisson", "ran_reproducibly", "noise_tails"}
    assert state["accountant"]["estimator"] == "hutchinson"
    described = strategy.privacy.describe_randomness()
    assert "norm projections: MT19937 generators (all 624 state words keyed by noise_seed" in described
    again = copy.deepcopy(make_module(small_config(n_layers=1)))
    with pytest.warns(UserWarning, match="noise_seed"):
        fit(again, steps=1, noise_multiplier=1.0, norms=ProjectedNorms("hutchinson", projection_dim=4))
    assert all(torch.equal(a, b) for a, b in zip(full_state(module.model).values(), full_state(again.model).values()))


@pytest.mark.parametrize("make, message", [
    (lambda: LongShieldStrategy(noise_multiplier=1.0, norms="jl"), "choose one of"),
    (lambda: ProjectedNorms("hutchinson", projection_dim=0), "positive integer"),
    (lambda: ProjectedNorms("hutchpp", projection_dim=2), "k >= 3"),
    (lambda: LongShieldStrategy(noise_multiplier=1.0, norms="hutchinson", clipping="per_layer"), "or clipping='flat'"),
    (lambda: LongShieldStrategy(noise_multiplier=1.0, norms="hutchinson", accountant="rdp"), "Use accountant='prv'"),
], ids=["unknown", "no-projections", "hutchpp-too-few", "per-layer", "rdp"])
def test_uncovered_combinations_name_the_fix(make, message):
    with pytest.raises(ValueError, match=message):
        make()
