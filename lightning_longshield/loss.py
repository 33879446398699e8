"""The causal-LM loss with the privacy unit's semantics: each sample is the mean of its own token losses."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def per_sample_token_loss(
    logits: torch.Tensor, labels: torch.Tensor, token_counts: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Per-sample loss (B,): sum of fp32 token cross-entropies over non-ignored labels / the sample's token count.

    ``token_counts`` overrides the count of non-ignored labels in ``labels``; a shard of a sequence passes the count
    over the whole sequence so that shard losses sum to the sample's loss. A sample with no labelled token has
    loss 0 (and gradient 0).
    """
    return token_loss_sums(logits, labels) / loss_divisors(labels, token_counts)


def token_loss_sums(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each sample's sum of fp32 token cross-entropies over its non-ignored labels (B,)."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(labels.shape).sum(dim=1)


def loss_divisors(labels: torch.Tensor, token_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The divisor of each sample's loss (B,): ``token_counts``, else its non-ignored labels, at least 1."""
    if token_counts is None:
        token_counts = (labels != IGNORE_INDEX).sum(dim=1)
    return token_counts.clamp(min=1)


def chunked_per_sample_token_loss(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    token_counts: Optional[torch.Tensor] = None,
    chunk_tokens: int = 1024,
) -> torch.Tensor:
    """`per_sample_token_loss` of ``head(hidden)`` without the whole ``(B, T, vocab)`` logits (see
    `chunked_token_loss_sums`)."""
    return chunked_token_loss_sums(hidden, head, labels, chunk_tokens) / loss_divisors(labels, token_counts)


def chunked_token_loss_sums(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor,
                            chunk_tokens: int) -> torch.Tensor:
    """`token_loss_sums` of ``head(hidden)`` over chunks of ``chunk_tokens`` positions. With autograd on, each chunk
    runs under non-reentrant checkpointing, so one chunk's logits (and their fp32 copy and gradient) exist at a time,
    in forward and again in backward.

    ``head`` then runs once per chunk: its per-sample gradient is the sum over the chunks, which every clipping path
    takes as one layer's (a layer called more than once per forward).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}.")
    recompute = torch.is_grad_enabled()
    total = hidden.new_zeros(labels.shape[0], dtype=torch.float32)
    # split, not slicing: its backward concatenates the chunks' gradients once instead of a full-size tensor each.
    for hidden_chunk, label_chunk in zip(hidden.split(chunk_tokens, dim=1), labels.split(chunk_tokens, dim=1)):
        if recompute:
            sums = checkpoint(_head_token_loss_sums, head, hidden_chunk, label_chunk, use_reentrant=False)
        else:
            sums = _head_token_loss_sums(head, hidden_chunk, label_chunk)
        total = total + sums
    return total


def _head_token_loss_sums(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`token_loss_sums` of one chunk's logits (formed here, so a checkpoint frees them)."""
    return token_loss_sums(head(hidden), labels)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Micro-batch loss: the mean over samples of `per_sample_token_loss`."""
    return per_sample_token_loss(logits, labels).mean()
