"""Context parallelism: the device mesh (sequence sharding and CP attention build on it)."""

from lightning_longshield.context_parallel.mesh import MESH_DIM_NAMES, build_device_mesh, resolve_parallel_sizes

__all__ = ["MESH_DIM_NAMES", "build_device_mesh", "resolve_parallel_sizes"]
