"""Measurements in fresh processes forked from a server that imported the libraries once per driver, instead of a new
interpreter each (about 10 s of imports on 2 CPU cores). Such a process has touched no device and allocated nothing
of a measurement's, so what it measures is its own, as in a process started afresh."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any, Optional

#: What the server imports. Installed modules, not this folder's: Python 3.11's server imports them without the
#: caller's ``sys.path``, and skips one it cannot find.
PRELOAD = ["lightning_longshield", "opacus"]


def forkserver_context() -> BaseContext:
    """The forkserver start method, its server preloading `PRELOAD` (read when it starts: at the first process)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def exit_code_of(target: Callable[..., Any], args: tuple[Any, ...], timeout: Optional[float] = None) -> Optional[int]:
    """Run ``target(*args)`` in a fresh forked process; its exit code, or ``None`` where it ran past ``timeout``
    seconds (it is then killed). ``target`` must be importable by name in the worker (a module's function)."""
    process = forkserver_context().Process(target=target, args=args)
    process.start()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
        return None
    return process.exitcode


def redirect_output(stdout_path: Optional[str], stderr_path: Optional[str]) -> None:
    """In a worker: its standard output and error (also what C++ writes) into these files; ``None`` for the standard
    output sends it to the standard error, so that nothing a library prints enters the driver's JSON."""
    if stderr_path is not None:
        _write_into(stderr_path, 2)
    if stdout_path is None:
        os.dup2(2, 1)
    else:
        _write_into(stdout_path, 1)


def _write_into(path: str, descriptor: int) -> None:
    file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(file, descriptor)
    os.close(file)
