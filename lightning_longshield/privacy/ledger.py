"""The privacy ledger: an append-only file that records every DP step before its release, so that no crash makes
a resumed run forget steps it ran.

A checkpoint holds the accountant's history up to the step it was taken at. A run that crashes at step 120 and
resumes from its checkpoint of step 100 has run steps 101-120 too, and whatever they released (metrics, exports, a
checkpoint someone copied) may have been seen. Each step therefore appends one line to the ledger and fsyncs it
before its noisy gradient is formed; on resume, every step the ledger holds for the run counts, not only the
checkpoint's.

One line per step, JSON: ``{"run": run id, "index": the step's position in the run's accounting, "noise_multiplier",
"sample_rate", "poisson": whether its batch was Poisson-sampled, "reproducible": whether its randomness came from a
noise_seed}``; where a run first opens the file, ``{"run": run id, "opened_at": index}``, the step index from which
it records (a file replaced by another run's then lacks it); and where a run moves on to another ledger
(``privacy_ledger`` given at a resume), ``{"run": run id, "moved_to": path, "at": index}`` in the one it leaves and
``{"run": run id, "moved_from": path, "at": index}`` in the new one, so that a resume from a checkpoint that names
either file reads the other too. Nothing secret (no seed, no sample, no norm). A line torn by a crash during its
write belongs to a step that never released and is skipped, also where another run sharing the file appended its
next line to the fragment. Any other line that does not read as a step is damaged: `read_ledger` counts it, and a
resume counts it as a step of the run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Set as AbstractSet
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
    poisson: bool = True
    reproducible: bool = False


class PrivacyLedger:
    """Appends this run's steps to ``path`` (created with its folder), each line fsynced before `record` returns."""

    def __init__(self, path: Union[str, os.PathLike], run_id: str, opened_at: Optional[int] = None) -> None:
        """``opened_at``: the run starts recording in this file at that step index (fsynced as its first line)."""
        self.path = Path(path).absolute()
        self.run_id = run_id
        self._file: Optional[IO[str]] = None
        self._open()  # exists from now on: a resumed run that finds no ledger knows it was lost
        if opened_at is not None:
            self._write({"run": run_id, "opened_at": opened_at})

    def record_move(self, path: Union[str, os.PathLike], index: int, direction: str = "moved_to") -> None:
        """Durably note that this run records its steps from ``index`` on in the ledger at ``path`` (``"moved_to"``,
        in the ledger it leaves), or recorded them before ``index`` there (``"moved_from"``, in the new one)."""
        self._write({"run": self.run_id, direction: os.fspath(Path(path).absolute()), "at": index})

    def record(self, index: int, noise_multiplier: float, sample_rate: float, poisson: bool = True,
               reproducible: bool = False) -> None:
        """Durably note that step ``index`` is about to release (returns once the line is on disk)."""
        self._write({"run": self.run_id, "index": index, "noise_multiplier": noise_multiplier,
                     "sample_rate": sample_rate, "poisson": poisson, "reproducible": reproducible})

    def _write(self, line: dict[str, object]) -> None:
        file = self._open()
        file.write(json.dumps(line) + "\n")
        file.flush()
        os.fsync(file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __getstate__(self) -> dict[str, object]:
        # Without its open file (a spawn launcher pickles the strategy): a copy reopens the ledger at its next line.
        return {**self.__dict__, "_file": None}

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


@dataclass(frozen=True)
class LedgerReading:
    """What a ledger holds for one run: its steps in file order, how many lines of any run are damaged, the step
    indices at which the run opened the file, and the ledgers it moved on to or from."""

    entries: list[LedgerEntry]
    damaged: int
    opened_at: frozenset[int] = frozenset()
    linked: tuple[str, ...] = ()  # the ledgers the run moved on to or from


def read_ledger(path: Union[str, os.PathLike], run_id: str) -> LedgerReading:
    """The steps ``path`` records for ``run_id``; torn and other runs' lines are skipped, damaged ones counted.
    Raises `FileNotFoundError` when there is no ledger."""
    entries, damaged, opened_at, linked = [], 0, set(), []
    with open(path, encoding="utf-8", errors="replace") as file:
        for line in file:
            record = _parse(line.rstrip("\n"))
            if record is _TORN:
                continue  # a write cut by a crash: its step never released
            if record is None:
                damaged += 1
            elif record[0] == run_id and isinstance(record[1], int):
                opened_at.add(record[1])
            elif record[0] == run_id and isinstance(record[1], str):
                linked.append(record[1])
            elif record[0] == run_id:
                entries.append(record[1])
    return LedgerReading(entries, damaged, frozenset(opened_at), tuple(linked))


def read_ledgers(paths: list[Union[str, os.PathLike]], run_id: str) -> tuple[LedgerReading, list[str]]:
    """`read_ledger` of every one of ``paths`` that exists and of every ledger the run moved on to or from, from them
    on, each file once, merged; and the files read. Raises `FileNotFoundError` when none of ``paths`` exists."""
    pending = [os.fspath(path) for path in paths]
    read: dict[str, LedgerReading] = {}
    while pending:
        path = pending.pop(0)
        key = os.path.realpath(path)
        if key in read or not os.path.exists(path):
            continue
        read[key] = reading = read_ledger(path, run_id)
        pending += reading.linked
    if not read:
        raise FileNotFoundError(os.fspath(paths[0]))
    readings = list(read.values())
    merged = LedgerReading([entry for reading in readings for entry in reading.entries],
                           sum(reading.damaged for reading in readings),
                           frozenset().union(*(reading.opened_at for reading in readings)))
    return merged, list(read)


_TORN = object()


def _parse(line: str) -> object:
    """``(run id, entry)``; `_TORN` for an empty line or the fragment of a write cut by a crash (every whole line
    ends with ``}``); ``None`` for a damaged line. A fragment followed by another run's whole line, appended after the
    crash, reads as that line."""
    if not line.endswith("}"):
        return _TORN
    record = _record(line)
    start = line.rfind('{"run": ')
    if record is None and start > 0:
        record = _record(line[start:])
    return record


def _record(text: str) -> Optional[tuple[str, Union[LedgerEntry, int, str]]]:
    """``(run id, entry)`` of a step's line, ``(run id, index)`` of a line opening the file, ``(run id, path)`` of a
    line moving on to another; None if damaged."""
    try:
        fields = json.loads(text)
        if "opened_at" in fields and "index" not in fields:
            return str(fields["run"]), int(fields["opened_at"])
        for link in ("moved_to", "moved_from"):
            if link in fields and "index" not in fields:
                return str(fields["run"]), str(fields[link])
        entry = LedgerEntry(int(fields["index"]), float(fields["noise_multiplier"]), float(fields["sample_rate"]),
                            bool(fields.get("poisson", True)), bool(fields.get("reproducible", False)))
        return str(fields["run"]), entry
    except (ValueError, KeyError, TypeError):
        return None


def steps_after(entries: list[LedgerEntry], checkpoint_steps: int) -> list[LedgerEntry]:
    """The recorded steps a checkpoint of ``checkpoint_steps`` steps does not hold, each counted once per line (a
    step index recorded twice ran twice), in index order."""
    return sorted((entry for entry in entries if entry.index >= checkpoint_steps), key=lambda entry: entry.index)


def steps_beside(entries: list[LedgerEntry], since: Optional[int], checkpoint_steps: int,
                 without_lines: AbstractSet[int] = frozenset()) -> list[LedgerEntry]:
    """Lines of indices a checkpoint holds (``since``, where its run opened this ledger, up to ``checkpoint_steps``)
    beyond one each: steps that another attempt ran from an earlier checkpoint beside the checkpoint's own (two jobs
    resumed from one checkpoint at once number their steps alike), which the checkpoint does not hold. Of each index's
    lines, the one with the most noise and the lowest sampling rate is taken to be the checkpoint's own (the others,
    counted, then cost at least as much); at the indices ``without_lines`` (where the checkpoint's accountant holds a
    step that no line of its own names: a stand-in for a lost line, a step counted beside an earlier checkpoint's)
    every line is another attempt's."""
    if since is None:
        return []
    by_index: dict[int, list[LedgerEntry]] = {}
    for entry in entries:
        if since <= entry.index < checkpoint_steps:
            by_index.setdefault(entry.index, []).append(entry)
    extra = []
    for index, lines in by_index.items():
        lines.sort(key=cost_order, reverse=True)  # the least costly first: taken as the checkpoint's own
        extra += lines if index in without_lines else lines[1:]
    return sorted(extra, key=lambda entry: entry.index)


def cost_order(entry: LedgerEntry) -> tuple[float, float]:
    """Sort key of steps, the most costly first: the least noise, then the highest sampling rate."""
    return entry.noise_multiplier, -entry.sample_rate


def missing_indices(entries: list[LedgerEntry], checkpoint_steps: int) -> int:
    """How many indices between a checkpoint's and the last recorded one have no line: a run's indices from any of
    its checkpoints on are consecutive (a resume counts the rolled-back steps, and the next step takes the next
    index), so each gap is a lost line."""
    indices = {entry.index for entry in entries if entry.index >= checkpoint_steps}
    return max(indices) + 1 - checkpoint_steps - len(indices) if indices else 0


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
