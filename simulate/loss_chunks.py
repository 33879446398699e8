"""How many positions one chunk of the chunked loss covers: the rule `CausalLMModule` runs and the planner models.

The chunked loss (``lightning_longshield.loss``) applies the output head and the fp32 cross-entropy to one chunk of
positions at a time, under activation checkpointing, so the whole ``(B, T, vocab)`` logits never exist; the price is
the head's forward once more per chunk in backward (``2 x dim x vocab`` FLOPs per token). It pays where the whole
logits' working set is large: by default the loss is chunked once that working set would exceed
`WHOLE_LOGITS_LIMIT_BYTES`, with chunks whose logits are about as large as the hidden states they come from (Liger
Kernel's rule), and never narrower than `MIN_CHUNK_TOKENS` positions (small matmuls waste the GPU), nor with more
than `MOST_CHUNK_LOGITS` logits (the rule's chunks grow with the sequence: at 8B, 2 samples of 262,144 positions a
rank would give 4.2e9).
"""

from __future__ import annotations

import math
from typing import Literal, Optional, Union

LossChunking = Union[int, Literal["auto"], None]

WHOLE_LOGITS_LIMIT_BYTES = 2**30
"""Chunk by default once ``B x T x vocab x 12`` bytes (fp32 logits, log-softmax and gradient) would exceed 1 GiB."""

MIN_CHUNK_TOKENS = 256
MOST_CHUNK_LOGITS = 2**31 - 1  # elements of one chunk's logits: past it, 32-bit indexing in some kernels overflows
LOSS_WORKING_BYTES_PER_LOGIT = 12  # fp32: the upcast logits, the saved log-softmax, the gradient


def auto_loss_chunk_tokens(micro_batch_size: int, positions: int, dim: int, vocab_size: int) -> Optional[int]:
    """Positions per chunk for ``micro_batch_size`` samples of ``positions`` tokens (one rank's shard under context
    parallelism), or ``None``: the whole logits at once, when they are small or one chunk would cover them all."""
    whole = micro_batch_size * positions * vocab_size * LOSS_WORKING_BYTES_PER_LOGIT
    if whole <= WHOLE_LOGITS_LIMIT_BYTES:
        return None
    chunk = max(MIN_CHUNK_TOKENS, 2 ** math.ceil(math.log2(max(1.0, positions * dim / vocab_size))))
    fitting = MOST_CHUNK_LOGITS // (micro_batch_size * vocab_size)  # positions whose logits stay within the cap
    if chunk > fitting:
        chunk = 2 ** max(0, fitting.bit_length() - 1)
    return chunk if chunk < positions else None


def resolve_loss_chunk_tokens(setting: LossChunking, micro_batch_size: int, positions: int, dim: int,
                              vocab_size: int) -> Optional[int]:
    """The chunk a ``loss_chunk_tokens`` setting gives: ``"auto"`` by `auto_loss_chunk_tokens`, an int as it is
    (``None`` where it covers every position), ``None`` for the whole logits."""
    check_loss_chunking(setting)
    if setting == "auto":
        return auto_loss_chunk_tokens(micro_batch_size, positions, dim, vocab_size)
    if setting is None or setting >= positions:
        return None
    return int(setting)


def check_loss_chunking(setting: object) -> None:
    """Refuse a ``loss_chunk_tokens`` that is not ``"auto"``, ``None`` or a positive integer."""
    if setting == "auto" or setting is None:
        return
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"loss_chunk_tokens must be 'auto', None (the whole logits at once) or a positive integer, "
                         f"got {setting!r}.")
