"""`StepProgressBar`: the training bar of a DP run counts its steps, not one epoch's batches."""

from __future__ import annotations

import pytest

from lightning_longshield import LongShieldStrategy
from lightning_longshield.progress import StepProgressBar
from tests.support.helpers import RandomTokens, loader, make_module, make_trainer, small_config


def train(max_steps: int, batches_per_epoch: int, **trainer_kwargs) -> StepProgressBar:
    bar = StepProgressBar()
    strategy = LongShieldStrategy(noise_multiplier=1.0, max_grad_norm=1.0, micro_batch_size=4,
                                  poisson_sampling=False)
    trainer = make_trainer(strategy, max_steps, enable_progress_bar=True, callbacks=[bar], **trainer_kwargs)
    trainer.fit(make_module(small_config()), loader(RandomTokens(size=4 * batches_per_epoch), 4))
    assert trainer.global_step == bar.progress.tasks[bar.train_progress_bar_id].completed
    return bar


@pytest.mark.parametrize("max_steps, batches_per_epoch", [(3, 8), (5, 2)], ids=["within-an-epoch", "over-epochs"])
def test_the_bar_counts_steps_of_a_max_steps_run(max_steps, batches_per_epoch):
    bar = train(max_steps, batches_per_epoch)
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert (task.total, task.completed) == (max_steps, max_steps)
    assert task.description.strip().endswith("Step") and "-" not in task.description


def test_an_epoch_bounded_run_counts_all_its_steps():
    bar = train(-1, 2, max_epochs=2)
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert (task.total, task.completed) == (4, 4)


def test_without_a_terminal_the_steps_are_written_as_lines(capsys):
    """Rich draws the bar only when it ends where the output is no terminal (a batch job's log): plain lines say
    how far the run is, every ``line_seconds`` and at the last step."""
    bar = train(3, 8)
    assert not bar._console.is_terminal  # pytest captures the output
    assert capsys.readouterr().err.splitlines()[-1:] == ["Step 3/3"]  # the first step's line, then the last's
    every = StepProgressBar(line_seconds=0.0)
    strategy = LongShieldStrategy(noise_multiplier=1.0, max_grad_norm=1.0, micro_batch_size=4, poisson_sampling=False)
    make_trainer(strategy, 3, enable_progress_bar=True, callbacks=[every]).fit(
        make_module(small_config()), loader(RandomTokens(size=32), 4))
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("Step ")] == [
        "Step 1/3", "Step 2/3", "Step 3/3"]
