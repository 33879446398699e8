"""torch.distributed's single-tensor all-gather and reduce-scatter under the names of the installed torch.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` (same semantics) and deprecated the old names; older releases have only those. Every module
calls the two names below, so no supported release warns. Both concatenate along dim 0 of contiguous buffers.
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
