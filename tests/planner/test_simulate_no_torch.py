"""``simulate`` is a planner for machines without GPUs or torch: it must import and run without torch, and so must
its tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_BLOCK_AND_RUN = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'matplotlib', 'lightning', 'opacus'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, _Block())
from simulate.cli import main
main(['fit', '--model', 'llama3.2-1b', '--gpus', '4', '--method', 'v3', '--seq-len', '65536', '--json'])
"""


def test_simulate_runs_without_torch_or_matplotlib() -> None:
    result = subprocess.run([sys.executable, "-c", _BLOCK_AND_RUN], capture_output=True, text=True, check=True)
    assert json.loads(result.stdout)["fits"] is True


_RUN_PLANNER_TESTS = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'lightning', 'opacus', 'lightning_longshield'):
            raise ModuleNotFoundError('blocked: ' + name, name=name)  # as if not installed
sys.meta_path.insert(0, _Block())
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def test_planner_tests_run_without_torch() -> None:
    """This folder's tests and the conftest above them pass with torch, Lightning and lightning_longshield blocked
    (those that compare against the library skip), so the planner can be tested where torch is not installed."""
    folder = Path(__file__).parent
    root = folder.parents[1]
    this = f"{Path(__file__).relative_to(root)}::test_planner_tests_run_without_torch"
    # In this process (-n 0): a worker process would import torch past the block.
    result = subprocess.run([sys.executable, "-c", _RUN_PLANNER_TESTS, "-q", "-p", "no:cacheprovider", "-rs", "-n", "0",
                             str(folder.relative_to(root)), "--deselect", this], cwd=root, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1], result.stdout[-2000:]
