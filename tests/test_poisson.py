"""Poisson logical batches: rate, independence of draws, data-parallel disjointness, empty batches."""

from __future__ import annotations

import torch
from torch.utils.data import default_collate

from helpers import RandomTokens
from lightning_longshield.privacy import CollateAllowingEmpty, PoissonBatchSampler


def test_inclusion_rate_and_epoch_length():
    sampler = PoissonBatchSampler(200, 0.05, base_seed=0)
    assert len(sampler) == 20
    counts = torch.zeros(200)
    batches = [b for _ in range(50) for b in sampler]
    for batch in batches:
        counts[batch] += 1
    rate = counts.sum() / (200 * len(batches))
    assert abs(rate - 0.05) < 4 * (0.05 * 0.95 / (200 * len(batches))) ** 0.5
    assert len({tuple(b) for b in batches}) > 0.9 * len(batches), "draws must differ"


def test_data_parallel_groups_are_disjoint_and_cover_the_draw():
    whole = list(PoissonBatchSampler(100, 0.3, base_seed=7))
    parts = [list(PoissonBatchSampler(100, 0.3, base_seed=7, data_parallel_rank=g, data_parallel_size=3))
             for g in range(3)]
    for k, batch in enumerate(whole):
        shares = [set(p[k]) for p in parts]
        assert set().union(*shares) == set(batch)
        assert sum(len(s) for s in shares) == len(batch)


def test_draws_are_addressable_for_resumption():
    full = list(PoissonBatchSampler(50, 0.2, base_seed=3))
    resumed = list(PoissonBatchSampler(50, 0.2, base_seed=3, first_draw=2))
    assert resumed[:3] == full[2:5]


def test_empty_batches_collate_to_zero_length_tensors():
    dataset = RandomTokens(size=4, seq_len=6)
    batch = CollateAllowingEmpty(dataset, default_collate)([])
    assert batch["input_ids"].shape == (0, 6) and batch["labels"].shape == (0, 6)
    assert any(len(b) == 0 for b in PoissonBatchSampler(1000, 0.0005, base_seed=0))
