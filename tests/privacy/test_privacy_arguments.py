"""What the privacy session refuses, warns and logs: impossible budgets, an over-budget first step, resumed runs,
and information as plain log lines (rank zero only) rather than warnings."""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch

from lightning_longshield import LongShieldStrategy
from lightning_longshield.privacy.epsilon import calibrate_noise_multiplier
from lightning_longshield.privacy.plan import PrivacyArguments
from lightning_longshield.privacy.rank_zero import LOGGER_NAME, global_rank
from lightning_longshield.privacy.session import PrivacySession

CPU = torch.device("cpu")


def session(noise_multiplier=None, target_epsilon=None, target_delta=1e-3) -> PrivacySession:
    arguments = PrivacyArguments(noise_multiplier, target_epsilon, target_delta, max_grad_norm=1.0, accountant="rdp")
    return PrivacySession(arguments)


def start(privacy: PrivacySession, planned_steps: int = 10, global_step: int = 0) -> bool:
    privacy.open_fit(CPU, (0, 0), broadcast=lambda value: value)
    privacy.record_training_data(100, 5)
    return privacy.start_training(global_step=global_step, planned_steps=planned_steps, data_parallel_size=2)


def test_an_infinite_target_epsilon_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"use noise_multiplier=0\.0 for a non-private run, or a finite target_eps"):
        LongShieldStrategy(target_epsilon=math.inf)
    with pytest.raises(ValueError, match="> 0 and finite"):
        calibrate_noise_multiplier(math.inf, 1e-5, 0.01, 100, "prv")


@pytest.mark.parametrize("value", [math.nan, -1.0, 0.0, -math.inf])
def test_a_target_epsilon_that_is_not_a_positive_number_is_refused(value):
    with pytest.raises(ValueError, match=r"target_epsilon must be > 0 and finite.*noise_multiplier=0\.0"):
        LongShieldStrategy(target_epsilon=value)


@pytest.mark.parametrize(("argument", "value"), [("noise_multiplier", math.inf), ("noise_multiplier", math.nan),
                                                 ("max_grad_norm", math.inf), ("max_grad_norm", math.nan)])
def test_noise_and_clipping_bounds_must_be_finite(argument, value):
    with pytest.raises(ValueError, match=f"{argument} must be >=? 0 and finite"):
        LongShieldStrategy(**{argument: value})


def test_information_is_logged_and_only_what_to_change_is_warned(caplog):
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        warnings.simplefilter("always")
        start(session(noise_multiplier=1.0, target_epsilon=20.0, target_delta=None))
    assert not caught, [str(w.message) for w in caught]
    logged = " ".join(caplog.messages)
    for information in ("target_delta not set", "both set", "LongShield DP-SGD: noise_multiplier=1.0000",
                        "covers all 10 planned steps"):
        assert information in logged
    assert {record.name for record in caplog.records} == {LOGGER_NAME}

    with pytest.warns(UserWarning, match="NOT differentially private"):
        start(session(noise_multiplier=0.0))


def test_messages_come_from_rank_zero_only(caplog, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert global_rank() == 1
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        warnings.simplefilter("always")
        start(session(noise_multiplier=0.0, target_delta=None))
    assert not caught and not caplog.records


def _checkpointed(**arguments) -> dict:
    privacy = session(**arguments)
    start(privacy, planned_steps=5)
    for _ in range(3):
        privacy.accountant.step(privacy.plan.noise_multiplier, privacy.plan.sample_rate)
    return privacy.state_dict()


def _resume(state: dict, **arguments) -> PrivacySession:
    resumed = session(**arguments)
    resumed.open_fit(CPU, (0, 0), broadcast=lambda value: value)
    resumed.load_state_dict(state)
    resumed.record_training_data(100, 5)
    resumed.start_training(global_step=3, planned_steps=2, data_parallel_size=2)
    return resumed


def test_a_resumed_run_speaks_only_of_what_the_user_set(caplog, recwarn):
    state = _checkpointed(target_epsilon=4.0)
    recwarn.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        resumed = _resume(state, target_epsilon=4.0)
    assert resumed.plan.noise_multiplier == state["plan"]["noise_multiplier"]  # the calibrated sigma is kept
    said = [str(w.message) for w in recwarn] + caplog.messages
    assert not any("both set" in text for text in said)
    assert any("Resuming a checkpoint" in text for text in caplog.messages)


def test_a_resumed_run_warns_about_a_value_the_user_set_differently():
    state = _checkpointed(noise_multiplier=1.0, target_epsilon=6.0)
    with pytest.warns(UserWarning, match=r"noise_multiplier=0.5 \(the checkpoint's run: 1\)") as caught:
        resumed = _resume(state, noise_multiplier=0.5, target_epsilon=6.0)
    assert resumed.plan.noise_multiplier == 1.0  # never less noise than the checkpoint's run planned
    assert not any("target_epsilon=6 (" in str(w.message) for w in caught)  # the same value: not mentioned


def test_a_resumed_run_never_adds_less_noise_than_asked_for(caplog):
    """A larger noise_multiplier given at resume applies (the accountant composes steps of either). Before, the
    checkpoint's was kept: a run warmed up without noise went on training without noise after a resume with
    noise_multiplier=1."""
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        resumed = _resume(_checkpointed(noise_multiplier=1.0), noise_multiplier=2.0)
    assert resumed.plan.noise_multiplier == 2.0
    assert any("noise_multiplier=2 (the checkpoint's run: 1): the larger noise applies" in m for m in caplog.messages)
    assert not any("its noise_multiplier, target_epsilon and delta are kept" in m for m in caplog.messages)
    with pytest.warns(UserWarning, match="had no noise, so epsilon stays infinite"):
        assert _resume(_checkpointed(noise_multiplier=0.0), noise_multiplier=1.0).plan.noise_multiplier == 1.0


def test_a_resumed_run_takes_the_tighter_of_the_two_budgets():
    """A lower target_epsilon given at resume changes no accounted step and applies; a higher one does not."""
    state = _checkpointed(noise_multiplier=1.0, target_epsilon=20.0)
    assert _resume(state, noise_multiplier=1.0, target_epsilon=2.0).plan.target_epsilon == 2.0
    assert _resume(_checkpointed(noise_multiplier=1.0), target_epsilon=2.0).plan.target_epsilon == 2.0
    with pytest.warns(UserWarning, match=r"target_epsilon=30 \(the checkpoint's run: 20\)"):
        assert _resume(state, noise_multiplier=1.0, target_epsilon=30.0).plan.target_epsilon == 20.0


def test_a_resumed_run_on_more_data_takes_a_smaller_delta():
    """A checkpoint of a run over 50 records (delta 1 / 500) resumed over 1000: its delta is too large for the new
    set, and a smaller target_delta given now applies (before, the checkpoint's was kept and the run could not
    resume at all); the change of data is warned about."""
    state = _checkpointed(noise_multiplier=1.0, target_delta=None)
    state["plan"]["dataset_size"], state["plan"]["delta"] = 50, 1 / 500
    resumed = session(noise_multiplier=1.0, target_delta=1e-5)
    resumed.open_fit(CPU, (0, 0), broadcast=lambda value: value)
    resumed.load_state_dict(state)
    resumed.record_training_data(1000, 5)
    with pytest.warns(UserWarning, match="trained on 50 records with 1000"):
        resumed.start_training(global_step=3, planned_steps=2, data_parallel_size=1)
    assert resumed.plan.delta == 1e-5 and resumed.accountant.steps == 3


def test_a_first_step_over_the_budget_says_what_it_would_spend_and_how_to_fix_it():
    privacy = session(noise_multiplier=1.0, target_epsilon=0.05)
    with pytest.warns(UserWarning) as caught:
        assert start(privacy) is True
    first_step = privacy.accountant.epsilon_after(1, 1.0, 0.1, 1e-3)
    assert first_step > 0.05 and privacy.accountant.steps == 0
    message = " ".join(str(w.message) for w in caught)
    assert f"the first step alone would spend epsilon={first_step:.4g} > target_epsilon=0.05" in message
    for fix in ("noise_multiplier", "larger budget", "sampling rate", "batch_size"):
        assert fix in message
    assert "already spent" not in message and "epsilon=0.000" not in message


def test_training_without_a_step_limit_runs_to_its_budget():
    """``max_steps`` and ``max_epochs`` unset (Lightning plans infinitely many steps): the budget alone ends training,
    at the last step whose epsilon stays within it; without a budget nothing is planned to end."""
    budgeted = session(noise_multiplier=1.0, target_epsilon=2.0)
    assert start(budgeted, planned_steps=math.inf) is False
    allowed = budgeted.steps_left_in_budget
    assert budgeted.plan.planned_steps is None and "no step limit" in budgeted.plan.describe()
    assert budgeted.accountant.epsilon_after(allowed, 1.0, 0.1, 1e-3) <= 2.0
    assert budgeted.accountant.epsilon_after(allowed + 1, 1.0, 0.1, 1e-3) > 2.0
    open_ended = session(noise_multiplier=1.0)
    assert start(open_ended, planned_steps=math.inf) is False and open_ended.steps_left_in_budget is None
    with pytest.raises(ValueError, match="set max_steps or max_epochs"):
        start(session(target_epsilon=2.0), planned_steps=math.inf)


def test_a_sampling_rate_above_one_is_refused_when_planned():
    """Fixed batches reach the plan unchecked by the Poisson sampler: 2 groups x 60 of 100 samples."""
    privacy = session(noise_multiplier=1.0)
    privacy.open_fit(CPU, (0, 0), broadcast=lambda value: value)
    privacy.record_training_data(100, 60)
    with pytest.raises(ValueError, match=r"sampling rate is 1.2 .* must be in \(0, 1\]: lower the DataLoader's"):
        privacy.start_training(global_step=0, planned_steps=10, data_parallel_size=2)


def test_the_budget_search_predicts_the_history_the_steps_will_record():
    """Opacus merges equal consecutive (sigma, q) runs; the prediction does too, so a resumed budget run that ends
    at the predicted step never ends above its target."""
    from lightning_longshield.privacy.accountant import PrivacyAccountant

    accountant = PrivacyAccountant("prv")  # where the split and the merged history differ in the last digits
    for _ in range(300):
        accountant.step(0.9, 0.01)
    predicted = accountant.epsilon_after(700, 0.9, 0.01, 1e-5)
    for _ in range(700):
        accountant.step(0.9, 0.01)
    assert accountant.history == [(0.9, 0.01, 1000)] and accountant.get_epsilon(1e-5) == predicted


def test_fixed_batches_are_not_printed_as_a_guarantee():
    privacy = PrivacySession(PrivacyArguments(1.0, None, 1e-3, max_grad_norm=1.0, accountant="rdp"),
                             poisson_sampling=False)
    with pytest.warns(UserWarning, match="not a formal guarantee"):
        start(privacy)
    described = privacy.describe_guarantee()
    assert described.startswith("Privacy figure, NOT a guarantee of this run (poisson_sampling=False")
    assert ")-DP" not in described


def test_the_noise_cut_off_is_warned_and_added_to_the_printed_delta_where_it_matters():
    """At noise_multiplier 0.18 the CPU keystream's normals (cut off at 9.27 standard deviations) show a sample with
    probability 6.6e-4 a step it is in: over 10 steps at q = 0.1 that is 6.6e-4, above a tenth of delta 1e-3, so
    training starts with a warning and the guarantee states it. ``secure_mode`` (two normals summed, each cut off at
    8.57) adds 2.6e-11. Steps taken are costed at their own noise: a resume at sigma 1 keeps the earlier steps'."""
    from lightning_longshield.privacy.cut_off import KEYSTREAM_TAIL, per_step_cut_off_delta

    privacy = session(noise_multiplier=0.18)
    with pytest.warns(UserWarning, match=r"cut-off \(9.27 standard deviations\) adds up to 0.00066 to delta=0.001"):
        start(privacy)
    for _ in range(10):
        privacy.accountant.step(0.18, 0.1)
    expected = 10 * 0.1 * per_step_cut_off_delta(KEYSTREAM_TAIL, 0.18)
    assert privacy.cut_off_delta() == pytest.approx(expected) and 6e-4 < expected < 7e-4
    assert "(delta plus up to 0.00066 for the noise's floating-point cut-off" in privacy.describe_guarantee()
    for _ in range(10):
        privacy.accountant.step(1.0, 0.1)
    assert privacy.cut_off_delta() == pytest.approx(expected, rel=1e-6)  # sigma 1 adds 1.7e-13 a step
    assert privacy.cut_off_delta(planned_steps=5) > privacy.cut_off_delta()  # the plan's steps, at sigma 0.18

    secure = PrivacySession(PrivacyArguments(0.18, None, 1e-3, max_grad_norm=1.0, accountant="rdp"), secure_mode=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        start(secure)
    for _ in range(10):
        secure.accountant.step(0.18, 0.1)
    assert 1e-11 < secure.cut_off_delta() < 1e-10 and "cut-off" not in secure.describe_guarantee()

    # A resume in secure_mode of the keystream's steps: they keep the keystream's cut-off (the worse of the two).
    state = privacy.state_dict()
    assert state["noise_tails"] == [list(KEYSTREAM_TAIL)]
    resumed = PrivacySession(PrivacyArguments(0.18, None, 1e-3, max_grad_norm=1.0, accountant="rdp"), secure_mode=True)
    resumed.load_state_dict(state)
    with pytest.warns(UserWarning, match="cut-off"):
        start(resumed)
    assert resumed.cut_off_delta() == pytest.approx(expected, rel=1e-6)


def test_a_fit_with_no_step_left_to_plan_is_not_told_its_budget_is_spent():
    """A resume at its run's last step plans no step: it stops, without a warning that the budget (far from spent
    here) stopped it."""
    privacy = session(noise_multiplier=1.0, target_epsilon=8.0)
    start(privacy)
    for _ in range(3):
        privacy.accountant.step(1.0, 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert start(privacy, planned_steps=0, global_step=3)
    with pytest.warns(UserWarning, match="the first step alone would spend"):  # planned steps the budget refuses
        assert start(session(noise_multiplier=1.0, target_epsilon=1e-6), planned_steps=5)


def test_a_resumed_run_at_another_batch_size_is_warned_about():
    state = _checkpointed(noise_multiplier=1.0)
    resumed = session(noise_multiplier=1.0)
    resumed.open_fit(CPU, (0, 0), broadcast=lambda value: value)
    resumed.load_state_dict(state)
    resumed.record_training_data(100, 20)
    with pytest.warns(UserWarning, match=r"expected logical batch of \d+ with 40 \(batch_size or data-parallel size"
                                         r" changed\): the sampling rate goes from .* to 0.4"):
        resumed.start_training(global_step=3, planned_steps=2, data_parallel_size=2)


def test_the_guarantee_names_each_mechanism_the_steps_ran_with():
    """After a resume with more noise, the printed sigma was the last plan's for every step (epsilon was of the
    whole history, which those figures did not reproduce): the steps are counted per mechanism."""
    resumed = _resume(_checkpointed(noise_multiplier=1.0), noise_multiplier=2.0)
    rate = resumed.plan.sample_rate
    assert (f"after 3 steps run (steps by mechanism: 3 at noise_multiplier=1.000, q={rate:.3g}; now"
            " noise_multiplier=2.000") in resumed.describe_guarantee()
    for _ in range(2):
        resumed.accountant.step(resumed.plan.noise_multiplier, resumed.plan.sample_rate)
    assert (f"after 5 steps run (steps by mechanism: 3 at noise_multiplier=1.000, q={rate:.3g}, 2 at"
            f" noise_multiplier=2.000, q={rate:.3g}; now noise_multiplier=2.000") in resumed.describe_guarantee()
