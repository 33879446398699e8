"""Fixtures for every test folder. Nothing here imports torch: the planner's tests (``tests/planner``) run where
torch is not installed."""

import os
import random
import socket
import sys
import warnings

import pytest

# The suite runs in pytest-xdist workers (``-n`` in pyproject.toml). Each worker's torch would start an OpenMP thread
# per core, and two workers' threads spinning on two cores made the audit tests 10x slower: the cores are shared out
# instead, before any test imports torch.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
if WORKERS > 1:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // WORKERS)))

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*`isinstance\\(treespec, LeafSpec\\)`.*")

# Below Linux's default ephemeral range (32768-60999): a port found free there cannot be taken in the meantime by
# the outgoing connections (gloo, TCPStore clients) that draw their local ports from the ephemeral range.
RENDEZVOUS_PORTS = range(20000, 32000)


def free_rendezvous_port() -> int:
    """A TCP port outside the ephemeral range that nothing listens on now, from this worker's share of them (so that
    two workers never pick the same free port at once)."""
    for port in random.sample(RENDEZVOUS_PORTS[WORKER::WORKERS], 100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"No free TCP port in {RENDEZVOUS_PORTS}.")


@pytest.fixture(autouse=True)
def isolated_process_group():
    """Each test gets its own rendezvous port, starts without a process group and leaves the environment it found.

    An in-process ``Trainer`` leaves its (single-rank) process group listening on ``MASTER_PORT`` and that port in
    ``os.environ``; a later subprocess or spawned run would inherit the port and fail with EADDRINUSE. A port that
    Lightning picks itself comes from the ephemeral range and can be taken by another connection before the
    spawned rank 0 binds it.
    """
    environ = dict(os.environ)
    os.environ["MASTER_PORT"] = str(free_rendezvous_port())
    yield
    # Only a test that imported torch can have started a process group; a torch-free test leaves torch unimported.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
