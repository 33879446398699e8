"""`lightning_longshield.privacy` is the DP mechanism and its bookkeeping: it imports nothing of Lightning (the
strategy is the Lightning glue), so it can be reviewed, tested and reused on its own."""

from __future__ import annotations

import ast
from pathlib import Path

PRIVACY = Path(__file__).resolve().parents[2] / "lightning_longshield" / "privacy"
LIGHTNING = ("lightning", "lightning_fabric", "lightning_utilities", "pytorch_lightning")


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.add(node.module)
    return modules


def test_no_privacy_file_imports_lightning():
    files = sorted(PRIVACY.rglob("*.py"))
    assert len(files) > 15 and PRIVACY / "session.py" in files
    offending = {
        str(path.relative_to(PRIVACY)): sorted(m for m in _imported_modules(path) if m.split(".")[0] in LIGHTNING)
        for path in files
    }
    assert not {name: modules for name, modules in offending.items() if modules}
