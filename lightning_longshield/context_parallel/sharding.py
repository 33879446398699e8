"""Load-balanced head-tail sequence sharding for context parallelism.

With CP size ``N`` a sequence is cut into ``2N`` equal chunks and CP rank ``r`` keeps chunks ``r`` and ``2N-1-r``,
in that order: every rank then holds one early and one late chunk, so the causal attention work is balanced.
Everything here is local (no communication); ``cp_size == 1`` leaves tensors as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch

from lightning_longshield.batching import with_shared_positions_expanded
from lightning_longshield.loss import IGNORE_INDEX


def head_tail_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The indices of the two chunks (out of ``2 * cp_size``) that CP rank ``cp_rank`` keeps."""
    _check_rank(cp_rank, cp_size)
    return cp_rank, 2 * cp_size - 1 - cp_rank


def check_shardable(seq_len: int, cp_size: int) -> None:
    """Raise a `ValueError` naming the fix when ``seq_len`` cannot be split into ``2 * cp_size`` equal chunks (without
    quoting ``seq_len``: a batch's length can be a value of the private data)."""
    if cp_size > 1 and seq_len % (2 * cp_size):
        multiple = 2 * cp_size
        raise ValueError(
            f"The sequence length T is not divisible by 2 x context_parallel_size = {multiple}: context"
            f" parallelism cuts every sequence into {multiple} equal chunks. Pad (labels -100) or truncate the"
            f" sequences to a multiple of {multiple}, or change context_parallel_size."
        )


def shard_sequence(tensor: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's shard of ``tensor`` along ``dim``: chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank``."""
    _check_rank(cp_rank, cp_size)
    if cp_size == 1:
        return tensor
    check_shardable(tensor.shape[dim], cp_size)
    chunks = tensor.chunk(2 * cp_size, dim=dim)
    head, tail = head_tail_chunks(cp_rank, cp_size)
    return torch.cat((chunks[head], chunks[tail]), dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], cp_size: int, dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence`: the full sequence from every CP rank's shard, given in rank order."""
    if len(shards) != cp_size:
        raise ValueError(f"unshard_sequence needs one shard per CP rank ({cp_size}), got {len(shards)}.")
    if cp_size == 1:
        return shards[0]
    pieces: list[Optional[torch.Tensor]] = [None] * (2 * cp_size)
    for rank, shard in enumerate(shards):
        if shard.shape[dim] % 2:
            raise ValueError(f"Shard {rank} has an odd length along dim {dim}; not a head-tail shard.")
        head, tail = head_tail_chunks(rank, cp_size)
        pieces[head], pieces[tail] = shard.chunk(2, dim=dim)
    return torch.cat(pieces, dim=dim)  # type: ignore[arg-type]


def sharded_position_ids(
    batch: int, seq_len: int, cp_rank: int, cp_size: int, device: Optional[Union[torch.device, str]] = None
) -> torch.Tensor:
    """Global positions ``(batch, seq_len // cp_size)`` (int64) of the tokens CP rank ``cp_rank`` keeps."""
    positions = torch.arange(seq_len, device=device).expand(batch, seq_len)
    return shard_sequence(positions, cp_rank, cp_size, dim=1).contiguous()


def shard_batch(batch: Mapping[str, Any], cp_rank: int, cp_size: int) -> dict[str, Any]:
    """Shard a micro-batch for CP rank ``cp_rank`` (a new dict; the input is not modified).

    Every tensor whose first two dims are ``(B, T)`` of ``input_ids`` (or ``labels``) is sharded along dim 1.
    ``position_ids`` (the global positions of the kept tokens) is added, or sharded if the batch has it (a ``(T,)``
    or ``(1, T)`` one, shared by the samples, first expanded to ``(B, T)``), and
    ``token_counts`` (B,) is added: each sample's number of labels != -100 over the WHOLE sequence, so that
    ``per_sample_token_loss(local_logits, local_labels, token_counts)`` summed over CP ranks is the sample's loss.
    Other values pass through unchanged.
    """
    if not isinstance(batch, Mapping):
        # Its values not quoted: they are the private data.
        raise TypeError(
            "Context parallelism shards a batch that is a dict (a Mapping) with 'input_ids' and/or 'labels' (B, T)"
            f" and optionally 'position_ids', got a {type(batch).__name__}. Return a dict from the Dataset (or the"
            " collate_fn), e.g. {'input_ids': ..., 'labels': ...}, and read it by key in training_step."
        )
    key = "input_ids" if "input_ids" in batch else "labels"
    if key not in batch:
        raise ValueError(f"shard_batch needs 'input_ids' or 'labels' in the batch, got keys {sorted(batch)}.")
    reference = batch[key]
    if reference.dim() < 2:
        raise ValueError(f"batch[{key!r}] must be (B, T), got a {reference.dim()}-D tensor.")
    bsz, seq_len = reference.shape[:2]
    check_shardable(seq_len, cp_size)
    out: dict[str, Any] = {}
    batch = with_shared_positions_expanded(batch)
    positions = batch.get("position_ids")
    if positions is not None and not (isinstance(positions, torch.Tensor) and positions.shape[:2] == (bsz, seq_len)):
        raise ValueError(f"batch['position_ids'] must be (B, T) as batch[{key!r}] is, or (T,) or (1, T) shared by the"
                         " samples.")
    for name, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (bsz, seq_len):
            out[name] = shard_sequence(value, cp_rank, cp_size, dim=1)
        else:
            out[name] = value
    if "position_ids" not in batch:
        out["position_ids"] = sharded_position_ids(bsz, seq_len, cp_rank, cp_size, device=reference.device)
    if "token_counts" not in batch and "labels" in batch:
        out["token_counts"] = (batch["labels"] != IGNORE_INDEX).sum(dim=1)
    return out


def _check_rank(cp_rank: int, cp_size: int) -> None:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"Invalid context-parallel rank {cp_rank} for context_parallel_size={cp_size}.")
