"""The planner (`simulate/`) is torch-free and depends on nothing of `lightning_longshield`; only the reverse. The
model (`lightning_longshield.models`) knows nothing of Hugging Face or LoRA: loading, saving and adapters live in
`lightning_longshield.hf` and `lightning_longshield.lora`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SIMULATE = Path(__file__).resolve().parents[2] / "simulate"
MODELS = Path(__file__).resolve().parents[2] / "lightning_longshield" / "models"


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


def _imported_names(path: Path, package: str) -> set[str]:
    """Every module (and ``module.name``) that ``path`` imports anywhere, in functions too, relative imports made
    absolute against ``package``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_the_model_imports_nothing_of_hugging_face_or_lora():
    forbidden = ("lightning_longshield.hf", "lightning_longshield.lora", "transformers", "peft", "safetensors")
    paths = sorted(MODELS.glob("*.py"))
    assert {p.name for p in paths} >= {"__init__.py", "llama.py", "config.py"}
    offending = {
        path.name: sorted(name for name in _imported_names(path, "lightning_longshield.models")
                          if any(name == f or name.startswith(f"{f}.") for f in forbidden))
        for path in paths
    }
    assert not {name: mods for name, mods in offending.items() if mods}


def test_the_planner_cli_runs_without_importing_torch():
    code = ("import sys; from simulate.cli import main; main(['fit', '--model', 'tiny', '--gpus', '1', '--seq-len',"
            " '1024', '--json']); assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_parallelisation_knows_nothing_of_lora_and_the_strategy_stays_small():
    """Adapters are initialised through the LightningModule's hook, not by `parallelize`; the strategy delegates
    (configuration to `StrategyConfig`, the DP step loop, padding, checkpoints, the privacy ledger) and stays under
    400 lines."""
    package = MODELS.parent
    imported = _imported_names(package / "parallelize.py", "lightning_longshield")
    assert not any(name.startswith("lightning_longshield.lora") for name in imported), imported
    assert len((package / "strategy.py").read_text().splitlines()) < 400
