"""Every process must hold the same training set and batch size: each draws the same Poisson mask over its own copy at
the rate its own DataLoader gives, so a disagreement is refused on every rank (none left waiting in a collective).
And the data-parallel replicas start from the same model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_longshield.parallelize import sync_data_parallel_replicas
from lightning_longshield.trainer_checks import check_same_training_data
from tests.support.process_runner import run_processes


def check_on_each_rank(rank: int, world_size: int) -> None:
    check_same_training_data(100, 4)  # the same data everywhere: nothing to say
    with pytest.raises(ValueError, match=r"rank 0: 100 samples, batch_size=4; rank 1: 99 samples, batch_size=4"):
        check_same_training_data(100 - rank, 4)
    with pytest.raises(ValueError, match=r"rank 0: 100 samples, batch_size=4; rank 1: 100 samples, batch_size=None"):
        check_same_training_data(100, None if rank else 4)
    check_same_training_data(100, 4, "a" * 64)
    # Files split by rank into equal sizes (each rank its own documents): the sizes agree, the splits do not.
    with pytest.raises(ValueError, match=r"rank 0: 100 samples, batch_size=4, split 000000000000; rank 1: 100"
                                         r" samples, batch_size=4, split 111111111111\)"):
        check_same_training_data(100, 4, str(rank) * 64)


@pytest.mark.timeout(60)
def test_ranks_with_different_training_data_are_refused_on_every_rank(tmp_path):
    run_processes(2, tmp_path, check_on_each_rank)


def replicas_built_apart(rank: int, world_size: int) -> None:
    torch.manual_seed(rank)  # an unseeded initialisation: each process draws its own
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    model.register_buffer("counts", torch.full((2,), float(rank)))
    sync_data_parallel_replicas(model, dist.group.WORLD)
    torch.manual_seed(0)
    expected = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))  # rank 0's
    wanted = {**expected.state_dict(), "counts": torch.zeros(2)}
    assert model.state_dict().keys() == wanted.keys()
    for name, got in model.state_dict().items():
        torch.testing.assert_close(got, wanted[name], rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


def sharded_over_all_built_apart(rank: int, world_size: int) -> None:
    """FSDP2 over both ranks (shard_over="all"): each keeps its own parameter shard, and takes rank 0's buffer and
    unsharded frozen parameter, which FSDP2 leaves whole on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(4, 4))
    model.register_buffer("counts", torch.full((2,), float(rank)))
    model.frozen = nn.Parameter(torch.full((3,), float(rank)), requires_grad=False)
    fully_shard(model[0], mesh=init_device_mesh("cpu", (world_size,)))
    own = model[0].weight.to_local().clone()
    sync_data_parallel_replicas(model, dist.group.WORLD, sharded_over_all=True)
    assert torch.equal(model[0].weight.to_local(), own)  # its own shard, not rank 0's
    assert torch.equal(model.counts, torch.zeros(2)) and torch.equal(model.frozen, torch.zeros(3))


@pytest.mark.timeout(60)
def test_data_parallel_replicas_built_apart_start_from_rank_0s_model(tmp_path):
    """Without it an unseeded model trained as two different replicas from one released gradient (DDP broadcasts
    rank 0's state; the strategy wraps no DDP)."""
    run_processes(2, tmp_path, replicas_built_apart)


@pytest.mark.timeout(60)
def test_under_shard_over_all_the_tensors_left_whole_start_from_rank_0s(tmp_path):
    """Under shard_over="all" nothing was broadcast: a buffer or frozen parameter initialised apart in each process
    differed between the data-parallel groups."""
    run_processes(2, tmp_path, sharded_over_all_built_apart)
