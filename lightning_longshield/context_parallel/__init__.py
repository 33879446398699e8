"""Context parallelism: the device mesh, head-tail sequence sharding, CP attention and the CP-aware loss.

The CP process group is ``mesh[CONTEXT_PARALLEL].get_group()`` and a rank's CP rank is
``mesh[CONTEXT_PARALLEL].get_local_rank()`` (mesh from `build_device_mesh`; the axis names are `DATA_PARALLEL` and
`CONTEXT_PARALLEL`).
"""

from lightning_longshield.context_parallel.attention import (
    ContextParallelAttention,
    apply_context_parallel_attention,
    prefix_causal_attention,
)
from lightning_longshield.context_parallel.collectives import (
    all_gather_sequence,
    all_gather_unsharded,
    gather_along_dim,
    reduce_scatter_along_dim,
    sum_over_shards,
)
from lightning_longshield.context_parallel.loss import context_parallel_per_sample_loss
from lightning_longshield.context_parallel.mesh import (
    CONTEXT_PARALLEL,
    DATA_PARALLEL,
    MESH_DIM_NAMES,
    build_all_ranks_mesh,
    build_device_mesh,
    resolve_parallel_sizes,
)
from lightning_longshield.context_parallel.sharding import (
    check_shardable,
    head_tail_chunks,
    shard_batch,
    shard_sequence,
    sharded_position_ids,
    unshard_sequence,
)

__all__ = [
    "CONTEXT_PARALLEL",
    "DATA_PARALLEL",
    "MESH_DIM_NAMES",
    "ContextParallelAttention",
    "all_gather_sequence",
    "all_gather_unsharded",
    "apply_context_parallel_attention",
    "build_all_ranks_mesh",
    "build_device_mesh",
    "check_shardable",
    "context_parallel_per_sample_loss",
    "gather_along_dim",
    "head_tail_chunks",
    "prefix_causal_attention",
    "reduce_scatter_along_dim",
    "resolve_parallel_sizes",
    "shard_batch",
    "shard_sequence",
    "sharded_position_ids",
    "sum_over_shards",
    "unshard_sequence",
]
