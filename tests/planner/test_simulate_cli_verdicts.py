"""``longshield-plan``: exit status of ``fit``'s verdict and what it advises, and ``--cp`` advice for GPU counts
that cannot split a power-of-two sequence."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from simulate.cli import EXIT_DOES_NOT_FIT, main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    status = main(list(argv))
    return status, capsys.readouterr().out


def test_fit_exits_0_when_the_run_fits_and_1_when_it_does_not(capsys: pytest.CaptureFixture[str]) -> None:
    fits = ("fit", "--model", "llama3.1-8b", "--gpus", "4", "--method", "v2", "--seq-len", "16k")
    assert _run(capsys, *fits)[0] == 0
    assert _run(capsys, *fits, "--json")[0] == 0
    oom = ("fit", "--model", "llama3.1-8b", "--gpus", "4", "--method", "v1", "--seq-len", "16k")
    assert EXIT_DOES_NOT_FIT == 1
    status, out = _run(capsys, *oom, "--json")
    assert status == 1 and json.loads(out)["fits"] is False
    status, out = _run(capsys, *oom)
    assert status == 1 and "OOM" in out
    assert "longshield-plan recommend --model llama3.1-8b --gpus 4 --seq-len 16384" in out
    assert "--method v3 (activation checkpointing) this run fits" in out


def test_the_oom_advice_keeps_the_hardware_and_leaves_out_checkpointing_when_it_is_on(
        capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _run(capsys, "fit", "--model", "llama3.1-8b", "--gpus", "1", "--gpu", "a100-40", "--method", "v3",
                       "--seq-len", "1M")
    assert status == 1
    assert "longshield-plan recommend --model llama3.1-8b --gpus 1 --seq-len 1048576 --gpu a100-40" in out
    assert "--method v3" not in out


def test_the_entry_point_exits_with_the_verdict() -> None:
    argv = ["-m", "simulate.cli", "fit", "--model", "llama3.1-8b", "--gpus", "4", "--method", "v1", "--seq-len", "16k"]
    assert subprocess.run([sys.executable, *argv], capture_output=True, timeout=120).returncode == 1


@pytest.mark.parametrize(("argv", "advice"), [
    (["fit", "--gpus", "3", "--seq-len", "16k"], "use --cp 1 "),
    (["fit", "--gpus", "6", "--seq-len", "16k"], "use --cp 2 or --cp 1 "),
    (["fit", "--gpus", "6", "--cp", "3", "--seq-len", "16k"], "use --cp 2 or --cp 1 "),
    (["max-seq", "--gpus", "3"], "use --cp 1 "),
    (["compare", "--gpus", "3"], "use --cp 1 "),
])
def test_a_gpu_count_that_cannot_split_the_sequence_gets_a_cp_that_can(
        argv: list[str], advice: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    error = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "equal chunks" in error and advice in error
    assert "pick a multiple" not in error  # no power-of-two length is a multiple of 6


def test_the_advised_cp_plans(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _run(capsys, "fit", "--model", "llama3.2-1b", "--gpus", "3", "--cp", "1", "--seq-len", "16k")
    assert status == 0 and "3 x h100 | MBS 1 | CP 1" in out
