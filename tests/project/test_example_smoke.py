"""The DP training example runs end to end and reports a finite privacy guarantee and a validation perplexity."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_dp_stdlib.py"
NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def readme_example_lines() -> list[str]:
    """The lines README.md shows as the example's output (its first code block after "What the example prints")."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## What the example prints", 1)[1]
    return section.split("```", 2)[1].strip().splitlines()


def as_pattern(line: str) -> re.Pattern[str]:
    """``line`` with every number free to differ (steps, epsilon, sizes and perplexity vary with the run)."""
    parts = NUMBER.split(line)
    return re.compile(NUMBER.pattern.join(re.escape(part) for part in parts))


@pytest.mark.slow
@pytest.mark.parametrize("options", [[], ["--norms", "hutchinson", "--micro-batch-size", "2"]],
                         ids=["exact", "hutchinson"])
def test_train_dp_stdlib_prints_guarantee_and_perplexity(options):
    command = [sys.executable, str(EXAMPLE), "--max-steps", "2", "--seq-len", "64", "--max-bytes", "60000", *options]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    guarantee = re.search(r"Privacy guarantee: \(epsilon=(\S+), delta=(\S+)\)-DP", result.stdout)
    perplexity = re.search(r"Validation perplexity: (\S+)", result.stdout)
    assert guarantee and perplexity, result.stdout[-3000:]
    epsilon, delta = float(guarantee[1]), float(guarantee[2])
    assert math.isfinite(epsilon) and 0 < epsilon <= 8.0
    assert 0 < delta < 1
    assert math.isfinite(float(perplexity[1])) and float(perplexity[1]) > 1
    assert "Not released: training losses" in result.stdout
    assert re.search(r"Step\s.*\b2/2\b", result.stdout), result.stdout[-3000:]  # the bar counts the run's steps
    if not options:  # README.md shows this output: every line of it is printed, up to the numbers
        for line in readme_example_lines():
            assert as_pattern(line).search(result.stdout), (line, result.stdout[-3000:])


@pytest.mark.slow
def test_finetune_hf_example_prints_guarantee_with_unit_and_exports(tmp_path):
    """Without --output-dir everything goes to a new temporary directory (under TMPDIR), printed at the end; the
    working directory is left as it was. The validation perplexity is printed before and after training."""
    example = EXAMPLE.with_name("finetune_hf.py")
    (tmp_path / "tmp").mkdir()
    (tmp_path / "cwd").mkdir()
    command = [sys.executable, str(example), "--max-steps", "2", "--seq-len", "64"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path / "cwd",
                            env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    guarantee = re.search(r"Privacy guarantee: \(epsilon=(\S+), delta=(\S+)\)-DP .*privacy unit: one document",
                          result.stdout)
    before = re.search(r"Validation perplexity before training: (\S+)", result.stdout)
    perplexity = re.search(r"Validation perplexity: (\S+) .* after training, over the tokens of the same",
                           result.stdout)
    outputs = re.search(r"Outputs .* are under (\S+)", result.stdout)
    assert guarantee and before and perplexity and outputs, result.stdout[-3000:]
    assert 0 < float(guarantee[1]) <= 8.0 and math.isfinite(float(perplexity[1])) and math.isfinite(float(before[1]))
    assert "Trained: LoRA adapters" in result.stdout
    output_dir = Path(outputs[1])
    assert output_dir.parent == tmp_path / "tmp" and not list((tmp_path / "cwd").iterdir())
    exported = output_dir / "exported"
    assert (exported / "model.safetensors").exists() and (exported / "config.json").exists()


def test_finetune_hf_prepares_only_what_its_arguments_do_not_give(tmp_path, capsys):
    """With --model-dir it wrote the random demo model anyway, and --prepare-only then said it had written the user's
    own model."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_hf", EXAMPLE.with_name("finetune_hf.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    mine = tmp_path / "my-llama"
    mine.mkdir()
    example.main(["--prepare-only", "--model-dir", str(mine), "--output-dir", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert not (tmp_path / "out" / "tiny-llama").exists() and str(mine) not in out
    assert f"Wrote {tmp_path / 'out' / 'stdlib.jsonl'}, {tmp_path / 'out' / 'stdlib_val.jsonl'}" in out
    example.main(["--prepare-only", "--model-dir", str(mine), "--data", str(tmp_path / "out" / "stdlib.jsonl"),
                  "--output-dir", str(tmp_path / "out")])
    assert "Nothing to prepare" in capsys.readouterr().out
