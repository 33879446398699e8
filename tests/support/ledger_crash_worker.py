"""One attempt of a checkpointed DP run that may be killed with SIGKILL: resumes from the newest checkpoint that
loads, trains to ``max_steps`` and prints ``{"epsilon", "steps", "run"}`` as its last line, unless it is killed.

    python -m tests.support.ledger_crash_worker ROOT MAX_STEPS KILL_AFTER KILL_POINT

The attempt is killed ``KILL_AFTER`` steps after the step it resumed at, at ``KILL_POINT``: ``batch_start`` (before
the step), ``release`` (the step is in the ledger, its gradient not yet released), ``batch_end`` (released, not yet
checkpointed), ``save`` (the first checkpoint save from then on, before its file is written), ``mid_save`` (the
same save, half written), ``sigterm`` (SIGTERM
before the step: the run saves ``last.ckpt`` at the step's end and exits with status 0) or ``none``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_longshield import LongShieldStrategy
from tests.support.helpers import RandomTokens, loader, make_module, make_trainer, small_config

DELTA = 1e-3


def _die() -> None:
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
        try:
            steps[path] = torch.load(path, map_location="cpu", weights_only=False)["global_step"]
        except Exception:  # a torn file
            continue
    return max(steps, key=steps.get) if steps else None


def main(root: Path, max_steps: int, kill_after: int, kill_point: str) -> None:
    strategy = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=DELTA)
    kill = KillAt(kill_after, kill_point)
    if kill_point == "release":
        record = strategy.privacy.record_release

        def record_then_die() -> None:
            record()
            if strategy.lightning_module.trainer.global_step == kill.step:
                _die()

        strategy.privacy.record_release = record_then_die  # type: ignore[method-assign]
    checkpoints = ModelCheckpoint(dirpath=root / "checkpoints", filename="{step}", every_n_train_steps=2,
                                  save_top_k=-1)
    trainer = make_trainer(strategy, max_steps=max_steps, default_root_dir=root, enable_checkpointing=True,
                           callbacks=[checkpoints, kill])
    trainer.fit(make_module(small_config(n_layers=1), optimizer="sgd", learning_rate=1e-2),
                loader(RandomTokens(size=32, seq_len=8), 4), ckpt_path=newest_checkpoint(root / "checkpoints"))
    print(json.dumps({"epsilon": strategy.get_epsilon(), "steps": strategy.accountant.steps,
                      "run": strategy.privacy.run_id}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
