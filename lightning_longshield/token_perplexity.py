"""Validation perplexity from token-loss sums, so that it needs no whole ``(B, T, vocab)`` logits."""

from __future__ import annotations

import torch
from torchmetrics import Metric


class TokenPerplexity(Metric):
    """``exp(sum of token cross-entropies / labelled tokens)`` over every update and every rank (a sequence's shards
    on its context-parallel ranks add up to the whole sequence)."""

    full_state_update = False
    higher_is_better = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("loss_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, token_loss_sum: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add a batch's summed token cross-entropy and its number of labelled tokens."""
        self.loss_sum += token_loss_sum.detach().double()
        self.tokens += tokens.detach().long()

    def compute(self) -> torch.Tensor:
        """The perplexity, or nan without a labelled token (no update, or only ignored labels): not a score."""
        return torch.where(self.tokens > 0, torch.exp(self.loss_sum / self.tokens.clamp(min=1)), torch.nan)
