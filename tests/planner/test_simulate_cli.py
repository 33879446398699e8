"""The ``longshield-plan`` CLI: tables, ``--json`` output, errors, and the PNG plot."""

from __future__ import annotations

import json

import pytest

from simulate.cli import main


def _json(capsys: pytest.CaptureFixture[str], *argv: str, status: int = 0) -> dict:
    assert main([*argv, "--json"]) == status
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
    assert _json(capsys, "fit", "--method", "v1", "--seq-len", "16k", status=1)["fits"] is False
    out = _json(capsys, "fit", "--method", "zero-dp", "--gpus", "inf", "--seq-len", "4096")
    assert out["gpus"] == "inf" and out["fits"] is True and out["tokens_per_second_per_gpu"] is None


def test_fit_per_layer_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    """``--per-layer-kernel`` (default torch, as the strategy's): echoed; the fused plan (one GPU, CP 1) does more
    compute and holds fewer per-sample bytes than the PyTorch path; the title says which one ran."""
    argv = ("fit", "--model", "llama3.2-1b", "--gpus", "1", "--method", "v2", "--mbs", "2", "--seq-len", "1024",
            "--clipping", "per_layer")
    fused, torch_path = (_json(capsys, *argv, "--per-layer-kernel", kernel) for kernel in ("auto", "torch"))
    assert (fused["per_layer_kernel"], torch_path["per_layer_kernel"]) == ("auto", "torch")
    assert fused["tokens_per_second_per_gpu"] < torch_path["tokens_per_second_per_gpu"]
    assert main([*argv, "--per-layer-kernel", "auto"]) == 0
    assert "per_layer clipping (fused kernels)" in capsys.readouterr().out
    assert main([*argv]) == 0 and "per_layer clipping |" in capsys.readouterr().out  # the strategy's default


def test_max_seq_json(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, "max-seq", "--model", "llama3.2-1b", "--gpus", "4", "--method", "v3", "--mbs", "1")
    assert out["fits"] is True and out["max_seq_len"] >= 65536 and out["max_seq_len"] & (out["max_seq_len"] - 1) == 0
    assert out["method"] == "v3" and out["cp"] == 4 and "seq_len" not in out
    none = _json(capsys, "max-seq", "--model", "llama3.1-8b", "--gpus", "1", "--method", "zero-dp", status=1)
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
    assert main(["max-seq", "--model", "llama3.1-70b", "--gpus", "1", "--method", "v2"]) == 1
    assert "Nothing fits" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["fit", "--model", "llama9", "--seq-len", "4096"], "Unknown model preset 'llama9'"),
    (["fit", "--seq-len", "1000"], "must be a power of two, got 1000; try 512 or 1024"),
    (["fit", "--seq-len", "4096", "--mbs", "0"], "positive integer"),
    (["fit", "--seq-len", "4096", "--gpus", "0"], "positive integer or 'inf'"),
    (["fit", "--seq-len", "4096", "--cp", "3"], "must divide the GPU count"),
    (["max-seq", "--gpus", "inf", "--method", "v2"], "give --cp N with --gpus inf"),
    (["fit", "--seq-len", "3M"], "must be a power of two, got 3145728 (3M); try 2097152 or 4194304"),
    (["fit", "--seq-len", "1.5M"], "such as 16384, 16k or 1M"),
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


def test_seq_len_takes_k_and_m_suffixes(capsys: pytest.CaptureFixture[str]) -> None:
    assert _json(capsys, "fit", "--model", "llama3.2-1b", "--seq-len", "1M", status=1)["seq_len"] == 2**20 == 1048576
    assert _json(capsys, "fit", "--model", "llama3.2-1b", "--seq-len", "1m", status=1)["seq_len"] == 2**20
    assert _json(capsys, "recommend", "--model", "llama3.2-1b", "--seq-len", "16k", "--methods", "v3",
                 "--mbs", "1")["seq_len"] == 16384


@pytest.mark.parametrize(("argv", "present", "absent"), [
    # MBS 1: never "lower --mbs"; here the model states need more GPUs, and checkpointing would not help
    (["--model", "llama3.1-70b", "--gpus", "1", "--method", "v2"], ["try --gpus"], ["--mbs", "--method"]),
    # MBS 1 on a smaller GPU: more GPUs or a larger GPU; checkpointing cannot help two tokens' activations
    (["--model", "llama3.2-3b", "--gpus", "1", "--gpu", "a100-40", "--method", "v2"],
     ["try --gpus 2 --cp 2 or --gpu h100"], ["--mbs", "--method"]),
    (["--model", "llama3.1-8b", "--gpus", "4", "--method", "v1", "--mbs", "6"], ["--mbs 1", "--method v3"], []),
    # no single change is enough: the changes still open are named, MBS not among them at MBS 1
    (["--model", "llama3.1-8b", "--gpus", "1", "--method", "v1", "--gpu", "a100-40"],
     ["combine --method v3 (activation checkpointing), more GPUs and a GPU with more memory"], ["--mbs"]),
])
def test_max_seq_advice_follows_the_inputs(argv: list[str], present: list[str], absent: list[str],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["max-seq", *argv]) == 1
    text = capsys.readouterr().out
    assert "Nothing fits" in text
    advice = text.split("GiB; ", 1)[1]
    assert all(p in advice for p in present), advice
    assert not any(a in advice for a in absent), advice


@pytest.mark.parametrize("command", ["fit", "max-seq", "compare", "recommend", "plot", "trace"])
def test_help_shows_defaults(command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    if command == "trace":  # lightning_longshield's plug-in: installed with torch only
        pytest.importorskip("torch")
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps help at the terminal width
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "model preset (default: llama3.1-8b)" in text and "training precision (default: bf16-mixed)" in text
    if command != "trace":  # `trace` has no GPU type or count
        assert "GPU type (default: h100)" in text and "(default: 4)" in text
    if command == "compare":
        assert "micro-batch sizes to try (default: 1 2 4 8)" in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_plot_creates_missing_folders(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "some" / "missing" / "folder" / "memory.png"
    out = _json(capsys, "plot", "--model", "llama3.2-1b", "--methods", "v2", "--min-seq-len", "4096",
                "--max-seq-len", "16384", "--out", str(path))
    assert out["path"] == str(path) and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as exit_info:  # a folder that cannot be made: one line, no traceback
        main(["plot", "--model", "llama3.2-1b", "--methods", "v2", "--out", str(tmp_path / "a-file" / "memory.png")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Cannot write the plot to" in err and "pick another --out" in err and "Traceback" not in err
