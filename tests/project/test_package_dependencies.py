"""The planner (`simulate/`) is torch-free and depends on nothing of `lightning_longshield`; only the reverse."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SIMULATE = Path(__file__).resolve().parents[2] / "simulate"


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    return modules


def test_no_simulate_file_imports_lightning_longshield_or_torch():
    offending = {
        path.name: sorted(m for m in _imported_modules(path) if m.split(".")[0] in ("lightning_longshield", "torch"))
        for path in SIMULATE.glob("*.py")
    }
    assert not {name: mods for name, mods in offending.items() if mods}


def test_the_planner_cli_runs_without_importing_torch():
    code = ("import sys; from simulate.cli import main; main(['fit', '--model', 'tiny', '--gpus', '1', '--seq-len',"
            " '1024', '--json']); assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
