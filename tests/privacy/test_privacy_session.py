"""`PrivacySession` on its own: secret randomness per fit, plan and budget, release guard, checkpoint state."""

from __future__ import annotations

import pytest
import torch
from opacus.accountants import create_accountant

from lightning_longshield.privacy.plan import PrivacyArguments
from lightning_longshield.privacy.randomness import SecretKey
from lightning_longshield.privacy.session import PrivacySession

CPU = torch.device("cpu")


def session(noise_multiplier=None, target_epsilon=None, target_delta=1e-3, **kwargs) -> PrivacySession:
    arguments = PrivacyArguments(noise_multiplier, target_epsilon, target_delta, max_grad_norm=1.0, accountant="rdp")
    return PrivacySession(arguments, **kwargs)


def started(privacy: PrivacySession, planned_steps: int = 10, dataset_size: int = 100, batch_size: int = 5) -> bool:
    privacy.open_fit(CPU, (0, 0), broadcast=lambda value: value)
    privacy.record_training_data(dataset_size, batch_size)
    return privacy.start_training(global_step=0, planned_steps=planned_steps, data_parallel_size=2)


def test_every_fit_draws_fresh_secret_randomness_unless_a_noise_seed_is_given():
    privacy = session(noise_multiplier=1.0)
    privacy.open_fit(CPU, (0, 0), broadcast=lambda value: value)
    first_noise, first_sampling = privacy.noise, privacy.sampling
    privacy.open_fit(CPU, (0, 0), broadcast=lambda value: value)
    for noise in (first_noise, privacy.noise):
        noise.start_step(0)  # a noise takes its key at its first step
    assert privacy.noise._key._key != first_noise._key._key
    assert privacy.sampling.uniforms(8, "poisson", 0).tolist() != first_sampling.uniforms(8, "poisson", 0).tolist()

    # The seed itself is not echoed: it is as secret as the noise it gives.
    with pytest.warns(UserWarning, match="noise_seed is set: the noise, the Poisson sampling and the DP steps' drop"):
        seeded = [session(noise_multiplier=1.0, noise_seed=5) for _ in range(2)]
    for privacy in seeded:
        privacy.open_fit(CPU, (0, 0), broadcast=lambda value: value)
    assert seeded[0].noise._key._key == seeded[1].noise._key._key
    assert torch.equal(seeded[0].sampling.uniforms(8, 3), seeded[1].sampling.uniforms(8, 3))


def test_the_sampling_key_and_the_run_id_are_broadcast_and_secure_mode_keeps_them(tmp_path):
    """Every rank takes rank 0's key and run id: drawn apart, a rank's run id differed from the one rank 0's
    checkpoints and ledger name, and ranks disagreed whether a module's weights were accounted."""
    broadcast = []

    def from_rank_zero(value):
        broadcast.append(value)
        return {bytes: bytes(range(32)), str: "rank-zero-run"}[type(value)]

    privacy = session(noise_multiplier=1.0)
    privacy.open_fit(CPU, (1, 0), broadcast=from_rank_zero)
    assert [type(value) for value in broadcast] == [bytes, str] and len(broadcast[0]) == 32
    assert privacy.sampling._key == SecretKey(bytes(range(32))).derive("sampling")._key
    assert privacy.run_id is None  # a run id marks a run that keeps a ledger (or resumed)
    privacy.open_ledger(tmp_path / "ledger.jsonl", writer=False)
    assert privacy.run_id == "rank-zero-run"
    secure = session(noise_multiplier=1.0, secure_mode=True)
    secure.open_fit(CPU, (1, 0), broadcast=from_rank_zero)
    assert secure.sampling._key == SecretKey(bytes(range(32))).derive("sampling")._key
    assert secure.noise.secure_mode
    with pytest.raises(ValueError, match="remove noise_seed"):
        session(noise_multiplier=1.0, secure_mode=True, noise_seed=1)


def test_the_printed_randomness_names_the_noise_source():
    privacy = session(noise_multiplier=1.0)
    privacy.open_fit(CPU, (0, 0), broadcast=lambda value: value)
    assert privacy.noise.keystream and "noise: AES-256-CTR keystreams" in privacy.describe_randomness()
    secure = session(noise_multiplier=1.0, secure_mode=True)
    secure.open_fit(CPU, (0, 0), broadcast=lambda value: value)
    assert not secure.noise.keystream and "four-draw hardened" in secure.describe_randomness()


def test_training_data_is_checked_and_needed_before_the_plan():
    privacy = session(noise_multiplier=1.0)
    with pytest.raises(ValueError, match="dataset is empty"):
        privacy.record_training_data(0, 4)
    with pytest.raises(ValueError, match="must set batch_size"):
        privacy.record_training_data(10, None)
    with pytest.raises(ValueError, match="sized dataset"):
        privacy.start_training(global_step=0, planned_steps=3, data_parallel_size=1)


def test_the_plan_calibrates_to_the_target_over_all_data_parallel_groups():
    privacy = session(target_epsilon=3.0)
    assert started(privacy, planned_steps=20) is False
    plan = privacy.plan
    assert plan.expected_batch_size == 10 and plan.sample_rate == pytest.approx(0.1)
    reference = create_accountant("rdp")
    for _ in range(20):
        reference.step(noise_multiplier=plan.noise_multiplier, sample_rate=0.1)
    assert 2.9 <= reference.get_epsilon(delta=1e-3) <= 3.0
    assert privacy.steps_left_in_budget == 20


def test_a_budget_counts_releases_down_refuses_the_next_and_warns_only_when_it_cuts_the_plan():
    privacy = session(noise_multiplier=0.8, target_epsilon=2.0)
    with pytest.warns(UserWarning, match="budget allows"):
        assert started(privacy, planned_steps=1000) is False
    budget = privacy.accountant.steps_within_budget(2.0, 0.8, 0.1, 1e-3, limit=1000)
    assert privacy.steps_left_in_budget == budget < 1000
    for step in range(budget - 1):
        privacy.check_release_allowed()
        privacy.accountant.step(0.8, 0.1)
        assert privacy.released(step) is False
    privacy.accountant.step(0.8, 0.1)
    with pytest.warns(UserWarning, match="one more step would exceed the privacy budget"):
        assert privacy.released(budget - 1) is True
    with pytest.raises(RuntimeError, match="budget is spent"):
        privacy.check_release_allowed()
    assert privacy.get_epsilon() <= 2.0 < privacy.accountant.epsilon_after(1, 0.8, 0.1, 1e-3)


def test_checkpoint_state_holds_plan_and_history_but_no_secret_and_fixes_the_resumed_mechanism():
    privacy = session(target_epsilon=4.0)
    assert privacy.state_dict() is None
    started(privacy, planned_steps=5)
    for _ in range(5):
        privacy.accountant.step(privacy.plan.noise_multiplier, privacy.plan.sample_rate)
    state = privacy.state_dict()
    # The ledger's run id, path and first step, the steps a resume rolled back, whether some steps may be uncounted,
    # ran with fixed batches or reproducibly (flags, not the seed), the noise sources' cut-offs: nothing secret either.
    assert set(state) == {"plan", "accountant", "run_id", "ledger", "ledger_since", "ledger_marked",
                          "without_lines", "damaged_counted", "beside_counted", "rolled_back_steps",
                          "accounting_incomplete", "ran_without_poisson", "ran_reproducibly", "noise_tails"}
    assert (state["ran_without_poisson"], state["ran_reproducibly"]) == (False, False)
    privacy.noise.start_step(0)  # its key, taken at its first step
    keys = [privacy.noise._key._key, privacy.sampling._key]
    assert not any(repr(key) in repr(state) or key.hex() in repr(state) for key in keys)

    resumed = session(target_epsilon=4.0)
    resumed.open_fit(CPU, (0, 0), broadcast=lambda value: value)
    resumed.load_state_dict(state)
    resumed.record_training_data(100, 5)
    resumed.start_training(global_step=5, planned_steps=5, data_parallel_size=2)
    assert resumed.plan.noise_multiplier == privacy.plan.noise_multiplier  # kept, not recalibrated
    assert resumed.accountant.history == privacy.accountant.history
    assert resumed.get_epsilon() == privacy.get_epsilon()


def test_a_budget_that_no_step_fits_stops_at_the_start():
    privacy = session(noise_multiplier=0.5, target_epsilon=0.01)
    with pytest.warns(UserWarning, match="first step alone would spend"):
        assert started(privacy) is True
    assert privacy.steps_left_in_budget == 0
