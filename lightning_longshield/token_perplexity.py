"""Validation perplexity from token-loss sums, so that it needs no whole ``(B, T, vocab)`` logits."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.nn import Module
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

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], exclude_state: Sequence[str] = ()) -> Module:
        """As torchmetrics moves and converts states, but the loss sum keeps fp64 and only follows the device: under
        ``precision="bf16-true"`` Lightning converts the module with ``.to(torch.bfloat16)``, which torchmetrics does
        not guard, and an 8-bit mantissa put the perplexity of 200 batches of loss 3 a token at 35.25, not
        e^3 = 20.09."""
        this = super()._apply(fn, exclude_state=(*exclude_state, "loss_sum"))
        device = fn(this.loss_sum).device
        this._defaults["loss_sum"] = this._defaults["loss_sum"].to(device)
        this.loss_sum = this.loss_sum.to(device)
        return this

    def update(self, token_loss_sum: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add a batch's summed token cross-entropy and its number of labelled tokens."""
        self.loss_sum += token_loss_sum.detach().double()
        self.tokens += tokens.detach().long()

    def compute(self) -> torch.Tensor:
        """The perplexity, or nan without a labelled token (no update, or only ignored labels): not a score."""
        return torch.where(self.tokens > 0, torch.exp(self.loss_sum / self.tokens.clamp(min=1)), torch.nan)
