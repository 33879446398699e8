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
