"""Autograd-aware collectives over a (context-parallel) process group.

All ranks of the group must call these in the same order with tensors of the same shape and dtype. The gathered
dim is moved to dim 0 for the collective (``all_gather_into_tensor`` / ``reduce_scatter_tensor``, renamed
``all_gather_single`` / ``reduce_scatter_single`` in torch 2.13, concatenate along dim 0 of contiguous buffers), so
any dim of any (non-contiguous) tensor works. Device-agnostic (gloo, NCCL).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_longshield.context_parallel.sharding import unshard_sequence
from lightning_longshield.dist_compat import all_gather_single, reduce_scatter_single


def gather_along_dim(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """All-gather ``x`` along ``dim`` in rank order (no autograd)."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((size * front.shape[0], *front.shape[1:]))
    all_gather_single(out, front, group=group)
    return out.movedim(0, dim)


def reduce_scatter_along_dim(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's piece (piece ``rank`` of ``size`` along ``dim``; no autograd)."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"reduce_scatter_along_dim: size {x.shape[dim]} of dim {dim} is not divisible by {size}.")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // size, *front.shape[1:]))
    reduce_scatter_single(out, front, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, dim)


class _AllGatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return gather_along_dim(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return reduce_scatter_along_dim(grad, ctx.group, ctx.dim), None, None


class _SumOverShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def all_gather_sequence(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (every rank's piece must have the same shape).

    Backward: the gradient is reduce-scattered (summed over ranks), so each rank gets the total gradient of its own
    piece from every rank's use of the gathered tensor.
    """
    if dist.get_world_size(group) == 1:
        return x
    return _AllGatherSequence.apply(x, group, dim % x.dim())


def all_gather_unsharded(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """The full sequence in its original order from every CP rank's head-tail shard ``x`` (differentiable)."""
    size = dist.get_world_size(group)
    gathered = all_gather_sequence(x, group, dim)
    return unshard_sequence(gathered.chunk(size, dim=dim), size, dim=dim)


def sum_over_shards(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum of ``x`` over the group in the forward; the gradient goes to the local ``x`` unchanged.

    For a quantity that is a sum of per-shard terms (a sample's loss over its sequence shards): every rank sees the
    total value (for logging), and backpropagating it on every rank gives each rank the gradient of its own term
    only, so summing parameter gradients over the group yields the gradient of the total exactly once.
    """
    if dist.get_world_size(group) == 1:
        return x
    return _SumOverShards.apply(x, group)
