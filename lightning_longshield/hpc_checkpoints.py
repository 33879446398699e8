"""The checkpoints Lightning resumes a requeued SLURM job from: ``hpc_ckpt_<n>.ckpt`` in the Trainer's
``default_root_dir``, numbered from the exact names only.

Lightning numbers them from every name in the folder that contains ``hpc_ckpt_``, digits of the whole rest of the
name run together: a save cut off under its temporary name (``.hpc_ckpt_2.ckpt.48213.partial``) reads as version
248213, and a requeued ``fit`` without ``ckpt_path`` then asks for a checkpoint that does not exist."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from lightning_longshield.durable_checkpoints import is_whole_file_or_folder

_HPC_NAME = re.compile(r"hpc_ckpt_([0-9]+)\.ckpt")


def _numbered(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    return sorted((int(match.group(1)), path) for path in directory.iterdir()
                  if (match := _HPC_NAME.fullmatch(path.name)))


def next_hpc_checkpoint(directory: Path) -> Path:
    """The name of the next HPC checkpoint in ``directory``: one past the highest exact ``hpc_ckpt_<n>.ckpt``."""
    numbered = _numbered(directory)
    return directory / f"hpc_ckpt_{numbered[-1][0] + 1 if numbered else 1}.ckpt"


def newest_whole_hpc_checkpoint(directory: Path) -> Optional[Path]:
    """The highest-numbered whole HPC checkpoint in ``directory`` (a file or a sharded checkpoint's folder)."""
    return next((path for _, path in reversed(_numbered(directory)) if is_whole_file_or_folder(path)), None)


def missing_hpc_checkpoint_replacement(path: Path) -> Optional[Path]:
    """Where ``path`` is an HPC checkpoint's name that does not exist (Lightning's pick after a cut-off save), the
    newest whole HPC checkpoint beside it; else None."""
    if path.exists() or not _HPC_NAME.fullmatch(path.name):
        return None
    return newest_whole_hpc_checkpoint(path.parent)
