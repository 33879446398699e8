"""Worker for FSDP2 sharding of models whose blocks hold lists of their own (a mixture's experts)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from lightning_longshield.parallelize import shard_with_fsdp


class ExpertsBlock(nn.Module):
    """A block whose layers sit in a list of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(expert(x) for expert in self.experts)


class WithExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.layers = nn.ModuleList([ExpertsBlock(), ExpertsBlock()])
        self.head = nn.Linear(4, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.layers:
            h = block(h)
        return self.head(h)


def shard_blocks_with_lists(rank: int, world_size: int) -> None:
    """Sharding the blocks before their experts failed in FSDP2 ("Invariant encountered"); the innermost go first."""
    torch.manual_seed(0)
    model = WithExperts()
    ids = torch.randint(0, 8, (2, 3))
    expected = model(ids)
    shard_with_fsdp(nn.ModuleDict({"model": model}), init_device_mesh("cpu", (world_size,)))
    assert all(isinstance(module, FSDPModule) for module in [*model.layers, *model.layers[0].experts])
    torch.testing.assert_close(model(ids), expected)
