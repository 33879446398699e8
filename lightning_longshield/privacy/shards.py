"""Which slice of each parameter a context-parallel rank owns (the same slice FSDP2 keeps on that rank)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 parameters and gradients), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@dataclass(frozen=True)
class ParamShard:
    """Rank ``rank`` of ``world`` owns chunk ``rank`` of dimension ``dim`` (full length ``size``).

    Chunks have ``torch.chunk`` sizes, ``ceil(size / world)`` (the last ones may be shorter or empty), as FSDP2 uses.
    ``offset`` arguments skip leading dimensions of a tensor that holds the parameter, e.g. the per-sample one.
    """

    dim: int
    rank: int
    world: int
    size: int

    @property
    def chunk_size(self) -> int:
        return -(-self.size // self.world)

    @property
    def bounds(self) -> tuple[int, int]:
        start = min(self.size, self.rank * self.chunk_size)
        return start, min(self.size, start + self.chunk_size)

    def take(self, tensor: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """This rank's slice of a full tensor."""
        start, stop = self.bounds
        return tensor.narrow(self.dim + offset, start, stop - start)

    def padded_chunks_first(self, tensor: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Zero-pad the shard dim to ``world`` equal chunks and make them the leading axis: ``(world, ..., chunk)``.

        Contiguous, in the layout ``reduce_scatter_tensor``, ``all_to_all_single`` and `from_chunk` expect.
        """
        moved = tensor.movedim(self.dim + offset, -1)
        padded = F.pad(moved, (0, self.chunk_size * self.world - self.size))
        return padded.unflatten(-1, (self.world, self.chunk_size)).movedim(-2, 0).contiguous()

    def from_chunk(self, chunk: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """This rank's chunk of `padded_chunks_first` with the padding trimmed and the shard dim back in place."""
        start, stop = self.bounds
        return chunk.narrow(-1, 0, stop - start).movedim(-1, self.dim + offset)


@torch.no_grad()
def reduce_scatter_to_shard(
    tensor: torch.Tensor, shard: ParamShard, group: dist.ProcessGroup, offset: int = 0
) -> torch.Tensor:
    """Sum a whole-parameter tensor (``offset`` leading dims, e.g. samples) over ``group``; this rank's shard of it."""
    chunks = shard.padded_chunks_first(tensor, offset=offset)
    output = torch.empty_like(chunks[:1])  # gloo wants the output's leading dim times the group size
    dist.reduce_scatter_tensor(output, chunks, group=group)
    return shard.from_chunk(output[0], offset=offset)
