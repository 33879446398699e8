"""Batch size and micro-batch splitting for arbitrary (nested) batch collections."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection


def batch_size_of(batch: Any) -> int:
    """Leading dimension of the batch's tensors (they must agree; shared ``position_ids`` count as expanded)."""
    batch = with_shared_positions_expanded(batch)
    sizes: set[int] = set()
    apply_to_collection(batch, torch.Tensor, lambda t: sizes.add(t.shape[0]) if t.dim() else None)
    if len(sizes) != 1:
        # Sizes not quoted: under Poisson sampling a batch's size is a value of the private data.
        raise ValueError("Cannot infer the batch size: the batch's tensors disagree on their leading (batch) dimension,"
                         " or none has one.")
    return sizes.pop()


def declare_logged_batch_size(trainer: Any, size: int) -> None:
    """Give Lightning the logical batch's size for what this batch logs: for a ``self.log`` without ``batch_size`` it
    would infer the size from the batch and, where the batch's fields disagree (a list of document ids has none),
    warn quoting the size it found, a value of the data under Poisson sampling."""
    trainer.fit_loop.epoch_loop._results.batch_size = size


def split_into_microbatches(batch: Any, micro_batch_size: int) -> list[Any]:
    """Consecutive slices of at most ``micro_batch_size`` samples (views, no copies)."""
    size = batch_size_of(batch)
    return [samples_of(batch, start, start + micro_batch_size) for start in range(0, size, micro_batch_size)]


#: What a per-sample list or tuple of a collated batch holds (one value per sample).
_SCALARS = (str, bytes, int, float, bool, type(None))


def samples_of(batch: Any, start: int, stop: int) -> Any:
    """Samples ``start`` to ``stop`` of a collated batch: the rows of every tensor (0-d ones kept) and of every list or
    tuple of B plain values (strings, numbers, None: what ``default_collate`` makes of a per-sample string, or of
    each position of a per-sample sequence of strings, or a collate's per-sample weights) or of B dicts of plain
    values (a collate's per-sample metadata; ``default_collate``'s dicts hold tensors or lists), through nested
    collections; other values are kept. A micro-batch never sees another's per-sample values, which would make a
    sample's gradient depend on other records. Shared ``position_ids`` are expanded to (B, T) first."""
    batch = with_shared_positions_expanded(batch)
    size = batch_size_of(batch)

    def take(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value[start:stop] if value.dim() else value
        if len(value) == size and not hasattr(value, "_fields") and all(_per_sample_item(i) for i in value):
            return type(value)(value[start:stop])
        items = [apply_to_collection(item, (torch.Tensor, list, tuple), take) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a namedtuple's fields

    return apply_to_collection(batch, (torch.Tensor, list, tuple), take)


def _per_sample_item(item: Any) -> bool:
    """Whether ``item`` of a list of B is one sample's: a plain value, or a dict of plain values."""
    if isinstance(item, Mapping):
        return all(isinstance(value, _SCALARS) for value in item.values())
    return isinstance(item, _SCALARS)


def with_shared_positions_expanded(batch: Any) -> Any:
    """``batch`` with its ``position_ids`` of shape (T,) or (1, T), shared by the samples, expanded (a view) to the
    (B, T) of its ``input_ids`` (or ``labels``), so that they are split into samples as those are; a batch without
    shared ``position_ids`` is returned as it is. A (T,) one is shared even where B equals T."""
    if not isinstance(batch, Mapping):
        return batch
    positions = batch.get("position_ids")
    reference = batch.get("input_ids", batch.get("labels"))
    if not (isinstance(positions, torch.Tensor) and isinstance(reference, torch.Tensor) and reference.dim() >= 2):
        return batch
    shared = positions.dim() == 1 or (positions.dim() == 2 and positions.shape[0] == 1)
    if not shared or positions.shape[-1] != reference.shape[1]:
        return batch
    expanded = positions.reshape(1, -1).expand(reference.shape[0], -1)
    return apply_to_collection(batch, torch.Tensor, lambda t: expanded if t is positions else t)
