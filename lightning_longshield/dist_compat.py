"""torch.distributed's single-tensor all-gather and reduce-scatter under the names of the installed torch, and a
gather of Python values that also runs without a process group.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` (same semantics) and deprecated the old names; older releases have only those. Every module
calls the two names below, so no supported release warns. Both concatenate along dim 0 of contiguous buffers.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def world_size() -> int:
    """The default process group's size; 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_gathered(value: Any) -> list[Any]:
    """``value`` (picklable) from every rank, in rank order (this one's alone without a process group); a
    collective."""
    if world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, value)
    return gathered
