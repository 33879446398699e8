"""The package calls torch.distributed's collectives by the names of the installed torch (`dist_compat`): the names
torch 2.13 deprecated appear nowhere else, so no supported release prints a FutureWarning from a DP step."""

from __future__ import annotations

import ast
from pathlib import Path

import torch.distributed as dist

from lightning_longshield import dist_compat

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_longshield"
DEPRECATED = {"all_gather_into_tensor", "reduce_scatter_tensor", "_all_gather_base", "_reduce_scatter_base"}


def _attributes_named(path: Path, names: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = [f"{path.name}:{node.lineno} {node.attr}" for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr in names]
    found += [f"{path.name}:{node.lineno} {alias.name}" for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) for alias in node.names if alias.name in names]
    return found


def test_no_module_but_dist_compat_names_a_deprecated_collective():
    files = sorted(PACKAGE.rglob("*.py"))
    assert PACKAGE / "privacy" / "accumulator.py" in files
    offending = [hit for path in files if path.name != "dist_compat.py" for hit in _attributes_named(path, DEPRECATED)]
    assert not offending, offending
    # The check itself can fail: it sees the fallback in dist_compat.
    assert _attributes_named(PACKAGE / "dist_compat.py", DEPRECATED)


def test_dist_compat_picks_the_installed_torchs_names():
    assert dist_compat.all_gather_single is getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    assert dist_compat.reduce_scatter_single is getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
