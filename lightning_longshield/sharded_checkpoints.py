"""Sharded checkpoints on PyTorch's distributed checkpoint engine (`torch.distributed.checkpoint`, DCP).

Every rank writes its own shards of the model and optimizer state, in parallel, holding only them; the engine records
where each chunk of each tensor lives, so a checkpoint loads at any (data-parallel, context-parallel) layout, resharded
as it is read, and into one process without a process group (`read_model_state`, for a Hugging Face export).

A checkpoint is a folder: the engine's shard files and ``.metadata``, Lightning's remaining state in ``meta.pt`` (the
step, callbacks, the strategy's privacy state) and ``manifest.json`` (size and CRC-32 of every other file, each
computed by the rank that wrote it). It is written under a temporary name, every file fsynced, and renamed into place
only once the manifest is durable, so the name never refers to a partial checkpoint; loading checks the manifest first
and refuses a missing or damaged file by name (`CorruptCheckpointError`), loading nothing.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import shutil
import sys
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_longshield.dist_compat import all_gathered, world_size
from lightning_longshield.durable_checkpoints import (
    STALE_PARTIAL_SECONDS,
    CorruptCheckpointError,
    corrupt_checkpoint_error,
    remove_stale_partials,
    untouched_seconds,
    write_durably,
)
from lightning_longshield.privacy.ledger import fsync_directory

METADATA_FILE = "meta.pt"
MANIFEST_FILE = "manifest.json"
MODEL_KEY = "model"
_CRC_CHUNK = 2**24


def is_sharded_checkpoint(path: os.PathLike | str) -> bool:
    """Whether ``path`` is a folder written by `save_sharded` (whole or not)."""
    return Path(path).is_dir()


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


@dataclass
class ShardedSave:
    """One sharded save: its shards written, or being written in the background (``pending``); `commit` (a
    collective) adds Lightning's state (``metadata``, serialised when the save began: its objects live on, and a
    callback's, such as ModelCheckpoint's best checkpoints, would be written as they are at the commit) and the
    manifest, and renames the folder into place."""

    temporary: Path
    final: Path
    metadata: bytes
    rank: int
    pending: Optional[Future] = None

    def written(self) -> bool:
        """Whether this rank's shards are on disk (always, for a synchronous save)."""
        return self.pending is None or self.pending.done()

    def commit(self, barrier: Callable[[], None]) -> None:
        if self.pending is not None:
            self.pending.result()  # waits for this rank's writes; raises if they failed
            self.pending = None
        rank, temporary = self.rank, self.temporary
        if rank == 0:
            write_durably(temporary / METADATA_FILE, lambda file: file.write(self.metadata))
        barrier()
        files = _checksums(temporary, own=lambda name: name.startswith(f"__{rank}_") or (rank == 0 and not
                                                                                             name.startswith("__")))
        gathered = all_gathered(files)  # a collective: every rank
        if rank == 0:
            manifest = {name: entry for part in gathered for name, entry in part.items()}
            write_durably(temporary / MANIFEST_FILE, lambda file: file.write(json.dumps(manifest, indent=1).encode()))
            fsync_directory(temporary)
            replace_folder(temporary, self.final)
        barrier()


def save_sharded(
    path: os.PathLike | str,
    model: nn.Module,
    optimizers: list[Optimizer],
    metadata: dict[str, Any],
    rank: int,
    barrier: Callable[[], None],
    background_group: Optional[dist.ProcessGroup] = None,
) -> ShardedSave:
    """Every rank: write its shards of ``model`` and ``optimizers`` (state keyed by parameter name) and, from rank 0,
    ``metadata``, into the folder ``path``, which appears whole or not at all. A collective.

    With ``background_group`` (a process group of its own, for the engine's collectives off the main thread) the
    shards are copied in memory and written by a background thread while training goes on: the returned save is
    committed later (`ShardedSave.commit`); without, it is committed before this returns."""
    final = Path(path)
    temporary = final.with_name(f".{final.name}.partial")
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        restore_interrupted_swap(final)  # at once: this save replaces its temporary, maybe the newest checkpoint
        for hidden in [*final.parent.glob(".*.previous"), *final.parent.glob(".*.partial")]:
            name = hidden.name[1:].rsplit(".", 1)[0]
            restore_interrupted_swap(hidden.with_name(name), STALE_PARTIAL_SECONDS)
        remove_stale_partials(final.parent)
        _remove(temporary)  # a killed save of this name
        temporary.mkdir()
    barrier()
    options = StateDictOptions(cpu_offload=False)
    state: dict[str, Any] = {MODEL_KEY: get_model_state_dict(model, options=options)}
    for index, optimizer in enumerate(optimizers):
        state[optimizer_key(index)] = get_optimizer_state_dict(model, optimizer, options=options)
    writer = dcp.FileSystemWriter(temporary, sync_files=True)
    serialised = io.BytesIO()
    if rank == 0:
        torch.save(metadata, serialised)
    save = ShardedSave(temporary, final, serialised.getvalue(), rank)
    if background_group is None:
        dcp.save(state, storage_writer=writer)
        save.commit(barrier)
        return save
    response = dcp.async_save(state, storage_writer=writer, process_group=background_group)
    save.pending = getattr(response, "upload_completion", response)
    return save


def load_sharded(path: os.PathLike | str, model: nn.Module, optimizers: list[Optimizer],
                 strict: bool = True) -> dict[str, Any]:
    """Every rank: load ``model`` and ``optimizers`` (whatever their layout now) from the sharded checkpoint ``path``
    after checking it whole (the ranks share the reading of its files); returns its remaining Lightning state. A
    collective."""
    folder = Path(path)
    world = world_size()
    share = _manifest_problem(folder, dist.get_rank() if world > 1 else 0, world)  # each rank checks its share
    _refuse_if_damaged(folder, next((problem for problem in all_gathered(share) if problem), None))
    state: dict[str, Any] = {MODEL_KEY: get_model_state_dict(model)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(folder))
    set_model_state_dict(model, state[MODEL_KEY], options=StateDictOptions(strict=strict))
    for index, optimizer in enumerate(optimizers):
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        key = optimizer_key(index)
        forget_stale_gradients(optimizer)
        optimizer_state = {key: get_optimizer_state_dict(model, optimizer)}
        dcp.load(optimizer_state, storage_reader=dcp.FileSystemReader(folder))
        saved = optimizer_state[key]
        if not saved.get("state"):  # e.g. SGD without momentum: only hyper-parameters
            load_hyperparameters(optimizer, saved["param_groups"])
            continue
        set_optimizer_state_dict(model, optimizer, saved)
    return torch.load(folder / METADATA_FILE, weights_only=False)


def read_model_state(path: os.PathLike | str) -> dict[str, torch.Tensor]:
    """The whole model state of the sharded checkpoint ``path`` in this process, keyed as the LightningModule's
    parameters, without a process group and without reading the optimizer's state: for an export (e.g.
    ``module.load_state_dict(...)`` then `lightning_longshield.hf.save_pretrained`)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = Path(path)
    verify_sharded(folder)
    reader = dcp.FileSystemReader(folder)
    prefix = f"{MODEL_KEY}."
    model = {key[len(prefix):]: torch.empty(entry.size, dtype=entry.properties.dtype)
             for key, entry in reader.read_metadata().state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    dcp.load({MODEL_KEY: model}, storage_reader=reader, no_dist=True)
    return model


def verify_sharded(folder: Path) -> None:
    """Raise `CorruptCheckpointError` (naming the file and the newest whole checkpoint beside) unless every file the
    manifest lists is there with its size and CRC-32."""
    _refuse_if_damaged(folder, _manifest_problem(folder))


def _manifest_problem(folder: Path, part: int = 0, parts: int = 1) -> Optional[str]:
    """What is wrong with ``folder`` against its manifest, checking the files ``part::parts`` of it (sorted by name),
    or ``None``."""
    manifest_path = folder / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return f"its manifest {manifest_path} is missing or unreadable (the save did not finish)"
    if not {".metadata", METADATA_FILE} <= set(manifest):
        return f"its manifest {manifest_path} does not list the engine's .metadata and {METADATA_FILE}"
    for name in sorted(manifest)[part::parts]:
        size, crc = manifest[name]
        file = folder / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != size:
            return f"{file} has {file.stat().st_size} bytes, the manifest {size}"
        if _crc32(file) != crc:
            return f"{file} does not match its checksum"
    return None


def _refuse_if_damaged(folder: Path, problem: Optional[str]) -> None:
    if problem is not None:
        raise corrupt_checkpoint_error(folder, f"is incomplete or damaged ({problem})")


def is_whole_sharded_checkpoint(folder: Path) -> bool:
    try:
        verify_sharded(folder)
    except CorruptCheckpointError:
        return False
    return True


def _checksums(folder: Path, own: Callable[[str], bool]) -> dict[str, list[int]]:
    """``{name: [size, crc32]}`` of the files of ``folder`` that ``own`` selects (this rank's)."""
    return {p.name: [p.stat().st_size, _crc32(p)] for p in sorted(folder.iterdir())
            if p.is_file() and p.name != MANIFEST_FILE and own(p.name)}


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as file:
        while chunk := file.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def replace_folder(temporary: Path, final: Path) -> None:
    """Rename ``temporary`` (a checkpoint's folder, or a one-file checkpoint) to ``final`` (replacing a previous
    checkpoint of that name) and make it durable.

    A previous checkpoint is swapped with the new one in one atomic step where the system can (Linux's ``renameat2``
    with ``RENAME_EXCHANGE``), so ``final`` names a whole checkpoint at every instant; elsewhere a folder is renamed
    aside first, and a crash between the two renames leaves both whole under hidden names. A symbolic link of that name
    (``ModelCheckpoint(save_last="link")``) is replaced itself, never followed: what it points to stays untouched."""
    if os.path.lexists(final) and _exchange(temporary, final):  # ``temporary`` now holds the previous one
        fsync_directory(final.parent)
        _remove(temporary)
        return
    previous = final.with_name(f".{final.name}.previous")
    _remove(previous)
    if final.is_dir() and not final.is_symlink():
        final.rename(previous)
    elif os.path.lexists(final):  # a file, or a link (to anything, or dangling)
        final.unlink()
    temporary.rename(final)
    fsync_directory(final.parent)
    _remove(previous)


def restore_interrupted_swap(final: Path, min_age_s: float = 0.0) -> Optional[Path]:
    """Give the name ``final`` back its checkpoint after a crash between `replace_folder`'s renames (where folders
    cannot be swapped atomically), which left the previous checkpoint, if any, at ``.<name>.previous`` and the new one
    at ``.<name>.partial``, whole (its manifest is written before the renames): the new one if whole, else the
    previous one, and the other removed, as the swap would have. Nothing is done where ``final`` exists, or where the
    new one was written within ``min_age_s`` seconds (a save under way, of another run sharing the folder). Returns
    the folder renamed to ``final``, or ``None``."""
    previous = final.with_name(f".{final.name}.previous")
    partial = final.with_name(f".{final.name}.partial")
    if os.path.lexists(final):
        return None
    if partial.is_dir() and min_age_s > 0 and untouched_seconds(partial) < min_age_s:
        return None
    for whole, other in ((partial, previous), (previous, partial)):
        if whole.is_dir() and not whole.is_symlink() and _manifest_problem(whole) is None:
            whole.rename(final)
            fsync_directory(final.parent)
            _remove(other)
            return whole
    return None


def _remove(path: Path) -> None:
    """Remove the folder, file or symbolic link ``path`` if there, as far as possible; a link is unlinked, never
    followed."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        path.unlink(missing_ok=True)
    except OSError:  # not ours to remove: left, as ``rmtree(ignore_errors=True)`` leaves a folder
        pass


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(first: Path, second: Path) -> bool:
    """Swap the two paths atomically (Linux ``renameat2(..., RENAME_EXCHANGE)``); ``False`` where the system or the
    file system cannot, and nothing was moved."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library without the call (glibc < 2.28, musl < 1.2.3)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    return renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0


def forget_stale_gradients(optimizer: Optimizer) -> None:
    """Drop an earlier fit's last gradient from the parameters of an optimizer with no state yet: torch fills a fresh
    optimizer's state (which a checkpoint's is then read into) only while no ``.grad`` is set, and otherwise loads
    nothing, silently. A resumed step forms its own gradient."""
    if optimizer.state:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None


def load_hyperparameters(optimizer: Optimizer, saved_groups: list[dict[str, Any]]) -> None:
    """Set each parameter group's hyper-parameters (learning rate, ...) from a saved optimizer state without
    per-parameter state, which torch's distributed loader cannot place (it takes the device from that state)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"The checkpoint's optimizer has {len(saved_groups)} parameter groups, this one"
                         f" {len(optimizer.param_groups)}: configure_optimizers must build the same groups.")
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update({key: value for key, value in saved.items() if key != "params"})
