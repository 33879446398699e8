"""Context-parallel causal attention: all-gather K/V (their n_kv_heads heads) over the CP group, then attend per
local chunk to its key prefix, with no mask of size T_local x T."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.attention.bias import causal_lower_right

from lightning_longshield.context_parallel.collectives import all_gather_unsharded


class ContextParallelAttention:
    """An ``Attention.attention_fn`` for head-tail sequence shards: ``(q, k, v, position_ids) -> out``.

    ``q`` is this rank's shard ``(B, H, T_local, head_dim)``, ``k, v`` are ``(B, H_kv, T_local, head_dim)`` (GQA heads
    not repeated), in the layout `shard_batch` produces: CP rank ``r`` of ``N`` holds chunks ``r`` and ``2N-1-r`` of
    the ``2N`` equal chunks of the sequence. K and V are all-gathered over the group with their ``H_kv`` heads
    (``n_kv_heads / n_heads`` of the bytes of gathering repeated heads) and put back in sequence order; the GQA
    repeat happens after the gather. Each local chunk then attends to the keys up to its own end, causally on its
    own block: one SDPA call per chunk with a lower-right-aligned causal bias, which CUDA runs on the flash (or
    memory-efficient) kernel without materialising a mask; elsewhere it is a ``(T_local / 2) x prefix`` boolean
    mask per chunk, shared by every layer of one forward (as long as the graph that saved it lives). The gather's
    backward reduce-scatters dK/dV, so each rank's K/V receive the gradient of every rank's queries.

    ``position_ids`` must be given (the shard's global positions): a call without them is not on a shard.
    """

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        # Non-CUDA masks of the current forward, keyed by (length, end); weak, so they die with their graph.
        self._masks_for: Optional[weakref.ref] = None
        self._masks: weakref.WeakValueDictionary[tuple[int, int], torch.Tensor] = weakref.WeakValueDictionary()

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: Optional[torch.Tensor]
    ) -> torch.Tensor:
        if position_ids is None:
            raise ValueError(
                "Context-parallel attention needs the shard's global position_ids: call the model as"
                " model(input_ids, position_ids) with the position_ids from"
                " lightning_longshield.context_parallel.shard_batch."
            )
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if k.shape == v.shape:  # one collective for both
            keys, values = all_gather_unsharded(torch.stack((k, v)), self.group, dim=3).unbind(0)
        else:
            keys, values = all_gather_unsharded(k, self.group, dim=2), all_gather_unsharded(v, self.group, dim=2)
        if self._masks_for is None or self._masks_for() is not position_ids:  # a new forward: new masks
            self._masks_for, self._masks = weakref.ref(position_ids), weakref.WeakValueDictionary()
        return head_tail_attention(q, keys, values, rank, size, self._cached_mask)

    def _cached_mask(self, length: int, end: int, device: torch.device) -> Any:
        mask = self._masks.get((length, end))
        if mask is None:
            mask = lower_right_causal_mask(length, end, device)
            if isinstance(mask, torch.Tensor):
                self._masks[(length, end)] = mask
        return mask

    def __deepcopy__(self, memo: dict[int, Any]) -> ContextParallelAttention:
        # A process group is a handle to shared communicators, not data: copies of a model share it.
        return type(self)(self.group)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group={self.group!r})"


def lower_right_causal_mask(length: int, end: int, device: torch.device) -> Any:
    """Causal mask for queries that are the last ``length`` of ``end`` keys: on CUDA torch's ``causal_lower_right``
    bias (flash / memory-efficient kernels, nothing materialised), elsewhere a ``(length, end)`` boolean mask."""
    if device.type == "cuda":
        return causal_lower_right(length, end)
    rows = torch.arange(length, device=device)[:, None] + (end - length)
    return rows >= torch.arange(end, device=device)[None, :]


def head_tail_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rank: int,
    size: int,
    mask: Callable[[int, int, torch.device], Any] = lower_right_causal_mask,
) -> torch.Tensor:
    """Causal attention of CP rank ``rank``'s head-tail queries ``(B, H, T_local, d)`` over the whole sequence's
    keys and values ``(B, H_kv, T, d)`` in sequence order (the local compute of `ContextParallelAttention`).

    The GQA repeat happens here; local chunk ``r`` attends to keys ``[0, (r + 1) c)`` and chunk ``2N-1-r`` to
    ``[0, (2N - r) c)``, each lower-right causal (``c = T_local / 2``).
    """
    repeats = q.shape[1] // keys.shape[1]
    if repeats > 1:
        keys, values = keys.repeat_interleave(repeats, dim=1), values.repeat_interleave(repeats, dim=1)
    chunk = q.shape[2] // 2
    ends = ((rank + 1) * chunk, (2 * size - rank) * chunk)  # the last key each local chunk may see, exclusive
    outputs = [
        F.scaled_dot_product_attention(part, keys[:, :, :end], values[:, :, :end], attn_mask=mask(chunk, end, q.device))
        for part, end in zip(q.split(chunk, dim=2), ends)
    ]
    return torch.cat(outputs, dim=2)


def apply_context_parallel_attention(model: nn.Module, group: ProcessGroup) -> int:
    """Set ``attention_fn = ContextParallelAttention(group)`` on every submodule that has an ``attention_fn``.

    Returns how many modules were changed. Raises `TypeError` if there are none: a model whose attention cannot
    take global position ids would silently attend within its own shard only.
    """
    attention = ContextParallelAttention(group)
    replaced = 0
    for module in model.modules():
        if hasattr(module, "attention_fn"):
            module.attention_fn = attention
            replaced += 1
    if replaced == 0:
        raise TypeError(
            f"{type(model).__name__} has no module with an `attention_fn` attribute, so its attention cannot be made"
            " context-parallel (it would attend only within each rank's shard and ignore global positions). Use"
            " lightning_longshield.models.Llama, or give each attention module an"
            " `attention_fn(q, k, v, position_ids)` attribute that it calls with (B, H, T, head_dim) tensors and"
            " the global position ids; or train with context_parallel_size=1."
        )
    return replaced
