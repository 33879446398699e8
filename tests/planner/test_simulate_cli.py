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


def test_recommend_prints_arguments_that_build_the_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    """The printed line took the run file's form, ``clipping={'class_path': ..., 'init_args': ...}``, which the
    strategy refuses."""
    assert main(["recommend", "--model", "llama3.2-1b", "--gpus", "1", "--seq-len", "1024", "--clipping",
                 "per_layer", "--per-layer-kernel", "auto"]) == 0
    line = next(text.strip() for text in capsys.readouterr().out.splitlines()
                if text.strip().startswith("LongShieldStrategy("))
    assert "class_path" not in line and "PerLayerClipping(" in line
    pytest.importorskip("torch")
    from lightning_longshield import LongShieldStrategy, PerLayerClipping

    strategy = eval(line, {"LongShieldStrategy": LongShieldStrategy, "PerLayerClipping": PerLayerClipping})
    assert strategy.config.per_layer is not None


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
    (["plot", "--max-seq-len", "1000"], "must be a power of two, got 1000; try 512 or 1024"),
    (["fit", "--seq-len", "4096", "--mbs", "0"], "positive integer"),
    (["fit", "--seq-len", "4096", "--gpus", "0"], "positive integer or 'inf'"),
    (["fit", "--seq-len", "4096", "--cp", "3"], "CP size 3 (--cp) must divide the GPU count 4 (--gpus)"),
    (["max-seq", "--gpus", "inf", "--method", "v2"], "give --cp N with --gpus inf"),
    (["recommend", "--gpus", "inf", "--seq-len", "4096"], "with --gpus inf, recommend --methods zero-dp alone"),
    (["plot", "--min-seq-len", "3M"], "must be a power of two, got 3145728 (3M); try 2097152 or 4194304"),
    (["fit", "--seq-len", "12001"], "Sequence length 12001 cannot be cut into 2 x CP = 8 equal chunks"),
    (["compare", "--gpus", "inf", "--methods", "v2"], "CP methods need a CP size: give --cp N"),
    (["fit", "--seq-len", "1.5M"], "such as 16384, 16k or 1M"),
    (["fit", "--seq-len", str(2**100)], "must be at most 16,777,216 (the planner's limit"),  # was 0 tokens/s
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


def test_fit_and_recommend_take_lengths_that_are_not_powers_of_two(capsys: pytest.CaptureFixture[str]) -> None:
    """The strategy trains any multiple of 2 x CP; fit's advice for such a run names a recommend that runs."""
    out = _json(capsys, "fit", "--model", "llama3.1-8b", "--gpus", "4", "--mbs", "4", "--seq-len", "12000", status=1)
    assert out["seq_len"] == 12000
    assert _json(capsys, "recommend", "--model", "llama3.2-1b", "--gpus", "4", "--seq-len", "12000")["seq_len"] == 12000


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


def test_fit_plans_the_strategys_default_shard_over(capsys: pytest.CaptureFixture[str]) -> None:
    """8 GPUs at CP 2: by default each of the 4 CP groups holds the model states (OOM, as the pre-flight check says
    for the same strategy); ``--shard-over all`` shards them over all 8. Both name the arguments planned."""
    argv = ("fit", "--model", "llama3.1-8b", "--gpus", "8", "--cp", "2", "--method", "v3", "--seq-len", "64k")
    per_group = _json(capsys, *argv, status=1)
    assert per_group["shard_over"] == "context_parallel" and per_group["peak_memory_gib"] > 85
    assert per_group["strategy_arguments"] == {"context_parallel_size": 2, "shard_over": "context_parallel",
                                               "activation_checkpointing": True}
    over_all = _json(capsys, *argv, "--shard-over", "all")
    assert over_all["fits"] and over_all["strategy_arguments"]["shard_over"] == "all"
    assert main([*argv, "--shard-over", "all"]) == 0
    assert "LongShieldStrategy(context_parallel_size=2, shard_over='all'" in capsys.readouterr().out


def test_huge_gpu_counts_are_refused_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["fit", "--seq-len", "16k"], ["max-seq"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*command, "--gpus", "100000000000000000000"])
        assert exit_info.value.code == 2 and "is above the 1,048,576 GPUs" in capsys.readouterr().err
    assert _json(capsys, "fit", "--seq-len", "16k", "--gpus", "1048576", "--cp", "1024", "--method", "v3",
                 "--model", "llama3.2-1b")["gpus"] == 1048576


def test_max_seq_says_where_the_search_stops(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, "max-seq", "--model", "tiny", "--gpus", "64", "--method", "v3")
    assert out["max_seq_len"] == 2**24 and out["at_search_limit"]
    assert main(["max-seq", "--model", "tiny", "--gpus", "64", "--method", "v3"]) == 0
    assert "at least 16,777,216 (the search limit)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["max-seq", "--gpus", "inf", "--cp", "16777216", "--method", "v3"])
    assert exit_info.value.code == 2 and "beyond the search limit" in capsys.readouterr().err


def test_small_inputs_read_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    """Throughput in significant figures, never "0"; one token cannot be split, so a longer --seq-len is advised;
    a plot's range the wrong way round names both flags."""
    from simulate.cli import _tps

    assert (_tps(0.0123), _tps(42.5), _tps(1803.6)) == ("0.0123", "42.5", "1,804")
    with pytest.raises(SystemExit):
        main(["fit", "--seq-len", "1", "--gpus", "4"])
    err = capsys.readouterr().err
    assert "use a longer --seq-len" in err and "--gpus" not in err.split("; ")[-1]
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", "--min-seq-len", "1M", "--max-seq-len", "1k"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--min-seq-len 1048576 is above --max-seq-len 1024" in err


def test_v1_is_the_papers_prototype_and_says_so(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--method v1`` plans the paper's prototype (whole clipped sum on each CP rank), with a note; a run file with
    ``exchange: all_reduce`` plans the strategy's V1 (its shard of the clipped sum)."""
    pytest.importorskip("yaml")
    argv = ("fit", "--model", "llama3.2-1b", "--gpus", "4", "--method", "v1", "--mbs", "2", "--seq-len", "16k")
    prototype = _json(capsys, *argv)
    assert any("the paper's V1 prototype" in note for note in prototype["notes"])
    path = tmp_path / "run.yaml"
    path.write_text("model: {config: llama3.2-1b}\ndata: {init_args: {seq_len: 16384}}\ntrainer:\n  devices: 4\n"
                    "  precision: bf16-mixed\n  strategy: {init_args: {exchange: all_reduce, micro_batch_size: 2}}\n")
    as_run = _json(capsys, "fit", "--config", str(path))
    assert as_run["method"] == "v1" and not as_run["notes"]
    assert as_run["breakdown_gib"]["model_states"] < prototype["breakdown_gib"]["model_states"]


def test_dp_pays_what_the_strategy_communicates(capsys: pytest.CaptureFixture[str]) -> None:
    """At micro-batch 1 the sample's gradient is FSDP's reduce-scattered ``.grad``, as without DP: DP is no longer
    predicted faster than non-DP there (it was 0.69x). The clipped sums' reduction over data-parallel groups, once
    per optimizer step, is reported with a note; where DP still comes out faster a note says why."""
    out = _json(capsys, "fit", "--model", "llama3.1-8b", "--gpus", "8", "--seq-len", "2048", "--method", "v3")
    assert out["dp_gap"] >= 1 and out["step_end_seconds"] == 0
    groups = _json(capsys, "fit", "--model", "llama3.1-8b", "--gpus", "8", "--cp", "2", "--shard-over", "all",
                   "--seq-len", "2048", "--method", "v3")
    assert groups["step_end_seconds"] > 0
    assert any("4 data-parallel groups are reduce-scattered" in note for note in groups["notes"])
    faster = _json(capsys, "fit", "--model", "llama3.1-8b", "--gpus", "8", "--seq-len", "2048", "--method", "v3",
                   "--mbs", "2")
    assert faster["dp_gap"] >= 1 or any("DP is predicted faster" in note for note in faster["notes"])


def test_recommend_lists_v1_at_cp_1_once_as_v2(capsys: pytest.CaptureFixture[str]) -> None:
    """At CP 1 the strategy's V1 runs V2's step (one rank: nothing to exchange): the same run was listed twice."""
    rows = _json(capsys, "recommend", "--model", "llama3.2-1b", "--gpus", "4", "--seq-len", "4096", "--methods",
                 "v1", "v2", "--mbs", "2")["recommendations"]
    assert any(row["cp"] == 1 for row in rows) and not any(row["cp"] == 1 and row["method"] == "v1" for row in rows)
    alone = _json(capsys, "recommend", "--model", "llama3.2-1b", "--gpus", "4", "--seq-len", "4096", "--methods",
                  "v1", "--mbs", "2")["recommendations"]
    assert any(row["cp"] == 1 for row in alone)  # asked for alone, V1 at CP 1 is still an answer
