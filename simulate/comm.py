"""Alpha-beta cost of NCCL ring collectives.

A ring collective over ``n`` ranks takes ``steps`` latency hops (``alpha`` each) and moves ``(n - 1) / n`` of the
full buffer through every rank's link (twice for an all-reduce = reduce-scatter + all-gather). Sizes are the
*full* buffer in bytes: the gathered output of an all-gather, the unreduced input of a reduce-scatter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from simulate import calibration
from simulate.specs import GPUSpec


@dataclass(frozen=True)
class Link:
    """Effective per-rank bandwidth (bytes/s, one direction) and per-hop latency of a collective's ring."""

    bandwidth: float
    latency: float


def link_for(gpu: GPUSpec, group_size: float, efficiency: float = calibration.NCCL_BUS_EFFICIENCY) -> Link:
    """The ring's bottleneck link: NVLink inside a node, the NIC once the group spans nodes (or is infinite)."""
    if group_size <= gpu.gpus_per_node:
        return Link(gpu.intra_node_bytes_per_s * efficiency, gpu.intra_node_latency_s)
    return Link(gpu.inter_node_bytes_per_s * efficiency, gpu.inter_node_latency_s)


def _ring(full_bytes: float, n: float, link: Link, passes: int) -> float:
    if n <= 1 or full_bytes <= 0:
        return 0.0
    if math.isinf(n):  # every rank still moves (almost) the whole buffer; latency grows without bound
        raise ValueError("A collective over infinitely many ranks has no finite cost; use a finite GPU count.")
    return passes * ((n - 1) * link.latency + (n - 1) / n * full_bytes / link.bandwidth)


def all_gather(full_bytes: float, n: float, link: Link) -> float:
    """Seconds to all-gather a buffer of ``full_bytes`` (gathered size) over ``n`` ranks."""
    return _ring(full_bytes, n, link, passes=1)


def reduce_scatter(full_bytes: float, n: float, link: Link) -> float:
    """Seconds to reduce-scatter an unreduced buffer of ``full_bytes`` over ``n`` ranks."""
    return _ring(full_bytes, n, link, passes=1)


def all_reduce(full_bytes: float, n: float, link: Link) -> float:
    """Seconds to all-reduce ``full_bytes`` over ``n`` ranks (ring: reduce-scatter then all-gather)."""
    return _ring(full_bytes, n, link, passes=2)


def all_to_all(full_bytes: float, n: float, link: Link) -> float:
    """Seconds for an all-to-all where each rank holds ``full_bytes / n`` and keeps 1/n of it."""
    return _ring(full_bytes / n, n, link, passes=1)
