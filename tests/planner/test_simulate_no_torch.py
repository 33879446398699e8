"""``simulate`` is a planner for machines without GPUs or torch: it must import and run without torch."""

from __future__ import annotations

import json
import subprocess
import sys

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
