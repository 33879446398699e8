"""`DurableCheckpointIO`: a checkpoint file appears complete or not at all, and a damaged one is refused by name."""

from __future__ import annotations

import os
import shutil
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Optional

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH

from lightning_longshield.privacy.ledger import fsync_directory


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file that cannot be read whole (truncated or damaged)."""


class DurableCheckpointIO(TorchCheckpointIO):
    """Local checkpoints are written to a temporary name in their folder, fsynced, then renamed over the target (and
    the folder fsynced), so ``last.ckpt`` or any other name never refers to a partly written file, whatever kills the
    process. Remote paths (``s3://``...) go through Lightning's own writer.

    Loading a file that is not a whole checkpoint (cut short by a crash, damaged on disk) raises
    `CorruptCheckpointError` naming it and the newest whole checkpoint beside it; nothing is loaded in part.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        if not is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options; pass a CheckpointIO of your own.")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(target.parent)
        # Into an open file (a second fsync of it in `replace_durably` finds nothing left to write).
        replace_durably(target, lambda temporary: write_durably(temporary, lambda file: torch.save(checkpoint, file)))

    def load_checkpoint(self, path: _PATH, map_location: Optional[Callable] = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if not (is_local(path) and Path(path).is_file()):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        if not is_whole_checkpoint(path):
            raise corrupt_checkpoint_error(Path(path), "is truncated or damaged")
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except RuntimeError as error:  # damage the archive's checksums do not cover, found by torch's zip reader
            if TORCH_READER_ERROR not in str(error):
                raise
            reason = str(error).split(". ", 1)[0]  # the rest is torch's advice on where the damage may come from
            raise corrupt_checkpoint_error(Path(path), f"is damaged ({reason})") from error


#: How torch's zip reader (``torch.load``) begins the errors it raises on an archive it cannot read.
TORCH_READER_ERROR = "PytorchStreamReader failed"
#: The MS-DOS directory bit of a zip entry's external attributes: torch's reader (miniz) reads such an entry as empty,
#: and ``torch.save`` never sets it.
_ZIP_DIRECTORY_ATTRIBUTE = 0x10


def corrupt_checkpoint_error(path: Path, problem: str) -> CorruptCheckpointError:
    """The error for the checkpoint ``path`` that ``problem`` (e.g. "is truncated or damaged"), naming the newest
    whole checkpoint beside it to resume from, or what to do when there is none."""
    good = newest_whole_checkpoint(path.parent, exclude=path)
    fix = (f"the newest whole checkpoint beside it is {good}: resume from it (fit(ckpt_path=...))" if good
           else "no whole checkpoint is beside it: pass ckpt_path a whole checkpoint from elsewhere, or start afresh"
                " without ckpt_path")
    return CorruptCheckpointError(f"Checkpoint {path} {problem} and was not loaded; {fix}.")


#: A checkpoint's temporary (``.<name>[.<pid>].partial``, file or folder) untouched for this long was left by a save
#: that was killed; a save under way, this run's or another's sharing the folder, writes to its own all along.
STALE_PARTIAL_SECONDS = 3600.0


def remove_stale_partials(folder: Path) -> None:
    """Remove the temporaries of killed saves in ``folder``: those whose newest write is `STALE_PARTIAL_SECONDS`
    old, and any that is a symbolic link, unlinked, never followed (no save writes one; a sharded save swapping out a
    linked ``last.ckpt`` once left one)."""
    for stale in folder.glob(".*.partial"):
        try:
            if stale.is_symlink():
                stale.unlink()
                continue
            if untouched_seconds(stale) < STALE_PARTIAL_SECONDS:
                continue
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()
        except OSError:  # gone meanwhile, or not ours to remove
            continue


def untouched_seconds(path: Path) -> float:
    """Seconds since the newest write to the file ``path``, or to the folder ``path`` and its files."""
    entries = [path, *path.iterdir()] if path.is_dir() else [path]
    return time.time() - max(entry.stat().st_mtime for entry in entries)


def replace_durably(target: Path, write: Callable[[Path], object]) -> None:
    """Write ``target`` whole or not at all: ``write(temporary)`` to a temporary name beside it, fsync it, rename it
    over ``target`` and fsync the folder. The temporary is removed if anything fails, so no reader ever finds a
    partly written ``target``, whatever kills the process."""
    temporary = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        write(temporary)
        with open(temporary, "r+b") as file:
            os.fsync(file.fileno())
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_directory(target.parent)


def write_durably(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write ``path`` with ``write(file)`` and fsync it before returning."""
    with open(path, "wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())


def is_whole_checkpoint(path: _PATH) -> bool:
    """Whether ``path`` is a complete ``torch.save`` archive whose every record matches its checksum and none is
    marked as a folder. Whatever a damaged archive makes the zip reader raise (``BadZipFile``, ``EOFError``, a
    ``UnicodeDecodeError`` from a mangled name, a ``NotImplementedError`` from a mangled method...) means not whole."""
    try:
        with zipfile.ZipFile(path) as archive:
            return (archive.testzip() is None
                    and not any(info.external_attr & _ZIP_DIRECTORY_ATTRIBUTE for info in archive.infolist()))
    except Exception:  # any failure to read it is damage
        return False


def is_whole_file_or_folder(path: Path) -> bool:
    """Whether ``path`` is a whole checkpoint of either format: a sharded checkpoint's folder, or one file."""
    from lightning_longshield.sharded_checkpoints import is_whole_sharded_checkpoint

    return is_whole_sharded_checkpoint(path) if path.is_dir() else is_whole_checkpoint(path)


def newest_whole_checkpoint(directory: Path, exclude: Optional[Path] = None) -> Optional[Path]:
    """The most recently written whole ``*.ckpt`` in ``directory`` (other than ``exclude``): a file, or a sharded
    checkpoint's folder."""
    candidates = sorted(_written_checkpoints(directory, exclude), key=lambda found: found[0], reverse=True)
    return next((p for _, p in candidates if is_whole_file_or_folder(p)), None)


def _written_checkpoints(directory: Path, exclude: Optional[Path] = None) -> list[tuple[float, Path]]:
    """``(modification time, path)`` of every ``*.ckpt`` in ``directory`` but ``exclude``; a link to nothing (a
    ``best.ckpt`` whose target was removed) is skipped, not an error that would hide the one being reported."""
    found = []
    for path in directory.glob("*.ckpt"):
        try:
            if path != exclude:
                found.append((path.stat().st_mtime, path))
        except OSError:
            continue
    return found


def newer_checkpoint_beside(path: Path) -> Optional[Path]:
    """The newest whole checkpoint in ``path``'s folder if it was written after ``path`` itself (a file or a sharded
    folder; links followed), else None. Whole means read in full: only looked for when some ``*.ckpt`` is newer."""
    written, resolved = path.stat().st_mtime, path.resolve()
    if not any(p.resolve() != resolved and time > written for time, p in _written_checkpoints(path.parent)):
        return None
    found = newest_whole_checkpoint(path.parent, exclude=path)
    if found is None or found.resolve() == resolved or found.stat().st_mtime <= written:
        return None
    return found


def is_local(path: _PATH) -> bool:
    """Whether ``path`` names a local file or folder, not a remote URL (``s3://``...)."""
    return "://" not in os.fspath(path)
