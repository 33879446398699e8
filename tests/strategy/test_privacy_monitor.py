"""`PrivacyMonitor` logs epsilon every ``log_every_n_steps``, at the first step and at the run's last step only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_longshield import PrivacyMonitor


class Strategy:
    privacy_plan = object()

    def get_epsilon(self) -> float:
        return 1.0


@pytest.mark.parametrize("max_epochs, epoch, logged", [
    (-1, 3, False),  # an endless epoch budget (max_steps decides): an epoch's last batch is not the run's
    (None, 3, False),
    (4, 3, True),  # the last batch of the last epoch
    (4, 2, False),
])
def test_epsilon_is_logged_at_the_runs_last_batch_only(max_epochs, epoch, logged):
    trainer = SimpleNamespace(strategy=Strategy(), max_epochs=max_epochs, current_epoch=epoch, should_stop=False,
                              global_step=7, max_steps=100, is_last_batch=True, log_every_n_steps=50)
    calls = []
    module = SimpleNamespace(log=lambda name, value, **kwargs: calls.append((name, value)))
    PrivacyMonitor().on_train_batch_end(trainer, module, None, None, 0)
    assert calls == ([("epsilon", 1.0)] if logged else [])


@pytest.mark.parametrize("step, logged", [(1, True), (6, False), (100, True)])
def test_no_periodic_logging_with_log_every_n_steps_0(step, logged):
    """Lightning takes ``log_every_n_steps=0`` as no periodic logging (it raised ZeroDivisionError here): epsilon is
    still logged at the first and the last step."""
    trainer = SimpleNamespace(strategy=Strategy(), max_epochs=None, current_epoch=0, should_stop=False,
                              global_step=step, max_steps=100, is_last_batch=False, log_every_n_steps=0)
    calls = []
    module = SimpleNamespace(log=lambda name, value, **kwargs: calls.append((name, value)))
    PrivacyMonitor().on_train_batch_end(trainer, module, None, None, 0)
    assert calls == ([("epsilon", 1.0)] if logged else [])
