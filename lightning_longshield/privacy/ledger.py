"""The privacy ledger: an append-only file that records every DP step before its release, so that no crash makes
a resumed run forget steps it ran.

A checkpoint holds the accountant's history up to the step it was taken at. A run that crashes at step 120 and
resumes from its checkpoint of step 100 has run steps 101-120 too, and whatever they released (metrics, exports, a
checkpoint someone copied) may have been seen. Each step therefore appends one line to the ledger and fsyncs it
before its noisy gradient is formed; on resume, every step the ledger holds for the run counts, not only the
checkpoint's.

One line per step, JSON: ``{"run": run id, "index": the step's position in the run's accounting, "noise_multiplier",
"sample_rate"}``. Nothing secret (no seed, no sample, no norm). A line torn by a crash during its write belongs to a
step that never released and is skipped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional, Union

LEDGER_FILE = "privacy_ledger.jsonl"


@dataclass(frozen=True)
class LedgerEntry:
    """One DP step that ran: its index in the run's accounting and its mechanism."""

    index: int
    noise_multiplier: float
    sample_rate: float


class PrivacyLedger:
    """Appends this run's steps to ``path`` (created with its folder), each line fsynced before `record` returns."""

    def __init__(self, path: Union[str, os.PathLike], run_id: str) -> None:
        self.path = Path(path).absolute()
        self.run_id = run_id
        self._file: Optional[IO[str]] = None
        self._open()  # exists from now on: a resumed run that finds no ledger knows it was lost

    def record(self, index: int, noise_multiplier: float, sample_rate: float) -> None:
        """Durably note that step ``index`` is about to release (returns once the line is on disk)."""
        file = self._open()
        line = {"run": self.run_id, "index": index, "noise_multiplier": noise_multiplier, "sample_rate": sample_rate}
        file.write(json.dumps(line) + "\n")
        file.flush()
        os.fsync(file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _open(self) -> IO[str]:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            created = not self.path.exists()
            self._file = open(self.path, "a+", encoding="utf-8")
            if not created and _ends_torn(self.path):
                self._file.write("\n")  # end the torn line of a crashed write, so the next line stays whole
            if created:
                fsync_directory(self.path.parent)
        return self._file


def read_ledger(path: Union[str, os.PathLike], run_id: str) -> list[LedgerEntry]:
    """The steps ``path`` records for ``run_id``, in file order; torn or foreign lines are skipped. Raises
    `FileNotFoundError` when there is no ledger."""
    entries = []
    with open(path, encoding="utf-8") as file:
        for line in file:
            try:
                record = json.loads(line)
                if record.get("run") == run_id:
                    entries.append(LedgerEntry(int(record["index"]), float(record["noise_multiplier"]),
                                               float(record["sample_rate"])))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a line torn by a crash: its step never released
    return entries


def steps_after(entries: list[LedgerEntry], checkpoint_steps: int) -> list[LedgerEntry]:
    """The recorded steps a checkpoint of ``checkpoint_steps`` steps does not hold, each counted once per line (a
    step index recorded twice ran twice), in index order."""
    return sorted((entry for entry in entries if entry.index >= checkpoint_steps), key=lambda entry: entry.index)


def _ends_torn(path: Path) -> bool:
    with open(path, "rb") as file:
        file.seek(0, os.SEEK_END)
        if file.tell() == 0:
            return False
        file.seek(-1, os.SEEK_END)
        return file.read(1) != b"\n"


def fsync_directory(directory: Path) -> None:
    """Make a new file's name durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
