"""An evaluation set split over data-parallel groups in equal parts, its padding marked so that it counts nothing.

Every group runs the same number of evaluation batches (their collectives, and the epoch's metric sync, pair up), so
where the set does not divide evenly torch's `DistributedSampler` pads the last round with records from the start:
``D - N mod D`` records evaluated twice. Here those repeats come from `PaddingMarked`, which gives a dict record its
labels all ignored (``-100``): `CausalLMModule`'s loss and perplexity then skip them. Records of another kind are
evaluated twice, as by torch's sampler, with a warning.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import Dataset, DistributedSampler

from lightning_longshield.loss import IGNORE_INDEX
from lightning_longshield.privacy.rank_zero import rank_zero_warn


class PaddingMarked(Dataset):
    """``dataset`` as it is at indices ``0 .. N-1``; index ``N + i`` is a repeat of record ``i`` that counts nothing:
    its ``labels`` (a dict record's) all `IGNORE_INDEX`. Its length is ``N``: only the sampler asks for repeats."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        size = len(self.dataset)
        if index < size:
            return self.dataset[index]
        record = self.dataset[index - size]
        labels = record.get("labels") if isinstance(record, Mapping) else None
        if not isinstance(labels, torch.Tensor):
            return record
        return {**record, "labels": torch.full_like(labels, IGNORE_INDEX)}


class MarkedPaddingSampler(DistributedSampler):
    """`DistributedSampler` (``drop_last=False``: every record evaluated) whose padding indices are offset by ``N``,
    so that `PaddingMarked` makes them count nothing; the same records in the same order otherwise."""

    def __init__(self, dataset: PaddingMarked, num_replicas: int, rank: int, shuffle: bool, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        padding = self.total_size - len(dataset)
        if padding and not _labelled_dict(dataset.dataset):
            rank_zero_warn(
                f"The evaluation set's {len(dataset)} records do not divide over {num_replicas} data-parallel groups:"
                f" {padding} of them are evaluated twice, so that every group runs as many batches. Records that"
                " are dicts with a 'labels' tensor are not (their repeats get every label ignored)."
            )

    def __iter__(self) -> Iterator[int]:
        # torch's order: this rank's k-th index is position rank + k D of the padded list, a repeat from position N on.
        size = len(self.dataset)  # type: ignore[arg-type]
        return iter(index + size if self.rank + k * self.num_replicas >= size else index
                    for k, index in enumerate(super().__iter__()))


def declare_labelled_records(trainer: pl.Trainer, batch: Any) -> None:
    """Before an evaluation step of a batch of dicts with ``labels``: what it logs without ``batch_size`` weighs as
    the records with a labelled token, as `CausalLMModule` weighs its own (Lightning would count every row, a padding
    repeat's too, and so weigh the real records of a padded batch twice). A batch of repeats alone weighs 0: a module
    of one's own should then log a finite value (a token mean over no token is NaN, which no weight cancels)."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(labels, torch.Tensor) and labels.dim() >= 1:
        trainer._results.batch_size = int((labels.reshape(labels.shape[0], -1) != IGNORE_INDEX).any(dim=1).sum())


def _labelled_dict(dataset: Any) -> bool:
    """Whether the dataset's records are dicts with a ``labels`` tensor (its first record, read to tell)."""
    if not len(dataset):
        return True
    record = dataset[0]
    return isinstance(record, Mapping) and isinstance(record.get("labels"), torch.Tensor)
