"""Context-parallel causal attention: all-gather K/V over the CP group, mask from global positions."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from lightning_longshield.context_parallel.collectives import all_gather_sequence, gather_along_dim


class ContextParallelAttention:
    """An ``Attention.attention_fn`` for sequence shards: ``(q, k, v, position_ids) -> out``.

    ``q, k, v`` are this rank's shard, shape ``(B, H, T_local, head_dim)`` (K/V already repeated to H heads), and
    ``position_ids`` ``(B, T_local)`` the shard's global positions. K, V and the positions are all-gathered over the
    CP group; query ``i`` attends to key ``j`` iff ``position[i] >= position[j]``; the local queries' outputs
    ``(B, H, T_local, head_dim)`` are returned. The all-gather's backward reduce-scatters dK/dV, so each rank's
    K/V receive the gradient of every rank's queries. Works with any sharding layout (the mask only uses positions),
    provided every rank's shard has the same length.

    The mask is additive, in the queries' dtype, and shared by every layer of one forward (layers receive the same
    ``position_ids`` tensor): autograd saves one ``(B, 1, T_local, T)`` mask per micro-batch, not one per layer.
    """

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        # Weak references: the mask lives exactly as long as the autograd graph that saved it.
        self._mask_for: Optional[tuple[weakref.ref, weakref.ref]] = None

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: Optional[torch.Tensor]
    ) -> torch.Tensor:
        if position_ids is None:
            raise ValueError(
                "Context-parallel attention needs the shard's global position_ids: call the model as"
                " model(input_ids, position_ids) with the position_ids from"
                " lightning_longshield.context_parallel.shard_batch."
            )
        if k.shape == v.shape:  # one collective for both
            keys, values = all_gather_sequence(torch.stack((k, v)), self.group, dim=3).unbind(0)
        else:
            keys, values = all_gather_sequence(k, self.group, dim=2), all_gather_sequence(v, self.group, dim=2)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self._mask(position_ids, q.dtype))

    def _mask(self, position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Additive causal mask over global positions: 0 where query may attend key, -inf elsewhere."""
        if self._mask_for is not None:
            positions, mask = self._mask_for[0](), self._mask_for[1]()
            if positions is position_ids and mask is not None and mask.dtype == dtype:
                return mask
        key_positions = gather_along_dim(position_ids, self.group, dim=1)
        allowed = position_ids[:, None, :, None] >= key_positions[:, None, None, :]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        self._mask_for = (weakref.ref(position_ids), weakref.ref(mask))
        return mask

    def __deepcopy__(self, memo: dict[int, Any]) -> ContextParallelAttention:
        # A process group is a handle to shared communicators, not data: copies of a model share it.
        return type(self)(self.group)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group={self.group!r})"


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
