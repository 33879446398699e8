"""The causal-LM loss with the privacy unit's semantics: each sample is the mean of its own token losses."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def per_sample_token_loss(
    logits: torch.Tensor, labels: torch.Tensor, token_counts: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Per-sample loss (B,): sum of fp32 token cross-entropies over non-ignored labels / the sample's token count.

    ``token_counts`` overrides the count of non-ignored labels in ``labels``; a shard of a sequence passes the count
    over the whole sequence so that shard losses sum to the sample's loss. A sample with no labelled token has
    loss 0 (and gradient 0).
    """
    token_losses = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(labels.shape)
    if token_counts is None:
        token_counts = (labels != IGNORE_INDEX).sum(dim=1)
    return token_losses.sum(dim=1) / token_counts.clamp(min=1)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Micro-batch loss: the mean over samples of `per_sample_token_loss`."""
    return per_sample_token_loss(logits, labels).mean()
