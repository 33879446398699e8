"""The context-parallel per-sample loss: whole-sequence value everywhere, shard-local gradient."""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from lightning_longshield.context_parallel.collectives import sum_over_shards
from lightning_longshield.loss import per_sample_token_loss


def context_parallel_per_sample_loss(
    logits: torch.Tensor, labels: torch.Tensor, token_counts: torch.Tensor, group: ProcessGroup
) -> torch.Tensor:
    """Per-sample loss (B,) over the WHOLE sequence, computed from this CP rank's shard.

    ``logits``/``labels`` are the local shard, ``token_counts`` the whole-sequence label counts from `shard_batch`.
    The value is the sum over the CP group of the shard losses (identical on every CP rank); its gradient is the
    local shard's only, so parameter gradients summed over the CP group are the full-sequence gradients.
    """
    return sum_over_shards(per_sample_token_loss(logits, labels, token_counts), group)
