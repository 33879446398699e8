"""Context-parallel causal attention: all-gather K/V (their n_kv_heads heads) over the CP group, then attend per
local chunk to its key prefix, with no mask of size T_local x T."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.attention.bias import causal_lower_right

from lightning_longshield.context_parallel.collectives import all_gather_unsharded

_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class ContextParallelAttention:
    """An ``Attention.attention_fn`` for head-tail sequence shards: ``(q, k, v, position_ids) -> out``.

    ``q`` is this rank's shard ``(B, H, T_local, head_dim)``, ``k, v`` are ``(B, H_kv, T_local, head_dim)`` (GQA heads
    not repeated), in the layout `shard_batch` produces: CP rank ``r`` of ``N`` holds chunks ``r`` and ``2N-1-r`` of
    the ``2N`` equal chunks of the sequence. K and V are all-gathered over the group with their ``H_kv`` heads
    (``n_kv_heads / n_heads`` of the bytes of gathering repeated heads) and put back in sequence order; the GQA
    repeat happens after the gather. Each local chunk then attends to the keys up to its own end, causally on its
    own block (`prefix_causal_attention`): no mask is materialised on any device. The gather's backward
    reduce-scatters dK/dV, so each rank's K/V receive the gradient of every rank's queries.

    ``position_ids`` must be given (the shard's global positions): a call without them is not on a shard.
    """

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

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
        return head_tail_attention(q, keys, values, rank, size)

    def __deepcopy__(self, memo: dict[int, Any]) -> ContextParallelAttention:
        # A process group is a handle to shared communicators, not data: copies of a model share it.
        return type(self)(self.group)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group={self.group!r})"


def head_tail_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rank: int, size: int
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
        prefix_causal_attention(part, keys[:, :, :end], values[:, :, :end])
        for part, end in zip(q.split(chunk, dim=2), ends)
    ]
    return torch.cat(outputs, dim=2)


def prefix_causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal attention of queries ``(B, H, c, d)`` that are the last ``c`` positions of the ``end`` keys and values
    ``(B, H, end, d)`` (query ``i`` sees keys ``j <= end - c + i``), with no ``c x end`` mask.

    On CPU: one flash-attention call over the earlier keys (no mask), one causal call over the diagonal block, merged
    by their log-sum-exp (`_PrefixCausalAttention`). Elsewhere: SDPA with torch's lower-right causal bias, which CUDA
    runs on the flash or memory-efficient kernel.
    """
    if q.device.type == "cpu":
        return _PrefixCausalAttention.apply(q, keys, values)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(q.shape[2], keys.shape[2]))


class _PrefixCausalAttention(torch.autograd.Function):
    """Blockwise prefix-causal attention on torch's CPU flash kernels.

    Forward: the diagonal block (causal, square) and the earlier keys (unmasked) each return their output and
    log-sum-exp; the merge weights each by ``exp(lse_part - lse)``. Backward: each block's flash backward with the
    *merged* output and log-sum-exp, which recomputes that block's share of the merged softmax, so the two calls'
    gradients add up to the exact gradient of the whole (as ring attention does).
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        start = keys.shape[2] - q.shape[2]
        out, lse = _cpu_flash(q, keys[:, :, start:], values[:, :, start:], 0.0, True)
        if start > 0:
            out_before, lse_before = _cpu_flash(q, keys[:, :, :start], values[:, :, :start], 0.0, False)
            merged_lse = torch.logaddexp(lse, lse_before)
            accumulate = torch.promote_types(q.dtype, torch.float32)
            out = (
                out.to(accumulate) * (lse - merged_lse).exp().unsqueeze(-1)
                + out_before.to(accumulate) * (lse_before - merged_lse).exp().unsqueeze(-1)
            ).to(q.dtype)
            lse = merged_lse
        ctx.save_for_backward(q, keys, values, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, keys, values, out, lse = ctx.saved_tensors
        start = keys.shape[2] - q.shape[2]
        grad_out = grad_out.contiguous()
        grad_q, grad_k_diag, grad_v_diag = _cpu_flash_backward(
            grad_out, q, keys[:, :, start:], values[:, :, start:], out, lse, 0.0, True
        )
        if start == 0:
            return grad_q, grad_k_diag, grad_v_diag
        grad_q_before, grad_k_before, grad_v_before = _cpu_flash_backward(
            grad_out, q, keys[:, :, :start], values[:, :, :start], out, lse, 0.0, False
        )
        return (
            grad_q + grad_q_before,
            torch.cat((grad_k_before, grad_k_diag), dim=2),
            torch.cat((grad_v_before, grad_v_diag), dim=2),
        )


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
