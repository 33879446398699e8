"""The epsilon spent by the end of ``fit`` reaches the loggers once, whatever ends the run (``max_steps``,
``max_epochs``, the ``target_epsilon`` budget) and whether or not Lightning's ``log_every_n_steps`` falls on its last
step; Lightning writes ``self.log``'s values only at those steps or when ``should_stop`` is set."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_longshield import LongShieldStrategy, PrivacyMonitor
from tests.support.helpers import RandomTokens, loader, make_module, make_trainer, small_config

DATA = RandomTokens(size=32, seq_len=8)


def strategy(**kwargs: Any) -> LongShieldStrategy:
    return LongShieldStrategy(**{"noise_multiplier": 1.0, "accountant": "rdp", "target_delta": 1e-3, **kwargs})


def fit(run: LongShieldStrategy, root: Path, ckpt_path: Optional[Path] = None, **trainer_kwargs: Any):
    """Fit a one-layer model on ``DATA`` (logical batch 4: 8 steps an epoch) with a CSVLogger under ``root``."""
    logger = CSVLogger(root)
    trainer = make_trainer(run, logger=logger, default_root_dir=root, **{"max_steps": -1, **trainer_kwargs})
    trainer.fit(make_module(small_config(n_layers=1)), loader(DATA, 4), ckpt_path=ckpt_path)
    return trainer, logger


def epsilon_rows(logger: CSVLogger) -> list[tuple[int, float]]:
    """(step, epsilon) of every row of the logger's metrics.csv that holds an epsilon."""
    path = Path(logger.log_dir) / "metrics.csv"
    if not path.is_file():
        return []
    with path.open(newline="") as file:
        return [(int(row["step"]), float(row["epsilon"])) for row in csv.DictReader(file) if row.get("epsilon")]


def assert_final_epsilon_logged_once(rows: list[tuple[int, float]], run: LongShieldStrategy, final_step: int) -> None:
    assert rows, "no epsilon row"
    assert rows[-1][1] == pytest.approx(run.get_epsilon(), rel=1e-6), rows
    assert sum(1 for _, value in rows if value == pytest.approx(run.get_epsilon(), rel=1e-6)) == 1, rows
    assert rows[-1][0] >= final_step - 1, rows  # Lightning's own rows name the step before (its batches stepped)
    assert len({step for step, _ in rows}) == len(rows), rows


@pytest.mark.parametrize("trainer_kwargs, rows_before_last", [
    (dict(max_steps=7, log_every_n_steps=2), 3),  # Lightning wrote steps 2, 4 and 6, not 7
    (dict(max_steps=5), 0),  # fewer steps than log_every_n_steps (50): Lightning wrote none
    (dict(max_epochs=1, log_every_n_steps=3), 2),  # 8 steps: 3 and 6 written by Lightning, not 8
    (dict(max_steps=4, log_every_n_steps=0), 0),  # no periodic logging: only the final epsilon
])
def test_final_epsilon_reaches_the_logger(tmp_path, trainer_kwargs, rows_before_last):
    run = strategy()
    trainer, logger = fit(run, tmp_path, **trainer_kwargs)
    rows = epsilon_rows(logger)
    assert_final_epsilon_logged_once(rows, run, trainer.global_step)
    assert len(rows) == rows_before_last + 1, rows
    assert rows[-1][0] == trainer.global_step
    assert [value for _, value in rows] == sorted(value for _, value in rows)


def test_no_duplicate_when_lightning_wrote_the_last_step(tmp_path):
    run = strategy()
    trainer, logger = fit(run, tmp_path, max_steps=4, log_every_n_steps=2)
    rows = epsilon_rows(logger)
    assert_final_epsilon_logged_once(rows, run, trainer.global_step)
    assert len(rows) == 2, rows  # Lightning's, at steps 2 and 4 (named 1 and 3)


@pytest.mark.parametrize("log_every_n_steps", [50, 0])
def test_a_run_stopped_by_its_budget_logs_its_final_epsilon_once(tmp_path, log_every_n_steps):
    """The budget sets ``should_stop`` at the step that reaches it: Lightning writes that step's epsilon itself, unless
    ``log_every_n_steps=0`` (it then writes nothing)."""
    run = strategy(noise_multiplier=1.5, target_epsilon=2.0)
    trainer, logger = fit(run, tmp_path, max_steps=200, log_every_n_steps=log_every_n_steps)
    assert 0 < trainer.global_step < 200
    assert_final_epsilon_logged_once(epsilon_rows(logger), run, trainer.global_step)


def test_a_resumed_run_logs_its_final_epsilon(tmp_path):
    """A resumed fit's logger gets the epsilon of the whole run (the steps before the checkpoint included)."""
    first, _ = fit(strategy(), tmp_path / "first", max_steps=3)
    first.save_checkpoint(tmp_path / "run.ckpt")

    resumed = strategy()
    trainer, logger = fit(resumed, tmp_path / "resumed", ckpt_path=tmp_path / "run.ckpt", max_steps=5)
    assert resumed.accountant.steps == 5
    rows = epsilon_rows(logger)
    assert_final_epsilon_logged_once(rows, resumed, trainer.global_step)
    assert rows == [(5, pytest.approx(resumed.get_epsilon(), rel=1e-6))]



def test_a_resume_with_its_budget_spent_logs_nothing(tmp_path):
    """A resume whose budget is already spent runs no step: it spends nothing and logs nothing."""
    first, _ = fit(strategy(noise_multiplier=1.5, target_epsilon=2.0), tmp_path / "first", max_steps=200)
    first.save_checkpoint(tmp_path / "spent.ckpt")
    done = strategy(noise_multiplier=1.5, target_epsilon=2.0)
    trainer, logger = fit(done, tmp_path / "done", ckpt_path=tmp_path / "spent.ckpt", max_steps=200)
    assert trainer.global_step == first.global_step and epsilon_rows(logger) == []


class RecordingLogger:
    def __init__(self) -> None:
        self.metrics: list[tuple[dict[str, float], Optional[int]]] = []
        self.saves = 0

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self.metrics.append((metrics, step))

    def save(self) -> None:
        self.saves += 1


class Strategy:
    privacy_plan = object()

    def get_epsilon(self) -> float:
        return 2.5


@pytest.mark.parametrize("rank_zero", [True, False])
def test_only_global_rank_zero_writes_and_every_logger_gets_it(rank_zero):
    loggers = [RecordingLogger(), RecordingLogger()]
    trainer = SimpleNamespace(strategy=Strategy(), global_step=9, is_global_zero=rank_zero, loggers=loggers)
    monitor = PrivacyMonitor()
    monitor.on_train_end(trainer, None)
    monitor.on_train_end(trainer, None)  # once only
    expected = [({"epsilon": 2.5}, 9)] if rank_zero else []
    assert [logger.metrics for logger in loggers] == [expected, expected]
    assert [logger.saves for logger in loggers] == [len(expected)] * 2
