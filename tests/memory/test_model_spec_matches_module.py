"""The planner's parameter counts (``simulate``, torch-free) against the shipped ``Llama`` module, counted by torch."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from torch import nn

from lightning_longshield.models import Llama, LlamaConfig
from simulate.specs import MODEL_PRESETS, get_model_spec


def _numel(params: Iterable[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_block_root_and_total_counts_match_the_module(name: str) -> None:
    spec = get_model_spec(name)
    with torch.device("meta"):  # shapes only: the 70B preset allocates nothing
        model = Llama(LlamaConfig.from_name(name))
    in_blocks = {id(p) for p in model.layers.parameters()}
    outside = _numel(p for p in model.parameters() if id(p) not in in_blocks)  # a tied weight is yielded once
    assert len(model.layers) == spec.n_layers
    assert [_numel(block.parameters()) for block in model.layers] == [spec.block_numel] * spec.n_layers
    assert spec.root_numel == outside
    assert spec.num_parameters == _numel(model.parameters())


def _saved_bytes_per_token_by_storage(block: nn.Module, config: LlamaConfig, batch: int, seq: int) -> dict[int, int]:
    """Bytes per token of every distinct storage one real block's forward saves for backward (parameters and the
    RoPE tables, shared by all blocks, excluded)."""
    from lightning_longshield.models.rope import rope_angles, rope_inverse_frequencies

    x = torch.randn(batch, seq, config.dim, requires_grad=True)
    positions = torch.arange(seq).expand(batch, seq)
    rope = rope_angles(positions, rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling))
    excluded = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *rope)}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes() // (batch * seq)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        block(x, rope, None)
    return saved


def test_what_a_block_saves_matches_the_spec_tensor_by_tensor() -> None:
    """fp32, CP 1, n_kv_heads == n_heads (so repeated and unrepeated K/V coincide): the real block's saved
    storages per token are the spec's list, except that the attention output and ``wo``'s input are one storage
    here (the CPU flash kernel returns its output laid out (B, T, H, D), so the transpose back is a view). The
    spec counts them twice: a known over-count of ``dim`` elements per token per block."""
    from simulate.layers import block_saved_tensors

    config = LlamaConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=96, max_seq_len=64,
                         rope_theta=10000.0)
    traced = _saved_bytes_per_token_by_storage(Llama(config).layers[0], config, batch=2, seq=32)
    spec = {t.name: t.nbytes(local_tokens=1, cp_size=1) for t in block_saved_tensors(config, act=4,
                                                                                    context_parallel=False)}
    aliased = spec.pop("wo.input")
    assert aliased == config.dim * 4
    assert sorted(traced.values()) == sorted(spec.values())
