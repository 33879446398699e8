"""Which slice of each parameter a context-parallel rank owns (the same slice FSDP2 keeps on that rank)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_longshield.dist_compat import reduce_scatter_single


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 parameters and gradients), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@dataclass(frozen=True)
class ParamShard:
    """Rank ``rank`` of ``world`` owns chunk ``rank`` of dimension ``dim`` (full length ``size``).

    Chunks have ``torch.chunk`` sizes, ``ceil(size / world)`` (the last ones may be shorter or empty), as FSDP2 uses.
    ``offset`` arguments skip leading dimensions of a tensor that holds the parameter, e.g. the per-sample one.

    With ``replicas > 1`` (FSDP2 over data-parallel x context-parallel ranks, ``shard_over="all"``) the dimension is
    cut into ``replicas * world`` chunks and this rank owns chunks ``r * world + rank`` for every replica ``r``: the
    shards of the ``replicas`` ranks of its data-parallel group that share its context-parallel rank. Its part then
    keeps the padding (``replicas * chunk_size`` long): a reduce-scatter over the data-parallel group leaves each rank
    exactly its FSDP2 chunk (`data_parallel_chunks_first`).
    """

    dim: int
    rank: int
    world: int
    size: int
    replicas: int = 1

    @property
    def chunk_size(self) -> int:
        return -(-self.size // (self.world * self.replicas))

    @property
    def bounds(self) -> tuple[int, int]:
        """``[start, stop)`` of the owned chunk (one replica only)."""
        if self.replicas != 1:
            raise ValueError("A shard over several replicas owns several ranges; use owns().")
        start = min(self.size, self.rank * self.chunk_size)
        return start, min(self.size, start + self.chunk_size)

    def owns(self, indices: torch.Tensor) -> torch.Tensor:
        """Whether each index along ``dim`` lies in a chunk this rank owns."""
        return (indices // self.chunk_size) % self.world == self.rank

    def _padded_last(self, tensor: torch.Tensor, offset: int) -> torch.Tensor:
        """The shard dim last, zero-padded and unflattened to ``(replicas, world, chunk_size)``."""
        moved = tensor.movedim(self.dim + offset, -1)
        padded = F.pad(moved, (0, self.chunk_size * self.world * self.replicas - self.size))
        return padded.unflatten(-1, (self.replicas, self.world, self.chunk_size))

    def take(self, tensor: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """This rank's part of a full tensor."""
        if self.replicas == 1:
            start, stop = self.bounds
            return tensor.narrow(self.dim + offset, start, stop - start)
        mine = self._padded_last(tensor, offset).select(-2, self.rank).flatten(-2)
        return mine.movedim(-1, self.dim + offset)

    def padded_chunks_first(self, tensor: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Zero-pad the shard dim and make the ranks' parts the leading axis: ``(world, ..., part)``.

        Contiguous, in the layout ``reduce_scatter_single``, ``all_to_all_single`` and `from_chunk` expect.
        """
        return self._padded_last(tensor, offset).movedim(-2, 0).flatten(-2).contiguous()

    def from_chunk(self, chunk: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """This rank's part of `padded_chunks_first` with the shard dim back in place (and, for one replica, the
        padding trimmed)."""
        if self.replicas == 1:
            start, stop = self.bounds
            chunk = chunk.narrow(-1, 0, stop - start)
        return chunk.movedim(-1, self.dim + offset)

    def data_parallel_chunks_first(self, part: torch.Tensor) -> torch.Tensor:
        """This rank's part ``(..., replicas * chunk_size, ...)`` as ``(replicas, ..., chunk_size, ...)``: the input
        of the reduce-scatter over the data-parallel group that leaves each replica its FSDP2 chunk."""
        return part.unflatten(self.dim, (self.replicas, self.chunk_size)).movedim(self.dim, 0).contiguous()


@torch.no_grad()
def reduce_scatter_to_shard(tensor: torch.Tensor, shard: ParamShard, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum a whole-parameter tensor over ``group``; this rank's shard of the sum."""
    chunks = shard.padded_chunks_first(tensor)
    output = torch.empty_like(chunks[:1])  # gloo wants the output's leading dim times the group size
    reduce_scatter_single(output, chunks, group=group)
    return shard.from_chunk(output[0])
