"""README.md's "## Use" snippet runs as written and prints a privacy guarantee, so the README cannot drift."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def use_snippet(readme: str) -> str:
    """The first ```python block after the "## Use" heading."""
    section = readme.split("\n## Use\n", 1)
    assert len(section) == 2, 'README.md has no "## Use" heading'
    block = re.search(r"^```python\n(.*?)^```$", section[1], flags=re.DOTALL | re.MULTILINE)
    assert block is not None, 'no ```python block after "## Use"'
    return block[1]


def test_use_snippet_trains_and_prints_the_guarantee(tmp_path):
    script = tmp_path / "use_snippet.py"
    script.write_text(use_snippet(README.read_text(encoding="utf-8")))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    guarantee = re.search(r"Privacy guarantee: \(epsilon=(\S+), delta=(\S+)\)-DP after (\d+) steps", result.stdout)
    assert guarantee, result.stdout[-3000:]
    epsilon, delta, steps = float(guarantee[1]), float(guarantee[2]), int(guarantee[3])
    assert math.isfinite(epsilon) and 0 < epsilon <= 8.0
    assert 0 < delta < 1
    assert steps == 5  # what README.md says the snippet prints
    stated = r"It ends with a line like `Privacy guarantee: \(epsilon=(\S+), delta=\S+\)-DP after (\d+) steps"
    claimed = re.search(stated, README.read_text(encoding="utf-8"))
    assert claimed and (claimed[1], int(claimed[2])) == (guarantee[1], steps), "README.md's stated output drifted"
