"""``longshield-plan ... --config run.yaml`` plans the ``longshield-train`` run a user is about to launch, and
``recommend`` answers in the strategy's own arguments (torch-free)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("yaml")  # --config reads YAML (PyYAML comes with Lightning; a torch-free planner may lack it)

from simulate.cli import main  # noqa: E402
from simulate.config import method_for  # noqa: E402
from simulate.run_file import read_run_file, trainer_processes  # noqa: E402
from simulate.strategy_config import StrategyConfig  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "stdlib_tiny.yaml"

RUN = """
model:
  config: llama3.2-1b
  lora: {rank: 16}
data:
  class_path: lightning_longshield.local_text_data.LocalTextDataModule
  init_args: {seq_len: 65536, batch_size: 8}
trainer:
  devices: 2
  num_nodes: 2
  precision: bf16-mixed
  strategy:
    class_path: lightning_longshield.LongShieldStrategy
    init_args:
      target_epsilon: 8.0
      micro_batch_size: 1
      activation_checkpointing: true
      clipping: {class_path: lightning_longshield.PerLayerClipping, init_args: {kernel: torch}}
"""


def _json(capsys: pytest.CaptureFixture[str], *argv: str, status: int = 0) -> dict:
    assert main([*argv, "--json"]) == status
    return json.loads(capsys.readouterr().out)


def test_the_shipped_example_is_planned_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, "fit", "--config", str(EXAMPLE))
    assert (out["model"], out["gpus"], out["mbs"], out["seq_len"], out["method"]) == ("tiny", 1, 4, 256, "v2")
    assert out["precision"] == "fp32"  # Lightning's default precision, which the file leaves unset


def test_a_run_file_gives_every_input_and_flags_override_it(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(RUN)
    run = read_run_file(path)
    assert (run.model, run.gpus, run.seq_len, run.lora_rank, run.precision) == ("llama3.2-1b", 4, 65536, 16,
                                                                                 "bf16-mixed")
    out = _json(capsys, "fit", "--config", str(path))
    assert (out["method"], out["cp"], out["gpus"], out["lora_rank"]) == ("v3", 4, 4, 16)
    assert (out["clipping"], out["per_layer_kernel"]) == ("per_layer", "torch")
    overridden = _json(capsys, "fit", "--config", str(path), "--seq-len", "16k", "--mbs", "2")
    assert (overridden["seq_len"], overridden["mbs"], overridden["method"]) == (16384, 2, "v3")
    assert _json(capsys, "max-seq", "--config", str(path))["max_seq_len"] >= 65536


def test_recommendations_are_strategy_arguments_that_plan_as_recommended(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(RUN)
    out = _json(capsys, "recommend", "--config", str(path))
    assert out["seq_len"] == 65536 and out["fits"]
    for recommendation in out["recommendations"]:
        config = StrategyConfig.from_arguments(recommendation["strategy_arguments"])  # as init_args (plain data)
        assert method_for(config)[0] == recommendation["method"]
        assert (config.context_parallel_size, config.micro_batch_size) == (recommendation["cp"],
                                                                           recommendation["mbs"])
    assert main(["recommend", "--config", str(path)]) == 0
    assert "LongShieldStrategy(" in capsys.readouterr().out


def test_a_bad_run_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("data: {class_path: my.Data, init_args: {seq_len: -3}}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path)])
    assert exit_info.value.code == 2
    assert f"{path}: data.init_args.seq_len must be a positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(tmp_path / "missing.yaml")])
    assert "missing.yaml" in capsys.readouterr().err


def test_a_run_file_is_planned_as_the_strategy_runs_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ZeRO-DP+ from a run file is the strategy's one-backward book-keeping (as its pre-flight plans it), not the
    paper's prototype that ``--method zero-dp`` plans."""
    from simulate.config import longshield_config
    from simulate.planner import evaluate

    path = tmp_path / "run.yaml"
    path.write_text("model: {config: llama3.2-1b}\ndata: {class_path: my.Data, init_args: {seq_len: 8192}}\n"
                    "trainer:\n  devices: 4\n  precision: bf16-mixed\n  strategy:\n    init_args:"
                    " {context_parallel_size: 1, shard_over: all, norms: mixed, micro_batch_size: 2}\n")
    planned = _json(capsys, "fit", "--config", str(path))
    as_run = evaluate(longshield_config("llama3.2-1b", "zero-dp", 1, 2, 8192, data_parallel=4))
    assert planned["method"] == "zero-dp" and planned["peak_memory_gib"] == round(as_run.peak_memory_gib, 3)
    prototype = _json(capsys, "fit", "--model", "llama3.2-1b", "--gpus", "4", "--method", "zero-dp", "--mbs", "2",
                      "--seq-len", "8192")
    assert prototype["peak_memory_gib"] != planned["peak_memory_gib"]


def test_the_module_loss_chunking_is_planned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``model.init_args.loss_chunk_tokens`` and ``--loss-chunk-tokens``: ``auto`` (the default) plans one chunk's
    logits, ``none`` the whole logits (94 GiB of them per rank for 1B at 256k, CP 4)."""
    flags = ("fit", "--model", "llama3.2-1b", "--gpus", "4", "--method", "v3", "--seq-len", "256k")
    chunked, whole = _json(capsys, *flags), _json(capsys, *flags, "--loss-chunk-tokens", "none", status=1)
    assert chunked["loss_chunk_tokens"] == "auto" and whole["loss_chunk_tokens"] is None
    assert chunked["fits"] and not whole["fits"]
    assert whole["breakdown_gib"]["logits_loss"] > 90 > chunked["peak_memory_gib"]
    path = tmp_path / "run.yaml"
    path.write_text(RUN.replace("  lora: {rank: 16}", "  loss_chunk_tokens: null").replace("65536", "262144"))
    assert read_run_file(path).loss_chunk_tokens is None
    assert _json(capsys, "fit", "--config", str(path), status=1)["breakdown_gib"]["logits_loss"] > 90
    path.write_text(RUN.replace("  lora: {rank: 16}", "  loss_chunk_tokens: 0"))
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(path)])
    assert "model.init_args.loss_chunk_tokens must be 'auto', None" in capsys.readouterr().err


def test_recommended_arguments_plan_as_recommended(capsys: pytest.CaptureFixture[str]) -> None:
    """Each V2 / V3 recommendation's strategy arguments, planned as the pre-flight plans them, give the recommended
    peak: a CP group smaller than the GPU count is recommended with the ``shard_over`` the plan assumed, named."""
    from simulate.config import plan_strategy
    from simulate.memory import estimate_memory

    out = _json(capsys, "recommend", "--model", "llama3.1-8b", "--gpus", "4", "--seq-len", "16k")
    checked = [r for r in out["recommendations"] if r["method"] in ("v2", "v3")]
    assert any(r["cp"] < 4 for r in checked)
    for recommendation in checked:
        config = StrategyConfig(**recommendation["strategy_arguments"])
        assert config.shard_over == recommendation["shard_over"] == recommendation["strategy_arguments"]["shard_over"]
        planned, _ = plan_strategy("llama3.1-8b", config, 4, 16384)
        assert estimate_memory(planned).peak_gib == pytest.approx(recommendation["peak_memory_gib"], abs=1e-3)


def test_a_run_file_is_planned_with_the_layout_it_shards_over(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """4 processes at CP 2: by default each CP group holds its own model states; ``shard_over: all`` shards them over
    all 4. The file's ``shard_over`` survives ``--cp`` and ``--gpus``, and ``--shard-over`` overrides it; the output
    names the strategy's arguments that were planned."""
    path = tmp_path / "run.yaml"
    run = ("model: {config: llama3.1-8b}\ndata: {init_args: {seq_len: 16384}}\ntrainer:\n  devices: 4\n"
           "  precision: bf16-mixed\n  strategy:\n    init_args: {context_parallel_size: 2, micro_batch_size: 2,"
           " activation_checkpointing: true%s}\n")
    path.write_text(run % "")
    per_group = _json(capsys, "fit", "--config", str(path), status=1)
    assert (per_group["gpus"], per_group["cp"], per_group["shard_over"], per_group["fits"]) == (
        4, 2, "context_parallel", False)
    assert per_group["strategy_arguments"]["shard_over"] == "context_parallel"
    assert main(["fit", "--config", str(path)]) == 1
    assert "shard_over='context_parallel'" in capsys.readouterr().out
    assert _json(capsys, "fit", "--config", str(path), "--shard-over", "all")["fits"]
    path.write_text(run % ", shard_over: all")
    over_all = _json(capsys, "fit", "--config", str(path))
    assert (over_all["gpus"], over_all["cp"], over_all["shard_over"], over_all["fits"]) == (4, 2, "all", True)
    assert _json(capsys, "fit", "--config", str(path), "--gpus", "8")["shard_over"] == "all"
    assert _json(capsys, "fit", "--config", str(path), "--cp", "4")["shard_over"] == "all"


def test_book_kept_norms_are_planned_over_the_gpus_that_share_the_model_states(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``norms: mixed`` at CP 1 with the default ``shard_over``: every GPU holds the 8B model's states whole (about
    120 GiB): OOM, where ``shard_over: all`` shards them over the 4 GPUs and fits (the file and the pre-flight
    agree)."""
    from simulate.config import plan_strategy
    from simulate.memory import estimate_memory

    path = tmp_path / "run.yaml"
    run = ("model: {config: llama3.1-8b}\ndata: {init_args: {seq_len: 2048}}\ntrainer:\n  devices: 4\n"
           "  precision: bf16-mixed\n  strategy:\n    init_args: {context_parallel_size: 1, norms: mixed%s}\n")
    path.write_text(run % "")
    replicas = _json(capsys, "fit", "--config", str(path), status=1)
    assert (replicas["method"], replicas["gpus"], replicas["shard_over"]) == ("zero-dp", 4, "context_parallel")
    assert replicas["breakdown_gib"]["model_states"] > 110
    config = StrategyConfig(context_parallel_size=1, norms="mixed")
    assert not estimate_memory(plan_strategy("llama3.1-8b", config, 4, 2048)[0]).fits
    path.write_text(run % ", shard_over: all")
    over_all = _json(capsys, "fit", "--config", str(path))
    assert over_all["breakdown_gib"]["model_states"] < replicas["breakdown_gib"]["model_states"] / 2


def test_ghost_norms_book_keep_every_weight(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``norms: ghost`` book-keeps every weight (Gram matrices), where ``mixed`` materialises those whose per-sample
    gradient is smaller: at T 4096 the 1B model's every weight is materialised under ``mixed``."""
    path = tmp_path / "run.yaml"
    run = ("model: {config: llama3.2-1b}\ndata: {init_args: {seq_len: 4096}}\ntrainer:\n  devices: 4\n"
           "  precision: bf16-mixed\n  strategy:\n    init_args: {context_parallel_size: 1, shard_over: all,"
           " norms: %s}\n")
    path.write_text(run % "mixed")
    mixed = _json(capsys, "fit", "--config", str(path))
    path.write_text(run % "ghost")
    ghost = _json(capsys, "fit", "--config", str(path))
    assert ghost["strategy_arguments"]["norms"] == "ghost" and mixed["strategy_arguments"]["norms"] == "mixed"
    assert ghost["breakdown_gib"]["per_sample_grads"] < mixed["breakdown_gib"]["per_sample_grads"]
    assert ghost["breakdown_gib"]["ghost_norm"] > mixed["breakdown_gib"]["ghost_norm"]
    assert ghost["tokens_per_second_per_gpu"] < mixed["tokens_per_second_per_gpu"]  # T x T Gram matrices


def test_misspelled_strategy_arguments_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("data: {init_args: {seq_len: 256}}\n" + STRATEGY % "micro_batch_sise: 2")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and str(path) in err
    assert "no parameter 'micro_batch_sise'; did you mean 'micro_batch_size'?" in err
    path.write_text("data: {init_args: {seq_len: 256}}\n" + STRATEGY % "target_epsilon: 3, preflight: false")
    assert _json(capsys, "fit", "--config", str(path))["mbs"] == 1  # the strategy's other parameters pass


def test_the_library_parameters_are_the_modules_signatures() -> None:
    pytest.importorskip("torch")
    import inspect

    from lightning_longshield import CausalLMModule
    from lightning_longshield.local_text_data import LocalTextDataModule
    from lightning_longshield.text_data import StdlibTextDataModule
    from simulate.run_file import LIBRARY_PARAMETERS

    for module in (CausalLMModule, LocalTextDataModule, StdlibTextDataModule):
        assert LIBRARY_PARAMETERS[module.__name__] == tuple(inspect.signature(module.__init__).parameters)[1:]


@pytest.mark.parametrize("section, typo, suggested", [
    ("data", "seq_lenn", "seq_len"), ("model", "loss_chunk_tokenz", "loss_chunk_tokens")])
def test_a_misspelt_argument_of_the_librarys_modules_is_refused(section: str, typo: str, suggested: str) -> None:
    """A misspelt ``seq_len`` was planned at the data module's default length (1024 instead of 65536: "fits, 9.4
    GiB" for a run that peaks at 126 GiB); longshield-train refuses such a file."""
    from simulate.run_file import planned_run

    document = {"model": {"init_args": {"config": "tiny"}},
                "data": {"class_path": "lightning_longshield.text_data.StdlibTextDataModule",
                         "init_args": {"seq_len": 2048}}}
    document[section]["init_args"][typo] = 7
    with pytest.raises(ValueError, match=rf"{section}.init_args.{typo} is no parameter of .*did you mean"
                                         rf" '{suggested}'"):
        planned_run(document, "run.yaml")
    document[section]["init_args"].pop(typo)
    assert planned_run(document, "run.yaml").seq_len == 2048


def test_the_strategy_parameters_are_the_strategys_signature() -> None:
    pytest.importorskip("torch")
    import inspect

    from lightning_longshield.strategy import LongShieldStrategy
    from simulate.strategy_config import STRATEGY_PARAMETERS

    assert STRATEGY_PARAMETERS == tuple(inspect.signature(LongShieldStrategy.__init__).parameters)[1:]


def test_the_triton_kernel_in_a_run_file_is_refused_where_the_strategy_refuses_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(RUN.replace("kernel: torch", "kernel: triton"))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path)])
    assert exit_info.value.code == 2 and "kernel='auto'" in capsys.readouterr().err
    out = _json(capsys, "recommend", "--config", str(path))
    assert all(r["strategy_arguments"].get("clipping", {}).get("init_args", {}).get("kernel") != "triton"
               for r in out["recommendations"])


def test_run_file_values_are_named_in_errors_and_advice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad model preset names the file and key; two --config are refused; the does-not-fit advice uses the planned
    GPUs (all 4, not one CP group's 2); an error about a value from the file names the file's key."""
    path = tmp_path / "run.yaml"
    path.write_text("model: {config: nosuch}\ndata: {init_args: {seq_len: 256}}\ntrainer: {devices: 1}\n")
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(path)])
    assert f"{path}: model.init_args.config='nosuch'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path), "--config", str(path)])
    assert exit_info.value.code == 2 and "--config given 2 times" in capsys.readouterr().err
    path.write_text("model: {config: llama3.1-8b}\ndata: {init_args: {seq_len: 65536}}\ntrainer:\n  devices: 4\n"
                    "  precision: bf16-mixed\n  strategy: {init_args: {context_parallel_size: 2}}\n")
    assert main(["fit", "--config", str(path)]) == 1
    advice = capsys.readouterr().out.split("Does not fit")[1]
    assert "--gpus 4 --seq-len 65536" in advice and "with --method v3 (activation checkpointing)" in advice
    with_ac = _json(capsys, "fit", "--config", str(path), "--method", "v3", status=1)  # as the advice says
    assert f"does not fit either ({with_ac['peak_memory_gib']:.1f} GiB)" in advice
    path.write_text("model: {config: llama3.2-1b, lora: {rank: 8}}\ndata: {init_args: {seq_len: 256}}\n"
                    "trainer: {devices: 1, strategy: {init_args: {norms: mixed}}}\n")
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(path), "--method", "zero-dp"])  # the prototype, which LoRA is not modelled for
    assert f"--lora-rank is {path}'s model.init_args.lora.rank" in capsys.readouterr().err


def test_a_custom_module_is_planned_with_the_whole_logits(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """As the pre-flight check plans a module of its own; notes (also in --json) say where the plan approximates."""
    path = tmp_path / "run.yaml"
    path.write_text("model: {class_path: my.Module, init_args: {config: llama3.2-1b}}\ndata: {init_args: {seq_len:"
                    " 4096}}\ntrainer: {devices: 1, precision: bf16-true, accelerator: cpu}\n")
    assert read_run_file(path).loss_chunk_tokens is None
    out = _json(capsys, "fit", "--config", str(path))
    assert out["loss_chunk_tokens"] is None
    notes = " ".join(out["notes"])
    assert "not CausalLMModule" in notes and "bf16-true" in notes and "accelerator='cpu'" in notes


def test_a_run_file_is_planned_as_longshield_train_reads_it(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """No ``model.config``: CausalLMModule's own model (tiny), as ``longshield-train`` builds it. fp16, which the
    strategy refuses, is refused by name; LoRA with book-kept norms, which the cost model does not cover, is planned
    with materialised norms, and says so (it exited with a usage error)."""
    path = tmp_path / "run.yaml"
    path.write_text("data: {init_args: {seq_len: 256}}\ntrainer: {devices: 1}\n")
    assert _json(capsys, "fit", "--config", str(path))["model"] == "tiny"
    path.write_text("model: {class_path: my.Module}\ndata: {init_args: {seq_len: 256}}\ntrainer: {devices: 1}\n")
    assert _json(capsys, "fit", "--config", str(path), "--model", "llama3.2-1b")["model"] == "llama3.2-1b"
    path.write_text("data: {init_args: {seq_len: 256}}\ntrainer: {devices: 1, precision: 16-mixed}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path)])
    assert exit_info.value.code == 2 and "LongShieldStrategy refuses fp16" in capsys.readouterr().err
    lora = "data: {init_args: {seq_len: 256}}\nmodel: {config: llama3.2-1b, lora: {rank: 8}}\ntrainer: {devices: 1}\n"
    path.write_text(lora)
    materialized = _json(capsys, "fit", "--config", str(path))
    for norms in ("mixed", "ghost"):
        path.write_text(lora.replace("devices: 1", f"devices: 1, strategy: {{init_args: {{norms: {norms}}}}}"))
        out = _json(capsys, "fit", "--config", str(path))
        assert (out["method"], out["lora_rank"], out["peak_memory_gib"]) == ("v2", 8, materialized["peak_memory_gib"])
        assert any("planned as norms='materialize'" in note for note in out["notes"])
    assert not any("planned as norms='materialize'" in note for note in materialized["notes"])


def test_a_run_file_without_seq_len_is_planned_with_its_data_module_default(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The library's data modules build windows of their own default length when the file gives none; another
    module's default is unknown to the planner, which then asks for ``--seq-len``."""
    from simulate.run_file import DATA_MODULES_DEFAULT_SEQ_LEN

    path = tmp_path / "run.yaml"
    for name, default in DATA_MODULES_DEFAULT_SEQ_LEN.items():
        path.write_text(f"data: {{class_path: lightning_longshield.some_module.{name}, init_args: {{batch_size: 4}}}}\n"
                        "trainer: {devices: 1}\n")
        assert read_run_file(path).seq_len == default
        assert _json(capsys, "fit", "--config", str(path))["seq_len"] == default
    path.write_text("data: {class_path: my.Data}\ntrainer: {devices: 1}\n")
    assert read_run_file(path).seq_len is None
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(path)])
    assert "--seq-len" in capsys.readouterr().err


def test_the_planned_data_module_defaults_are_the_modules_own() -> None:
    pytest.importorskip("torch")
    import inspect

    from lightning_longshield.local_text_data import LocalTextDataModule
    from lightning_longshield.text_data import StdlibTextDataModule
    from simulate.run_file import DATA_MODULES_DEFAULT_SEQ_LEN

    modules = {module.__name__: module for module in (LocalTextDataModule, StdlibTextDataModule)}
    assert set(modules) == set(DATA_MODULES_DEFAULT_SEQ_LEN)
    for name, default in DATA_MODULES_DEFAULT_SEQ_LEN.items():
        assert inspect.signature(modules[name]).parameters["seq_len"].default == default


STRATEGY = "trainer:\n  devices: 1\n  strategy:\n    init_args: {%s}\n"


@pytest.mark.parametrize("body, message", [
    ("trainer: [1\n", "not valid YAML: while parsing a flow sequence"),
    ("trainer: [1, 2]\n", "trainer must be a mapping of arguments"),
    (STRATEGY % "activation_checkpointing: 'yes'", "activation_checkpointing must be a bool, an int or a callable"),
    (STRATEGY % "clipping: {thresholds: 5}", "PerLayerClipping(thresholds=...) must be one of"),
    (STRATEGY % "norms: {estimator: hutchpp, dim: 3}", "ProjectedNorms has no parameter 'dim'"),
    (STRATEGY % "communication_bucket_mb: '25'", "communication_bucket_mb must be a number of megabytes"),
    ("trainer: {devices: 1, strategy: {class_path: x.LongShieldStrategy, init_args: [1, 2]}}\n",
     "trainer.strategy.init_args must be a mapping of arguments"),
    ("model: {config: 5}\n", "model.init_args.config=5: the planner reads a model preset name"),
    ("model: {lora: {rank: eight}}\n", "model.init_args.lora.rank must be a positive integer, got 'eight'"),
    ("trainer: {devices: 1, precision: 64-true}\n", "trainer.precision='64-true' is not one the planner models"),
])
@pytest.mark.parametrize("command", ["fit", "max-seq", "recommend"])
def test_a_broken_run_file_exits_2_naming_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      command: str, body: str, message: str) -> None:
    """Whatever is wrong in the file, the answer is exit status 2 (invalid input, not "does not fit") and one line
    naming the file and the problem, never a traceback."""
    path = tmp_path / "run.yaml"
    path.write_text("data: {init_args: {seq_len: 256}}\n" + body)
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--config", str(path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"longshield-plan {command}: error: {path}: ")
    assert message in err.strip().splitlines()[-1]


def test_a_null_precision_is_lightnings_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``trainer.precision: null`` trains at Lightning's default, 32-true, and is planned so (fp32), like an unset
    precision."""
    path = tmp_path / "run.yaml"
    path.write_text("data: {init_args: {seq_len: 256}}\ntrainer: {devices: 1, precision: null}\n")
    assert read_run_file(path).precision == "fp32"
    assert _json(capsys, "fit", "--config", str(path))["precision"] == "fp32"
    assert _json(capsys, "recommend", "--config", str(path))["precision"] == "fp32"


@pytest.mark.parametrize("trainer, processes", [
    (dict(devices=[0, 1]), 2), (dict(devices="0,1,2", num_nodes=2), 6), (dict(devices="4"), 4),
    (dict(devices=2, num_nodes=3), 6), (dict(devices="auto"), None), (dict(devices=-1), None), (dict(), None),
])
def test_a_run_files_gpus_are_its_devices_times_its_nodes_where_it_counts_them(trainer, processes):
    """Lightning's device forms: a count, a list of indices, "0,1"; "auto" and -1 are counted where the run starts,
    so the planner asks for --gpus."""
    assert trainer_processes(trainer, "run.yaml") == processes


def test_a_run_file_of_no_devices_is_refused():
    with pytest.raises(ValueError, match="run.yaml: trainer.devices must be a positive integer, got 0"):
        trainer_processes(dict(devices=0), "run.yaml")


def test_every_one_string_form_of_the_strategy_longshield_train_builds_is_planned():
    """``trainer.strategy`` as a registry name, a class path or the bare class name: longshield-train builds
    LongShieldStrategy with its defaults from each (checked where torch is installed), and the planner plans each
    so."""
    from simulate.run_file import STRATEGY_NAMES, planned_run

    for name in sorted(STRATEGY_NAMES):
        assert planned_run({"model": {"config": "tiny"}, "trainer": {"strategy": name}}).strategy is not None
    with pytest.raises(ValueError, match="is not LongShieldStrategy"):
        planned_run({"model": {"config": "tiny"}, "trainer": {"strategy": "ddp"}})
    pytest.importorskip("torch")
    pytest.importorskip("jsonargparse")
    from lightning_longshield import LongShieldStrategy
    from lightning_longshield.cli import strategy_class

    assert all(issubclass(strategy_class(name), LongShieldStrategy) for name in STRATEGY_NAMES)


def test_a_run_files_overlap_and_bucket_are_planned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``overlap_communication: false`` reduce-scatters after each block's backward instead of behind the next
    one's: slower, and named in the arguments it is planned as; a bucket size other than the default is noted."""
    path = tmp_path / "run.yaml"
    run = ("model: {config: llama3.2-1b}\ndata: {init_args: {seq_len: 8192}}\ntrainer:\n  devices: 8\n"
           "  precision: bf16-mixed\n  strategy:\n    init_args: {micro_batch_size: 4%s}\n")
    path.write_text(run % "")
    overlapped = _json(capsys, "fit", "--config", str(path))
    path.write_text(run % ", overlap_communication: false, communication_bucket_mb: 0")
    exposed = _json(capsys, "fit", "--config", str(path))
    assert exposed["tokens_per_second_per_gpu"] < 0.97 * overlapped["tokens_per_second_per_gpu"]
    assert exposed["strategy_arguments"]["overlap_communication"] is False
    assert "overlap_communication" not in overlapped["strategy_arguments"]
    assert any("communication_bucket_mb" in note for note in exposed["notes"])
    assert not any("communication_bucket_mb" in note for note in overlapped["notes"])


def test_gpus_given_on_the_command_line_lay_out_book_kept_norms_as_the_file_would(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Book-kept norms at CP 2 plan one context-parallel group's GPUs (`zero_dp_layout`) from the GPU count that
    stands after ``--gpus``, as a file with that many devices plans."""
    run = ("model: {config: llama3.1-8b}\ndata: {init_args: {seq_len: 2048}}\ntrainer: {devices: %d, precision:"
           " bf16-mixed, strategy: {init_args: {context_parallel_size: 2, norms: mixed}}}\n")
    (tmp_path / "four.yaml").write_text(run % 4)
    (tmp_path / "eight.yaml").write_text(run % 8)
    overridden = _json(capsys, "fit", "--config", str(tmp_path / "four.yaml"), "--gpus", "8", status=1)
    as_file = _json(capsys, "fit", "--config", str(tmp_path / "eight.yaml"), status=1)
    assert overridden["peak_memory_gib"] == as_file["peak_memory_gib"] and overridden["gpus"] == as_file["gpus"] == 2


def test_a_module_of_its_own_needs_model_and_model_replaces_the_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A module whose model the planner cannot read is not planned as a default preset in silence; ``--model``
    replaces a file's model even where the file's folder is missing."""
    own = tmp_path / "own.yaml"
    own.write_text("model: {class_path: my.Module, init_args: {hidden: 128}}\ndata: {init_args: {seq_len: 2048}}\n"
                   "trainer: {devices: 2, precision: bf16-mixed}\n")
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(own)])
    assert "give --model" in capsys.readouterr().err
    assert _json(capsys, "fit", "--config", str(own), "--model", "llama3.2-1b")["model"] == "llama3.2-1b"
    missing = tmp_path / "missing.yaml"
    missing.write_text(f"model: {{config: {tmp_path / 'no-such-model'}}}\ndata: {{init_args: {{seq_len: 2048}}}}\n"
                       "trainer: {devices: 2, precision: bf16-mixed}\n")
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(missing)])
    assert "no-such-model" in capsys.readouterr().err
    assert _json(capsys, "fit", "--config", str(missing), "--model=llama3.2-1b")["model"] == "llama3.2-1b"
