"""The (data_parallel, context_parallel) device mesh."""

from __future__ import annotations

from typing import Optional

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DATA_PARALLEL = "data_parallel"
CONTEXT_PARALLEL = "context_parallel"
MESH_DIM_NAMES = (DATA_PARALLEL, CONTEXT_PARALLEL)


def resolve_parallel_sizes(world_size: int, context_parallel_size: Optional[int]) -> tuple[int, int]:
    """``(data_parallel_size, context_parallel_size)``; ``None`` puts every process in one CP group."""
    cp = world_size if context_parallel_size is None else context_parallel_size
    if cp < 1 or world_size % cp:
        raise ValueError(
            f"context_parallel_size={context_parallel_size} must be a positive divisor of the number of processes"
            f" ({world_size}); the data-parallel size is processes / context_parallel_size."
        )
    return world_size // cp, cp


def build_all_ranks_mesh(device_type: str, world_size: int) -> DeviceMesh:
    """A 1-D mesh of every rank in rank order (data-parallel major, TorchTitan's ``dp_shard_cp``): what FSDP2 shards
    model states over with ``shard_over="all"``."""
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("data_context_parallel",))


def build_device_mesh(device_type: str, data_parallel_size: int, context_parallel_size: int) -> DeviceMesh:
    """A 2-D mesh; ranks ``g * cp .. g * cp + cp - 1`` form context-parallel group ``g`` (peers share a batch)."""
    return init_device_mesh(
        device_type, (data_parallel_size, context_parallel_size), mesh_dim_names=MESH_DIM_NAMES
    )
