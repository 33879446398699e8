"""On CPU the strategy lets glibc keep freed memory, so that a micro-batch's per-sample gradients reuse the last one's
pages instead of faulting in fresh ones; a user's own allocator settings are left alone."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

import lightning_longshield.strategy as strategy_module
from lightning_longshield import LongShieldStrategy
from tests.support.helpers import RandomTokens, loader, make_module, make_trainer, small_config

glibc_only = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                                reason="glibc's allocator settings")

# Rounds of 20 tensors of 3 MiB (more than twice glibc's dynamic trim threshold), freed together as flat clipping
# frees a micro-batch's per-sample gradients; prints whether the settings were applied and the page faults of the
# rounds after the first.
PROBE = """
import ctypes, resource, sys
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: faults count 4 KiB pages, never a huge page's 512
import torch
from lightning_longshield.cpu_allocator import retain_freed_memory
applied = retain_freed_memory() if sys.argv[1] == "retain" else False
def round_():
    tensors = [torch.ones(3 * 2**18) for _ in range(20)]
    del tensors
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    round_()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


FRESH_PAGES = 4 * 20 * 3 * 2**20 // 4096  # the timed rounds' tensors, in 4 KiB pages


def _probe(mode: str, **env: str) -> tuple[bool, int]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    result = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                            env={**environment, **env})
    applied, faults = result.stdout.split()
    return applied == "True", int(faults)


@pytest.fixture(scope="module")
def default_faults() -> int:
    applied, faults = _probe("default")
    assert not applied and faults > 100  # every round faults its pages in afresh
    return faults


@glibc_only
def test_freed_memory_is_reused_instead_of_faulted_in_again(default_faults):
    applied, faults = _probe("retain")
    # The 4 rounds' tensors span 61,440 pages. Measured with retention: 768 or 3,072 faults (at most one tensor of a
    # round fresh); without: about 61,340, or 16,124 in some runs (glibc's dynamic mmap threshold then keeps some).
    assert applied and faults < 0.1 * FRESH_PAGES and faults < default_faults / 4


@glibc_only
@pytest.mark.parametrize("variable", [("MALLOC_TRIM_THRESHOLD_", "131072"),
                                      ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072")])
def test_a_users_allocator_settings_are_left_alone(variable, default_faults):
    applied, faults = _probe("retain", **dict([variable]))
    assert not applied and faults > 0.5 * default_faults


def test_the_strategy_applies_it_when_fitting_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(strategy_module, "retain_freed_memory", lambda: calls.append(True) or True)
    make_trainer(LongShieldStrategy(noise_multiplier=1.0), max_steps=1).fit(
        make_module(small_config(n_layers=1)), loader(RandomTokens(size=8, seq_len=8), 2))
    assert calls == [True]
