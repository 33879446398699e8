"""A sharded save over a name that is a symbolic link (``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` one)
replaces the link, never what it points to, leaves no temporary behind, and saves to that name again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_longshield import LongShieldStrategy, sharded_checkpoints
from lightning_longshield.sharded_checkpoints import is_whole_sharded_checkpoint, read_model_state
from tests.support.helpers import RandomTokens, full_state, loader, make_module, make_trainer, small_config

DATA = RandomTokens(size=16, seq_len=8)


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _sharded_fit(tmp_path: Path, **kwargs):
    strategy = LongShieldStrategy(noise_multiplier=1.0, target_delta=1e-3, checkpoint_format="sharded")
    trainer = make_trainer(strategy, max_steps=2, default_root_dir=tmp_path, **kwargs)
    trainer.fit(make_module(small_config(n_layers=1)), loader(DATA, 4))
    return trainer


def test_saving_twice_over_a_last_link_replaces_the_link_and_keeps_its_target(tmp_path):
    """What `PreemptionCheckpoint` does at every SIGTERM of a requeued run whose ``last.ckpt`` is Lightning's link."""
    folder = tmp_path / "ckpt"
    trainer = _sharded_fit(tmp_path, enable_checkpointing=True, callbacks=[ModelCheckpoint(
        dirpath=folder, every_n_train_steps=1, save_top_k=-1, save_last="link")])
    last = folder / "last.ckpt"
    assert last.is_symlink()
    target = folder / os.readlink(last)
    assert is_whole_sharded_checkpoint(target)
    before, model_before = _contents(target), read_model_state(target)

    for _ in range(2):
        trainer.save_checkpoint(last)
        assert not last.is_symlink() and is_whole_sharded_checkpoint(last)
        assert not list(folder.glob(".*.partial")) and not list(folder.glob(".*.previous"))

    assert _contents(target) == before  # the linked checkpoint, untouched
    for name, tensor in read_model_state(target).items():
        torch.testing.assert_close(tensor, model_before[name])
    saved, live = read_model_state(last), full_state(trainer.lightning_module)
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, live[name])


def test_a_one_file_save_over_a_link_to_a_sharded_checkpoint_replaces_the_link(tmp_path):
    """A sharded run with ``last.ckpt`` linked to its checkpoint, resumed where one-file saves are chosen (one
    process under ``checkpoint_format="auto"``): its first save to ``last.ckpt`` (a `PreemptionCheckpoint` at
    SIGTERM) failed, torch refusing to remove a link as a folder."""
    trainer = _sharded_fit(tmp_path)
    target, last = tmp_path / "step=2.ckpt", tmp_path / "last.ckpt"
    trainer.save_checkpoint(target)
    last.symlink_to(target.name)
    before = _contents(target)
    trainer.strategy.checkpoint_format = "full"
    trainer.save_checkpoint(last)
    assert not last.is_symlink() and last.is_file() and _contents(target) == before
    assert torch.load(last, weights_only=False)["global_step"] == 2


def _link(final: Path, kind: str, tmp_path: Path) -> Path:
    """Make ``final`` a link to a sharded checkpoint's folder, a one-file checkpoint, or nothing; returns its
    target."""
    target = tmp_path / {"folder": "step2.ckpt", "file": "step1.ckpt", "dangling": "gone.ckpt"}[kind]
    if kind == "folder":
        target.mkdir()
        (target / "meta.pt").write_text("linked")
    elif kind == "file":
        target.write_text("linked")
    final.symlink_to(target.name)
    return target


@pytest.mark.parametrize("atomic", [True, False], ids=["exchanged", "renamed-aside"])
@pytest.mark.parametrize("kind", ["folder", "file", "dangling"])
def test_a_link_of_the_same_name_is_replaced_not_followed(tmp_path, monkeypatch, atomic, kind):
    if atomic and not sharded_checkpoints._exchange(tmp_path, tmp_path):  # swapping a path with itself: a no-op
        pytest.skip("no atomic exchange of paths here")
    if not atomic:
        monkeypatch.setattr(sharded_checkpoints, "_exchange", lambda first, second: False)
    final, new = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.partial"
    target = _link(final, kind, tmp_path)
    new.mkdir()
    (new / "meta.pt").write_text("new")
    sharded_checkpoints.replace_folder(new, final)
    assert not final.is_symlink() and (final / "meta.pt").read_text() == "new"
    left = ["last.ckpt"] if kind == "dangling" else sorted(["last.ckpt", target.name])
    assert sorted(p.name for p in tmp_path.iterdir()) == left
    if kind == "folder":
        assert (target / "meta.pt").read_text() == "linked"
    elif kind == "file":
        assert target.read_text() == "linked"


def test_temporaries_that_are_links_are_removed_not_followed(tmp_path):
    """Links a save left under temporary names (before links were replaced rather than followed) go at the next save,
    fresh or not; what they point to stays."""
    trainer = _sharded_fit(tmp_path)
    folder = tmp_path / "ckpt"
    kept = folder / "step2.ckpt"
    trainer.save_checkpoint(kept)
    before = _contents(kept)
    for name in (".last.ckpt.partial", ".other.ckpt.partial", ".gone.ckpt.partial"):
        (folder / name).symlink_to("gone.ckpt" if name.startswith(".gone") else kept.name)
    trainer.save_checkpoint(folder / "last.ckpt")
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step2.ckpt"]
    assert _contents(kept) == before and is_whole_sharded_checkpoint(kept)
