"""Byte-level text data: a tokenizer, fixed-length packed windows, and the Python standard library as a corpus."""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

SKIPPED_DIRECTORIES = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


class ByteTokenizer:
    """UTF-8 bytes as tokens: ``vocab_size`` is 256 and every string round-trips exactly."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: Iterable[int]) -> str:
        """Bytes back to text; an invalid UTF-8 sequence (e.g. a cut multi-byte character) becomes U+FFFD."""
        return bytes(tokens).decode("utf-8", errors="replace")


class PackedTokenDataset(Dataset):
    """Disjoint windows of ``seq_len + 1`` tokens over a 1-D token tensor, as causal-LM samples.

    Sample ``i`` is ``{"input_ids": w[:-1], "labels": w[1:]}`` for the window
    ``w = tokens[i * (seq_len + 1) : (i + 1) * (seq_len + 1)]``.
    Windows do not overlap, so every token belongs to exactly one sample (the privacy unit). A trailing remainder
    shorter than a window is dropped.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}.")
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex:
            raise ValueError(f"tokens must be a 1-D integer tensor, got a {tokens.dim()}-D {tokens.dtype} tensor.")
        window = seq_len + 1
        if tokens.numel() < window:
            raise ValueError(  # the token count is not quoted: a value of the (private) corpus
                f"The tokens are fewer than one window of seq_len + 1 = {window}: use more text or a shorter seq_len."
            )
        self.seq_len = seq_len
        self.windows = tokens[: tokens.numel() // window * window].long().view(-1, window)

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.windows[index]
        return {"input_ids": window[:-1], "labels": window[1:]}


def python_stdlib_sources() -> list[Path]:
    """The standard library's own ``.py`` files in sorted order, without installed packages and test suites."""
    paths: list[Path] = []
    for directory, subdirectories, files in os.walk(_stdlib_root()):
        subdirectories[:] = [name for name in subdirectories if name not in SKIPPED_DIRECTORIES]
        paths.extend(Path(directory, name) for name in files if name.endswith(".py"))
    return sorted(paths)


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_stdlib_corpus(max_files: Optional[int] = None, max_bytes: Optional[int] = None) -> str:
    """Concatenated source of the Python standard library (see `python_stdlib_sources`).

    Each file is preceded by a ``# file: <relative path>`` line. Unreadable or non-UTF-8 files are skipped.
    ``max_bytes`` caps the UTF-8 size of the result (the last file is cut; a cut character is dropped).
    """
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}.")
    root = _stdlib_root()
    documents: list[str] = []
    size = 0
    for path in python_stdlib_sources()[:max_files]:
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        documents.append(f"# file: {path.relative_to(root).as_posix()}\n{source}\n")
        size += len(documents[-1].encode("utf-8"))
        if max_bytes is not None and size >= max_bytes:
            break
    if not documents:
        raise FileNotFoundError(f"No readable standard-library .py files under {root}.")
    text = "".join(documents)
    if max_bytes is None:
        return text
    return text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")


class StdlibTextDataModule(L.LightningDataModule):
    """Byte-level causal-LM data from the Python standard library with a held-out validation split.

    The corpus (at most ``max_bytes``) is tokenized to bytes and cut into disjoint windows of ``seq_len + 1``
    tokens; the last ``val_fraction`` of the windows (at least one) is the validation set, so training and
    validation never share a token. ``batch_size`` is the training DataLoader's batch size, which
    `LongShieldStrategy` uses as the expected logical (privacy) batch.
    """

    def __init__(
        self,
        seq_len: int = 1024,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        max_bytes: Optional[int] = 4_000_000,
        max_files: Optional[int] = None,
        val_batch_size: Optional[int] = None,
    ) -> None:
        super().__init__()
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.tokenizer = ByteTokenizer()
        self.train_dataset: Optional[PackedTokenDataset] = None
        self.val_dataset: Optional[PackedTokenDataset] = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_dataset is not None:
            return
        data = python_stdlib_corpus(self.max_files, self.max_bytes).encode("utf-8")
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        window = self.seq_len + 1
        windows = tokens.numel() // window
        if windows < 2:
            raise ValueError(
                f"The corpus ({tokens.numel()} bytes) holds {windows} window(s) of seq_len + 1 = {window} tokens; a"
                " training and a validation window need at least 2. Raise max_bytes / max_files or lower seq_len."
            )
        val_windows = max(1, round(windows * self.val_fraction))
        if val_windows >= windows:
            raise ValueError(
                f"val_fraction={self.val_fraction} gives all {windows} windows of seq_len + 1 = {window} tokens to"
                " validation, none to training: lower val_fraction, or raise max_bytes / max_files."
            )
        cut = (windows - val_windows) * window
        self.train_dataset = PackedTokenDataset(tokens[:cut], self.seq_len)
        self.val_dataset = PackedTokenDataset(tokens[cut : windows * window], self.seq_len)

    def describe_privacy_unit(self) -> str:
        """What one sample is, in words: the unit the privacy guarantee protects."""
        return f"one window of {self.seq_len + 1} bytes of standard-library source"

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._require(self.train_dataset), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._require(self.val_dataset), batch_size=self.val_batch_size)

    @staticmethod
    def _require(dataset: Optional[PackedTokenDataset]) -> PackedTokenDataset:
        if dataset is None:
            raise RuntimeError("Call setup() before asking for a DataLoader.")
        return dataset
