"""One attempt of a checkpointed DP run that may be killed with SIGKILL: resumes from the newest checkpoint that
loads, trains to ``max_steps`` and prints ``{"epsilon", "steps", "run"}`` as its last line, unless it is killed.

    python -m tests.support.ledger_crash_worker ROOT MAX_STEPS KILL_AFTER KILL_POINT [PROCESSES KILL_RANK]

The attempt is killed ``KILL_AFTER`` steps after the step it resumed at, at ``KILL_POINT``: ``batch_start`` (before
the step), ``release`` (the step is in the ledger, its gradient not yet released), ``batch_end`` (released, not yet
checkpointed), ``save`` (the first checkpoint save from then on, before its file is written), ``mid_save`` (the
same save, half written; sharded: once this rank's shards are written), ``manifest`` (sharded: rank 0 dies halfway
through the save's last files), ``sigterm`` (SIGTERM before the step: the run saves ``last.ckpt`` at the step's end
and exits with status 0) or ``none``.

With ``PROCESSES`` 2 (CP 2, sharded checkpoints) the script relaunches itself as rank 1, or, started once per rank
with torchrun's environment (``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), joins the
others; rank ``KILL_RANK`` SIGKILLs the whole process group, as a lost node would end the job (run it in a session of
its own), or, at ``sigterm``, sends SIGTERM to itself alone.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_longshield import LongShieldStrategy, sharded_checkpoints
from lightning_longshield.sharded_checkpoints import is_whole_sharded_checkpoint
from tests.support.helpers import RandomTokens, loader, make_module, make_trainer, small_config

DELTA = 1e-3


def _die() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        os.killpg(os.getpgid(0), signal.SIGKILL)  # every rank of the job at once
    os.kill(os.getpid(), signal.SIGKILL)


class KillAt(Callback):
    def __init__(self, after: int, point: str) -> None:
        self.after, self.point, self.step = after, point, -1

    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step + self.after

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.point == "batch_start" and trainer.global_step == self.step:
            _die()
        if self.point == "sigterm" and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.point == "batch_end" and trainer.global_step == self.step + 1:
            _die()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if self.point == "save" and trainer.global_step >= self.step:
            _die()
        if self.point == "mid_save" and trainer.global_step >= self.step:
            torch.save = _half_then_die  # the file is being written when the process dies


def _half_then_die(obj, file, *args, **kwargs) -> None:
    file.write(b"PK\x03\x04 half a checkpoint")
    file.flush()
    _die()


def newest_checkpoint(directory: Path) -> Path | None:
    """The checkpoint of the highest step that loads (a save cut short by the kill does not)."""
    steps = {}
    for path in directory.glob("*.ckpt"):
        if path.is_dir() and not is_whole_sharded_checkpoint(path):
            continue
        try:
            steps[path] = torch.load(path / "meta.pt" if path.is_dir() else path, map_location="cpu",
                                     weights_only=False)["global_step"]
        except Exception:  # a torn file
            continue
    return max(steps, key=steps.get) if steps else None


def _kill_inside_sharded_saves(point: str, kill: KillAt, trainer_of: Callable[[], object]) -> None:
    """``mid_save``: die once this rank's shards are written; ``manifest``: rank 0 dies halfway through writing the
    save's own files (its state, then the manifest)."""
    def due() -> bool:
        return trainer_of().global_step >= kill.step  # type: ignore[attr-defined]

    if point == "mid_save":
        save = sharded_checkpoints.dcp.save

        def save_then_die(*args, **kwargs):
            save(*args, **kwargs)
            if due():
                _die()

        sharded_checkpoints.dcp.save = save_then_die
    if point == "manifest":
        write = sharded_checkpoints.write_durably

        def half_then_die(path, writer):
            if not due():
                return write(path, writer)
            with open(path, "wb") as file:
                file.write(b"half")
                file.flush()
            _die()

        sharded_checkpoints.write_durably = half_then_die


def main(root: Path, max_steps: int, kill_after: int, kill_point: str, processes: int = 1, kill_rank: int = 0) -> None:
    strategy = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=DELTA,
                                  context_parallel_size=processes,
                                  checkpoint_format="sharded" if processes > 1 else "full",
                                  timeout=timedelta(seconds=120))  # a deadlock fails in 2 minutes, not Lightning's 30
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    kill = KillAt(kill_after, kill_point if rank == kill_rank else "none")
    if kill_point == "release" and rank == kill_rank:
        record = strategy.privacy.record_release

        def record_then_die() -> None:
            record()
            if strategy.lightning_module.trainer.global_step == kill.step:
                _die()

        strategy.privacy.record_release = record_then_die  # type: ignore[method-assign]
    if processes > 1 and rank == kill_rank:
        _kill_inside_sharded_saves(kill_point, kill, lambda: strategy.lightning_module.trainer)
    checkpoints = ModelCheckpoint(dirpath=root / "checkpoints", filename="{step}", every_n_train_steps=2,
                                  save_top_k=-1)
    trainer = make_trainer(strategy, max_steps=max_steps, default_root_dir=root, enable_checkpointing=True,
                           callbacks=[checkpoints, kill], devices=processes)
    trainer.fit(make_module(small_config(n_layers=1), optimizer="sgd", learning_rate=1e-2),
                loader(RandomTokens(size=32, seq_len=8), 4), ckpt_path=newest_checkpoint(root / "checkpoints"))
    if trainer.global_rank == 0:
        print(json.dumps({"epsilon": strategy.get_epsilon(), "steps": strategy.accountant.steps,
                          "run": strategy.privacy.run_id}))


def run_attempt(argv: list[str], stdout_path: str, stderr_path: str, environment: dict[str, str]) -> None:
    """One one-process attempt in a process forked from the test's server (``argv`` as on the command line, without
    the imports of a fresh interpreter): its output goes to the two files, ``environment`` updates its environment."""
    for descriptor, path in ((1, stdout_path), (2, stderr_path)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(file, descriptor)
        os.close(file)
    os.environ.update(environment)
    tempfile.tempdir = None  # TMPDIR is read again
    _main_of(argv)


def _main_of(argv: list[str]) -> None:
    main(Path(argv[0]), int(argv[1]), int(argv[2]), argv[3], *map(int, argv[4:6]))


if __name__ == "__main__":
    _main_of(sys.argv[1:])
