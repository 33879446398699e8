"""Training on CPU: let the C allocator keep freed memory for the next micro-batch instead of handing it back.

Flat clipping holds every per-sample gradient of a micro-batch until its backward ends (50 MB at the tiny preset,
micro-batch 4) and frees them all at once. glibc then returns the top of its heap to the OS (it trims once more
than twice its current mmap threshold is free there), so the next micro-batch's gradients touch fresh pages:
about 4,500 page faults, 3-5 ms, a micro-batch at that size, none in the non-DP loop. With the thresholds raised
the same pages are reused. Tensors of more than `REUSED_BLOCK_BYTES` still get their own mapping, returned when
freed, as before; the cost is that up to `KEPT_FREE_BYTES` of freed heap stays in the process (what CUDA's caching
allocator does on a GPU). Live tensor memory, which the planner, the traced peak and the benchmarks' peaks count,
is unchanged.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: glibc's largest dynamic mmap threshold on 64-bit systems: blocks up to this size come from the heap.
REUSED_BLOCK_BYTES = 32 * 2**20
#: Freed memory at the top of the heap kept in the process, not trimmed.
KEPT_FREE_BYTES = 2**30
# mallopt's parameter numbers (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# Environment variables through which a user tunes glibc's allocator; any of them set, it is left as it is.
_TUNING_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (`REUSED_BLOCK_BYTES`, `KEPT_FREE_BYTES`); whether
    they were set.

    Nothing is changed off Linux, under a C library other than glibc (an allocator preloaded in its place, such as
    jemalloc or tcmalloc, does not read these settings), or where the user already tunes glibc's allocator through
    ``MALLOC_*_`` variables or ``GLIBC_TUNABLES``: those settings stand. (Any one of them also turns off glibc's
    dynamic mmap threshold: ``MALLOC_TRIM_THRESHOLD_`` alone leaves every block above 128 KiB its own mapping.)
    """
    if not sys.platform.startswith("linux") or _tuned_by_environment():
        return False
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    # mallopt returns 1 on success.
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, REUSED_BLOCK_BYTES)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, KEPT_FREE_BYTES))


def _tuned_by_environment() -> bool:
    return (any(name in os.environ for name in _TUNING_VARIABLES)
            or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""))
