"""The ``longshield-plan`` CLI: tables, ``--json`` output, errors, and the PNG plot."""

from __future__ import annotations

import json

import pytest

from simulate.cli import main


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # exactly one JSON object
    return json.loads(out)


def test_fit_json(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, "fit", "--model", "llama3.1-8b", "--gpus", "4", "--method", "v2", "--mbs", "1",
                "--seq-len", "16384")
    assert out["fits"] is True and 65 < out["peak_memory_gib"] < 80
    assert out["tokens_per_second_per_gpu"] > 0 and out["dp_gap"] >= 1
    assert {k: out[k] for k in ("model", "gpus", "method", "mbs", "seq_len", "cp", "gpu")} == dict(
        model="llama3.1-8b", gpus=4, method="v2", mbs=1, seq_len=16384, cp=4, gpu="h100")
    assert out["breakdown_gib"]["reserved"] == pytest.approx(out["peak_memory_gib"], abs=1e-2)


def test_fit_reports_oom_and_infinite_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    assert _json(capsys, "fit", "--method", "v1", "--seq-len", "16k")["fits"] is False
    out = _json(capsys, "fit", "--method", "zero-dp", "--gpus", "inf", "--seq-len", "4096")
    assert out["gpus"] == "inf" and out["fits"] is True and out["tokens_per_second_per_gpu"] is None


def test_max_seq_json(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, "max-seq", "--model", "llama3.2-1b", "--gpus", "4", "--method", "v3", "--mbs", "1")
    assert out["fits"] is True and out["max_seq_len"] >= 65536 and out["max_seq_len"] & (out["max_seq_len"] - 1) == 0
    assert out["method"] == "v3" and out["cp"] == 4 and "seq_len" not in out
    none = _json(capsys, "max-seq", "--model", "llama3.1-8b", "--gpus", "1", "--method", "zero-dp")
    assert none["max_seq_len"] is None and none["fits"] is False


def test_compare_and_recommend_json(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, "compare", "--model", "llama3.1-8b", "--gpus", "4")
    assert len(out["rows"]) == 7 * 4
    assert {"method", "mbs", "max_seq_len", "peak_memory_gib", "tokens_per_second_per_gpu"} <= set(out["rows"][0])
    rec = _json(capsys, "recommend", "--model", "llama3.1-8b", "--gpus", "4", "--seq-len", "16384")
    assert rec["fits"] is True and rec["recommendations"][0]["fits"] is True


def test_tables_render(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "--model", "llama3.1-8b", "--gpus", "4", "--method", "v2", "--seq-len", "16384"]) == 0
    text = capsys.readouterr().out
    assert "FITS" in text and "per-sample gradients" in text and "tokens/s/GPU" in text
    assert main(["compare", "--model", "llama3.2-1b", "--gpus", "4", "--methods", "v1", "v2", "--mbs", "1"]) == 0
    assert "v2" in capsys.readouterr().out
    assert main(["max-seq", "--model", "llama3.1-70b", "--gpus", "1", "--method", "v2"]) == 0
    assert "Nothing fits" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["fit", "--model", "llama9", "--seq-len", "4096"], "invalid choice"),
    (["fit", "--seq-len", "1000"], "must be a power of two, got 1000; try 512 or 1024"),
    (["fit", "--seq-len", "4096", "--mbs", "0"], "positive integer"),
    (["fit", "--seq-len", "4096", "--gpus", "0"], "positive integer or 'inf'"),
    (["fit", "--seq-len", "4096", "--cp", "3"], "must divide the GPU count"),
    (["max-seq", "--gpus", "inf", "--method", "v2"], "give --cp N with --gpus inf"),
])
def test_bad_input_exits_2_with_a_clear_error(argv: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "memory.png"
    out = _json(capsys, "plot", "--model", "llama3.2-1b", "--gpus", "4", "--methods", "zero-dp", "v2", "v3",
                "--min-seq-len", "4096", "--max-seq-len", "65536", "--out", str(path))
    assert out["path"] == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
