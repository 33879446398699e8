"""Every process must hold the same training set and batch size: each draws the same Poisson mask over its own copy at
the rate its own DataLoader gives, so a disagreement is refused on every rank (none left waiting in a collective)."""

from __future__ import annotations

import pytest

from lightning_longshield.trainer_checks import check_same_training_data
from tests.support.process_runner import run_processes


def check_on_each_rank(rank: int, world_size: int) -> None:
    check_same_training_data(100, 4)  # the same data everywhere: nothing to say
    with pytest.raises(ValueError, match=r"rank 0: 100 samples, batch_size=4; rank 1: 99 samples, batch_size=4"):
        check_same_training_data(100 - rank, 4)
    with pytest.raises(ValueError, match=r"rank 0: 100 samples, batch_size=4; rank 1: 100 samples, batch_size=None"):
        check_same_training_data(100, None if rank else 4)


@pytest.mark.timeout(60)
def test_ranks_with_different_training_data_are_refused_on_every_rank(tmp_path):
    run_processes(2, tmp_path, check_on_each_rank)
