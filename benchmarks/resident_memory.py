"""Resident memory of this process, for the benchmarks that report it: now (Linux) and its peak so far."""

from __future__ import annotations

import os
import resource
import sys


def current_rss_bytes() -> int:
    """Resident set size of this process now, in bytes (Linux: ``/proc/self/statm``)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
