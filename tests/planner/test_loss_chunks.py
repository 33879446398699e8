"""The chunked loss's default chunk (`simulate.loss_chunks`), the rule the module runs and the planner models."""

from __future__ import annotations

import pytest

from simulate.loss_chunks import (
    MIN_CHUNK_TOKENS,
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
