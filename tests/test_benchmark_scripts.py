"""Benchmark scripts that a GPU run depends on stay runnable: each runs once at a toy size on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_cp_attention_benchmark_runs_and_reports_ratios():
    command = [sys.executable, str(BENCHMARKS / "cp_attention.py"), "--device", "cpu", "--seq-lens", "64",
               "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--repeats", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    (row,) = report["results"]
    assert row["seq_len"] == 64 and row["prefix_over_flash_share"] > 0 and row["masked_over_flash_share"] > 0
