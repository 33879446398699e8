"""Run a test function in N fresh processes joined by a gloo process group (file rendezvous, no ports)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, store_path: str, fn: Callable[..., Any], args: tuple[Any, ...],
            timeout: timedelta) -> None:
    # Lightning sees an externally launched process (like torchrun) and reuses the initialised group.
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
        helpers = sys.modules.get("tests.support.helpers")
        if helpers is not None:  # a forked worker ends in os._exit, which runs no finalizer
            helpers.TRAINER_ROOTS.cleanup()


def run_processes(world_size: int, tmp_path: Path, fn: Callable[..., Any], *args: Any,
                  timeout: timedelta = timedelta(seconds=120)) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes; any rank's exception fails the caller, and a
    collective that waits longer than ``timeout`` (a deadlock) fails its rank.

    The forkserver start method (where available) forks workers from a server that imported the test modules once,
    instead of re-importing torch and Lightning in every worker.
    """
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if method == "forkserver":
        forkserver_context()
    mp.start_processes(
        _worker, args=(world_size, str(tmp_path / "store"), fn, args, timeout), nprocs=world_size, join=True,
        start_method=method,
    )


def forkserver_context() -> Any:
    """The forkserver start method, its server preloading the library (read when this worker's server starts: at
    its first process)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["lightning_longshield"])
    return context
