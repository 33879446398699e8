"""The chunked loss's default chunk (`simulate.loss_chunks`), the rule the module runs and the planner models."""

from __future__ import annotations

import pytest

from simulate.loss_chunks import (
    MIN_CHUNK_TOKENS,
    MOST_CHUNK_LOGITS,
    WHOLE_LOGITS_LIMIT_BYTES,
    auto_loss_chunk_tokens,
    resolve_loss_chunk_tokens,
)

LLAMA_1B = dict(dim=2048, vocab_size=128256)


def test_small_logits_are_not_chunked():
    assert auto_loss_chunk_tokens(4, 16, dim=32, vocab_size=64) is None
    assert auto_loss_chunk_tokens(1, 512, **LLAMA_1B) is None  # 0.73 GiB of fp32 working set
    assert 1 * 512 * LLAMA_1B["vocab_size"] * 12 <= WHOLE_LOGITS_LIMIT_BYTES < 1 * 1024 * LLAMA_1B["vocab_size"] * 12


@pytest.mark.parametrize("positions, chunk", [(1024, 256), (16384, 512), (131072, 4096), (262144, 8192)])
def test_long_sequences_get_chunks_about_as_large_as_the_hidden_states(positions, chunk):
    assert auto_loss_chunk_tokens(1, positions, **LLAMA_1B) == chunk
    assert chunk * LLAMA_1B["vocab_size"] <= 2 * positions * LLAMA_1B["dim"] or chunk == MIN_CHUNK_TOKENS


def test_a_chunks_logits_stay_below_2_to_the_31():
    """The rule's chunks grow with the sequence; at 8B (vocab 128,256, dim 4096), 2 samples of 262,144 positions a
    rank would have had chunks of 16,384 positions, 4.2e9 logits."""
    llama_8b = dict(dim=4096, vocab_size=128256)
    assert auto_loss_chunk_tokens(1, 262144, **llama_8b) == 16384  # 2.1e9 logits: within the cap
    assert auto_loss_chunk_tokens(2, 262144, **llama_8b) == 8192
    assert 2 * 8192 * 128256 < MOST_CHUNK_LOGITS < 2 * 16384 * 128256
    assert auto_loss_chunk_tokens(128, 4096, **llama_8b) == 128  # below the 256 positions the GPU prefers


def test_a_chunk_is_never_the_whole_sequence():
    assert auto_loss_chunk_tokens(64, 200, **LLAMA_1B) is None  # over the limit, but one chunk would cover it all
    assert auto_loss_chunk_tokens(64, 300, **LLAMA_1B) == MIN_CHUNK_TOKENS


def test_settings_resolve_as_documented():
    assert resolve_loss_chunk_tokens(None, 1, 262144, **LLAMA_1B) is None
    assert resolve_loss_chunk_tokens(100, 1, 16, **LLAMA_1B) is None  # one chunk covers every position
    assert resolve_loss_chunk_tokens(5, 1, 16, **LLAMA_1B) == 5
    assert resolve_loss_chunk_tokens("auto", 1, 16384, **LLAMA_1B) == 512
    with pytest.raises(ValueError, match="'auto', None .* or a positive integer"):
        resolve_loss_chunk_tokens("on", 1, 16, **LLAMA_1B)
