"""SLURM's requeue signal: the checkpoint is saved at a step boundary (Lightning's handler saved from inside the
signal handler, mid-step), the job requeued, and the requeued fit resumes from it by itself."""

from __future__ import annotations

import os
import signal
import stat

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_longshield import LongShieldStrategy
from tests.support.helpers import RandomTokens, loader, make_module, make_trainer, small_config

DATA = RandomTokens(size=32, seq_len=8)
JOB = "4242"


def _strategy() -> LongShieldStrategy:
    return LongShieldStrategy(noise_multiplier=0.8, max_grad_norm=0.5, micro_batch_size=2, accountant="rdp",
                              target_delta=1e-3)


class _SignalInsideStep(Callback):
    """SIGUSR1 to this process while step ``step`` (counted from 0) runs, between its backward and its update."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)


class _FirstStep(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step


def _on_slurm(tmp_path, monkeypatch) -> os.PathLike:
    """A one-task SLURM job whose ``scontrol`` records its arguments."""
    tools = tmp_path / "bin"
    tools.mkdir()
    calls = tmp_path / "scontrol_calls"
    scontrol = tools / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    for name, value in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": JOB, "SLURM_PROCID": "0",
                        "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    return calls


def test_the_requeue_signal_saves_at_the_step_boundary_requeues_and_the_requeued_fit_resumes(tmp_path, monkeypatch):
    calls = _on_slurm(tmp_path, monkeypatch)
    root = tmp_path / "run"
    first = make_trainer(_strategy(), max_steps=4, default_root_dir=root, callbacks=[_SignalInsideStep(1)])
    with pytest.raises(SIGTERMException):  # a SystemExit of status 0: the job's script ends cleanly
        first.fit(make_module(small_config(n_layers=1)), loader(DATA, 4))
    assert first.interrupted and first.global_step == 2  # the signalled step finished, no later one ran
    saved = torch.load(root / "hpc_ckpt_1.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] == 2
    assert calls.read_text().split() == ["requeue", JOB]
    assert "_slurm_sigusr_handler_fn" not in vars(first._signal_connector)  # Lightning's own for later runs

    # A later save cut off under its temporary name: Lightning reads it as version 248213 and asks for that.
    (root / ".hpc_ckpt_2.ckpt.48213.partial").write_bytes(b"cut off")
    starts = _FirstStep()
    resumed = make_trainer(_strategy(), max_steps=4, default_root_dir=root, callbacks=[starts])
    with pytest.warns(UserWarning, match=r"hpc_ckpt_248213\.ckpt does not exist.*resuming from .*hpc_ckpt_1\.ckpt"):
        resumed.fit(make_module(small_config(n_layers=1)), loader(DATA, 4))  # no ckpt_path: Lightning's HPC resume
    assert starts.step == 2 and resumed.global_step == 4
    uninterrupted = make_trainer(_strategy(), max_steps=4)
    uninterrupted.fit(make_module(small_config(n_layers=1)), loader(DATA, 4))
    assert resumed.strategy.get_epsilon() == uninterrupted.strategy.get_epsilon()  # the 4 steps, each once


def test_the_strategy_adds_the_callback_to_every_requeueing_fit_and_a_failed_requeue_names_the_checkpoint(
        tmp_path, monkeypatch):
    """Even without checkpointing (Lightning's handler saved regardless); an array task is requeued as
    ``<array job>_<task>``; no requeue after the last step; where ``scontrol`` fails or is missing, the warning says to
    resubmit and where to resume from."""
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments import SLURMEnvironment

    from lightning_longshield.callbacks import add_training_callbacks
    from lightning_longshield.preemption import PreemptionCheckpoint

    calls = _on_slurm(tmp_path, monkeypatch)
    on_slurm = SimpleNamespace(cluster_environment=SLURMEnvironment())
    trainer = SimpleNamespace(callbacks=[], world_size=1, checkpoint_callbacks=[], _accelerator_connector=on_slurm)
    add_training_callbacks(trainer)
    callback = trainer.callbacks[-1]
    assert isinstance(callback, PreemptionCheckpoint)

    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    saved = []
    trainer = SimpleNamespace(loggers=[], default_root_dir=str(tmp_path), fit_loop=SimpleNamespace(done=False),
                              strategy=SimpleNamespace(broadcast=lambda value: value, barrier=lambda name: None),
                              save_checkpoint=saved.append, is_global_zero=True, global_step=5)
    callback._save_and_requeue(trainer)
    assert saved == [str(tmp_path / "hpc_ckpt_1.ckpt")] and calls.read_text().split() == ["requeue", "77_3"]

    callback._save_and_requeue(trainer, save=False)  # signalled in the sanity check: nothing to save, still requeued
    assert len(saved) == 1 and calls.read_text().split() == ["requeue", "77_3"] * 2

    trainer.fit_loop.done = True  # signalled with the last step: saved, nothing left to requeue for
    callback._save_and_requeue(trainer)
    assert len(saved) == 2 and calls.read_text().split() == ["requeue", "77_3"] * 2
    trainer.fit_loop.done = False

    (tmp_path / "bin" / "scontrol").write_text("#!/bin/sh\nexit 1\n")
    with pytest.warns(UserWarning, match=r"not requeued \(scontrol exit status 1\).*resubmit.*hpc_ckpt_1\.ckpt"):
        callback._save_and_requeue(trainer)
    (tmp_path / "bin" / "scontrol").unlink()  # a container without SLURM's tools: a warning, not a crash
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.warns(UserWarning, match=r"not requeued \(scontrol could not run: .*resubmit"):
        callback._save_and_requeue(trainer)


def test_hpc_checkpoints_are_numbered_from_exact_names_and_a_damaged_one_is_passed_over(tmp_path):
    from lightning_longshield.hpc_checkpoints import missing_hpc_checkpoint_replacement, next_hpc_checkpoint

    assert next_hpc_checkpoint(tmp_path) == tmp_path / "hpc_ckpt_1.ckpt"
    torch.save({"step": 1}, tmp_path / "hpc_ckpt_2.ckpt")
    (tmp_path / "hpc_ckpt_3.ckpt").write_bytes(b"damaged")
    (tmp_path / ".hpc_ckpt_4.ckpt.48213.partial").write_bytes(b"cut off")
    assert next_hpc_checkpoint(tmp_path) == tmp_path / "hpc_ckpt_4.ckpt"
    assert missing_hpc_checkpoint_replacement(tmp_path / "hpc_ckpt_448213.ckpt") == tmp_path / "hpc_ckpt_2.ckpt"
    assert missing_hpc_checkpoint_replacement(tmp_path / "hpc_ckpt_3.ckpt") is None  # there: loading it says why
    assert missing_hpc_checkpoint_replacement(tmp_path / "last.ckpt") is None  # not an HPC name
