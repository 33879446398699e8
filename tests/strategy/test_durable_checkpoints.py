"""Checkpoint files appear whole or not at all (temporary name, fsync, rename), and a damaged one is refused with
its name and the newest whole checkpoint beside it, never loaded in part."""

from __future__ import annotations

import os
import re
import time
import zipfile
from pathlib import Path

import pytest
import torch

from lightning_longshield import LongShieldStrategy
from lightning_longshield.durable_checkpoints import CorruptCheckpointError, DurableCheckpointIO, is_whole_checkpoint
from lightning_longshield.sharded_checkpoints import is_whole_sharded_checkpoint, read_model_state
from tests.support.helpers import RandomTokens, loader, make_module, make_trainer, small_config

DATA = RandomTokens(size=16, seq_len=8)


def _fit(tmp_path, max_steps: int, ckpt_path=None):
    strategy = LongShieldStrategy(noise_multiplier=1.0, target_delta=1e-3)
    trainer = make_trainer(strategy, max_steps=max_steps, default_root_dir=tmp_path)
    trainer.fit(make_module(small_config(n_layers=1)), loader(DATA, 4), ckpt_path=ckpt_path)
    return trainer


def test_a_checkpoint_is_renamed_into_place_whole(tmp_path):
    trainer = _fit(tmp_path, 1)
    assert isinstance(trainer.strategy.checkpoint_io, DurableCheckpointIO)
    trainer.save_checkpoint(tmp_path / "ckpt" / "step1.ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step1.ckpt"]  # no temporary left behind
    assert is_whole_checkpoint(tmp_path / "ckpt" / "step1.ckpt")


def test_a_write_cut_short_leaves_the_previous_file(tmp_path, monkeypatch):
    io = DurableCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "payload": torch.ones(1000)}, path)

    def torn_save(obj, file, *args, **kwargs):
        file.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"global_step": 2}, path)
    monkeypatch.undo()
    assert io.load_checkpoint(path)["global_step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_checkpoint_is_refused_with_the_last_good_one(tmp_path, damage):
    trainer = _fit(tmp_path, 1)
    good, bad = tmp_path / "ckpt" / "step1.ckpt", tmp_path / "ckpt" / "step2.ckpt"
    trainer.save_checkpoint(good)
    trainer.save_checkpoint(bad)
    data = bytearray(bad.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:  # one byte inside a stored tensor: the archive's CRC no longer matches
        data[len(data) // 3] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=rf"{bad} is truncated or damaged .* beside it is {good}"):
        _fit(tmp_path, 2, ckpt_path=bad)


#: A small checkpoint, and one byte of its file set to a value (found by a seeded fuzz of it) with the error that the
#: damage makes zipfile's integrity check, or torch's reader after it, raise when nothing catches it.
SMALL_CHECKPOINT = {"global_step": 1, "state_dict": {"w": torch.arange(16, dtype=torch.float32)}, "name": "run"}
DAMAGES = {
    "name no longer UTF-8": (1266, 128, UnicodeDecodeError),  # zipfile's check
    "unknown zip version": (1353, 253, NotImplementedError),  # zipfile's check
    "header only torch checks": (1494, 37, RuntimeError),  # passes zipfile's check; torch's reader refuses it
    "record marked as a folder": (1385, 127, (ValueError, UnicodeDecodeError)),  # torch's reader reads it as garbage
}


def _damaged(path: Path, offset: int, value: int) -> Path:
    DurableCheckpointIO().save_checkpoint(SMALL_CHECKPOINT, path)
    data = bytearray(path.read_bytes())
    data[offset] = value
    path.write_bytes(bytes(data))
    return path


def _read_unchecked(path: Path) -> None:
    """zipfile's integrity check, then torch's reader, with nothing caught."""
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
    torch.load(path, weights_only=True)


@pytest.mark.parametrize("damage", DAMAGES)
def test_damage_that_breaks_the_zip_readers_is_refused_by_name(tmp_path, damage):
    """Damage that made zipfile's check or torch's reader raise its own error (a raw traceback, the file unnamed):
    `CorruptCheckpointError` naming the file and the newest whole checkpoint beside it."""
    offset, value, raw_error = DAMAGES[damage]
    good = tmp_path / "good.ckpt"
    DurableCheckpointIO().save_checkpoint(SMALL_CHECKPOINT, good)
    bad = _damaged(tmp_path / "bad.ckpt", offset, value)
    with pytest.raises(raw_error):  # the damage this case is about (else torch.save's layout changed: fuzz again)
        _read_unchecked(bad)
    with pytest.raises(CorruptCheckpointError, match=rf"{re.escape(str(bad))} is .*damaged.* beside it is"
                                                     rf" {re.escape(str(good))}"):
        DurableCheckpointIO().load_checkpoint(bad)


def test_a_damaged_checkpoint_with_none_whole_beside_it_names_what_to_do(tmp_path):
    offset, value, _ = DAMAGES["header only torch checks"]
    bad = _damaged(tmp_path / "last.ckpt", offset, value)
    with pytest.raises(CorruptCheckpointError, match="no whole checkpoint is beside it: pass ckpt_path a whole"
                                                     " checkpoint from elsewhere, or start afresh without ckpt_path"):
        DurableCheckpointIO().load_checkpoint(bad)


def test_a_link_to_nothing_beside_a_damaged_checkpoint_does_not_hide_the_damage(tmp_path):
    """A ``best.ckpt`` whose target was removed made the search for a whole checkpoint beside the damaged one raise
    FileNotFoundError about the link, instead of the error that names the damage and the newest whole one."""
    good = tmp_path / "good.ckpt"
    DurableCheckpointIO().save_checkpoint({"x": torch.ones(10)}, good)
    offset, value, _ = DAMAGES["header only torch checks"]
    bad = _damaged(tmp_path / "last.ckpt", offset, value)
    os.symlink(tmp_path / "gone.ckpt", tmp_path / "best.ckpt")
    with pytest.raises(CorruptCheckpointError, match=rf"{re.escape(str(bad))} is .*damaged.* beside it is {good}"):
        DurableCheckpointIO().load_checkpoint(bad)


def test_a_one_file_save_over_a_sharded_checkpoint_of_that_name_never_leaves_the_name_empty(tmp_path, monkeypatch):
    """The format changed under one name (``"auto"`` after resuming on fewer processes, or ``checkpoint_format``
    switched): Lightning's save removed the sharded folder before writing the file, so a kill during the write left
    no ``last.ckpt``, and a resume started afresh. The file is written aside and swapped in."""
    import lightning_longshield.durable_checkpoints as durable

    last = tmp_path / "last.ckpt"
    _sharded_fit(tmp_path, max_steps=2).save_checkpoint(last)
    trainer = make_trainer(LongShieldStrategy(noise_multiplier=1.0, target_delta=1e-3, checkpoint_format="full"),
                           max_steps=3, default_root_dir=tmp_path)
    trainer.fit(make_module(small_config(n_layers=1)), loader(DATA, 4), ckpt_path=last)

    def killed(*_, **__):
        raise KeyboardInterrupt("killed while writing")

    with monkeypatch.context() as patched:
        patched.setattr(durable.torch, "save", killed)
        with pytest.raises(KeyboardInterrupt):
            trainer.save_checkpoint(last)
    assert is_whole_sharded_checkpoint(last)
    trainer.save_checkpoint(last)
    assert last.is_file() and is_whole_checkpoint(last)
    assert torch.load(last, weights_only=False)["global_step"] == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".last.ckpt") and "partial" not in p.name]


def _sharded_fit(tmp_path, max_steps: int, ckpt_path=None):
    strategy = LongShieldStrategy(noise_multiplier=1.0, target_delta=1e-3, checkpoint_format="sharded")
    trainer = make_trainer(strategy, max_steps=max_steps, default_root_dir=tmp_path)
    trainer.fit(make_module(small_config(n_layers=1)), loader(DATA, 4), ckpt_path=ckpt_path)
    return trainer


def test_a_sharded_checkpoint_appears_whole_and_replaces_its_name(tmp_path):
    trainer = _sharded_fit(tmp_path, 1)
    path = tmp_path / "ckpt" / "last.ckpt"
    trainer.save_checkpoint(path)
    first = (path / "meta.pt").stat().st_mtime_ns
    trainer.save_checkpoint(path)  # a second save replaces the folder, through a temporary name
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["last.ckpt"]  # nothing partial left
    assert (path / "meta.pt").stat().st_mtime_ns >= first
    assert {".metadata", "meta.pt", "manifest.json"} <= {p.name for p in path.iterdir()}
    assert is_whole_sharded_checkpoint(path)


@pytest.mark.parametrize("checkpoint_format", ["full", "sharded"])
def test_a_save_removes_what_killed_saves_left_but_not_a_save_under_way(tmp_path, checkpoint_format):
    """Temporaries untouched for an hour were left by killed saves (a file per full save, a folder per sharded one);
    a fresh one may be another run's save in progress in the same folder, and stays."""
    strategy = LongShieldStrategy(noise_multiplier=1.0, target_delta=1e-3, checkpoint_format=checkpoint_format)
    trainer = make_trainer(strategy, max_steps=1, default_root_dir=tmp_path)
    trainer.fit(make_module(small_config(n_layers=1)), loader(DATA, 4))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    old_file, old_folder = folder / ".step=2.ckpt.123.partial", folder / ".step=4.ckpt.partial"
    fresh_file, fresh_folder = folder / ".step=6.ckpt.456.partial", folder / ".other.ckpt.partial"
    for path in (old_folder, fresh_folder):
        path.mkdir()
        (path / "__0_0.distcp").write_bytes(b"shard")
    for path in (old_file, fresh_file):
        path.write_bytes(b"partial")
    hours_ago = time.time() - 2 * 3600
    for path in (old_file, old_folder, old_folder / "__0_0.distcp"):
        os.utime(path, (hours_ago, hours_ago))
    trainer.save_checkpoint(folder / "last.ckpt")
    assert sorted(p.name for p in folder.iterdir()) == sorted(["last.ckpt", fresh_file.name, fresh_folder.name])


@pytest.mark.parametrize("atomic", [True, False], ids=["exchanged", "renamed-aside"])
def test_a_folder_of_the_same_name_is_replaced_whole(tmp_path, monkeypatch, atomic):
    """On Linux the new folder and the previous one are swapped in one step (``final`` never missing); elsewhere, or
    where the file system cannot, the previous one is renamed aside first. Either way nothing is left behind."""
    from lightning_longshield import sharded_checkpoints

    if atomic and not sharded_checkpoints._exchange(tmp_path, tmp_path):  # swapping a path with itself: a no-op
        pytest.skip("no atomic exchange of paths here")
    if not atomic:
        monkeypatch.setattr(sharded_checkpoints, "_exchange", lambda first, second: False)
    final, new = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.partial"
    for folder, text in ((final, "previous"), (new, "new")):
        folder.mkdir()
        (folder / "meta.pt").write_text(text)
    sharded_checkpoints.replace_folder(new, final)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert (final / "meta.pt").read_text() == "new"


def _swap_cut_off_between_renames(trainer, folder, new_whole: bool = True,
                                  previous: bool = True) -> dict[str, int]:
    """The state a crash leaves between `replace_folder`'s renames where folders cannot be swapped atomically: no
    ``last.ckpt``, the previous checkpoint at ``.last.ckpt.previous`` (unless not ``previous``: a first save of the
    name), the new one at ``.last.ckpt.partial`` (its manifest removed unless ``new_whole``). Returns each one's inode,
    which a rename keeps."""
    kept = ("previous", "partial") if previous else ("partial",)
    for which in kept:
        trainer.save_checkpoint(folder / which)
    inodes = {which: (folder / which).stat().st_ino for which in kept}
    for which in kept:
        (folder / which).rename(folder / f".last.ckpt.{which}")
    if not new_whole:
        (folder / ".last.ckpt.partial" / "manifest.json").unlink()
    return inodes


@pytest.mark.parametrize(("new_whole", "previous"), [(True, True), (False, True), (True, False)],
                         ids=["new-whole", "new-damaged", "first-save"])
def test_a_swap_cut_off_between_its_renames_is_completed_when_its_name_is_loaded(tmp_path, new_whole, previous):
    """Loading the missing name gives it the new checkpoint if whole (else the previous one), with a warning, and
    removes the other, as the swap would have; the fit resumes from it. A first save of the name has no previous."""
    folder = tmp_path / "ckpt"
    inodes = _swap_cut_off_between_renames(_sharded_fit(tmp_path, 1), folder, new_whole, previous)
    with pytest.warns(UserWarning, match=f"was missing.* The {'new' if new_whole else 'previous'} one, whole"):
        assert _sharded_fit(tmp_path, 2, ckpt_path=folder / "last.ckpt").global_step == 2
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]
    assert (folder / "last.ckpt").stat().st_ino == inodes["partial" if new_whole else "previous"]


def test_a_save_of_the_same_name_completes_its_cut_off_swap_before_replacing_its_temporary(tmp_path, monkeypatch):
    """A new save of the name replaces ``.last.ckpt.partial``, the newest whole checkpoint: the swap is completed first,
    so a crash during the new save (the engine's write fails here) leaves ``last.ckpt`` whole."""
    from lightning_longshield import sharded_checkpoints

    folder = tmp_path / "ckpt"
    trainer = _sharded_fit(tmp_path, 1)
    inodes = _swap_cut_off_between_renames(trainer, folder)

    def crash(*args, **kwargs):
        raise OSError("the process died while writing shards")

    monkeypatch.setattr(sharded_checkpoints.dcp, "save", crash)
    with pytest.raises(OSError, match="died"):
        trainer.save_checkpoint(folder / "last.ckpt")
    assert (folder / "last.ckpt").stat().st_ino == inodes["partial"]
    assert is_whole_sharded_checkpoint(folder / "last.ckpt") and not (folder / ".last.ckpt.previous").exists()


def test_a_save_completes_another_name_s_swap_cut_off_an_hour_before(tmp_path):
    """A save in the folder completes a swap cut off between its renames once the new checkpoint is an hour old (a
    younger one may be another run's save under way), before old temporaries are removed."""
    folder = tmp_path / "ckpt"
    trainer = _sharded_fit(tmp_path, 1)
    inodes = _swap_cut_off_between_renames(trainer, folder)
    trainer.save_checkpoint(folder / "step1.ckpt")
    assert not (folder / "last.ckpt").exists() and (folder / ".last.ckpt.partial").is_dir()
    hours_ago = time.time() - 7200
    for path in [folder / ".last.ckpt.partial", *(folder / ".last.ckpt.partial").iterdir()]:
        os.utime(path, (hours_ago, hours_ago))
    trainer.save_checkpoint(folder / "step1.ckpt")
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step1.ckpt"]
    assert (folder / "last.ckpt").stat().st_ino == inodes["partial"]
    assert is_whole_sharded_checkpoint(folder / "last.ckpt")


@pytest.mark.parametrize("damage", ["truncated shard", "flipped shard", "no engine metadata", "no manifest"])
def test_a_damaged_sharded_checkpoint_is_refused_with_the_last_good_one(tmp_path, damage):
    """A shard cut short or altered, the engine's metadata missing, or a save that never wrote its manifest: refused
    by name, nothing loaded, the newest whole checkpoint named."""
    trainer = _sharded_fit(tmp_path, 1)
    good, bad = tmp_path / "ckpt" / "step1.ckpt", tmp_path / "ckpt" / "step2.ckpt"
    trainer.save_checkpoint(good)
    trainer.save_checkpoint(bad)
    shard = next(bad.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    if damage == "truncated shard":
        shard.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "flipped shard":
        data[len(data) // 3] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "no engine metadata":
        (bad / ".metadata").unlink()
    else:
        (bad / "manifest.json").unlink()
    with pytest.raises(CorruptCheckpointError, match=rf"{bad} is incomplete or damaged .* beside it is {good}"):
        _sharded_fit(tmp_path, 2, ckpt_path=bad)
    with pytest.raises(CorruptCheckpointError):
        read_model_state(bad)
