"""``recommend`` answers with what `LongShieldStrategy` runs: each recommendation's arguments, planned as the
pre-flight check plans them or written into the run file they describe, fit with the recommended peak; and
``recommend --config`` plans the file's LoRA rank, loss chunking, clipping and GPU count (torch-free)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from simulate import recommend
from simulate.cli import main
from simulate.config import plan_strategy
from simulate.memory import estimate_memory
from simulate.strategy_config import StrategyConfig

LIGHTNING_PRECISION = {"bf16-mixed": "bf16-mixed", "fp32": "32-true"}


def _json(capsys: pytest.CaptureFixture[str], *argv: str, status: int = 0) -> dict:
    assert main([*argv, "--json"]) == status
    return json.loads(capsys.readouterr().out)


def _run_file(path: Path, model: str, devices: int, seq_len: int, precision: str = "bf16-mixed",
              init_args: dict | None = None, **module: object) -> Path:
    """A ``longshield-train`` file: ``model`` with ``module``'s further init_args, ``devices`` GPUs, ``seq_len``."""
    yaml = pytest.importorskip("yaml")
    path.write_text(yaml.safe_dump({
        "model": {"config": model, **module},
        "data": {"class_path": "lightning_longshield.text_data.StdlibTextDataModule",
                 "init_args": {"seq_len": seq_len}},
        "trainer": {"devices": devices, "precision": LIGHTNING_PRECISION[precision],
                    "strategy": {"class_path": "lightning_longshield.LongShieldStrategy",
                                 "init_args": init_args or {}}},
    }))
    return path


def _fed_back(tmp_path: Path, capsys: pytest.CaptureFixture[str], recommendation: dict, **module: object) -> dict:
    """``fit --config`` of the run file that runs ``recommendation`` (its strategy arguments, GPUs and inputs)."""
    r = recommendation
    path = _run_file(tmp_path / "fed_back.yaml", r["model"], r["gpus"], r["seq_len"], r["precision"],
                     r["strategy_arguments"], **module)
    planned = _json(capsys, "fit", "--config", str(path), status=0 if r["fits"] else 1)
    assert (planned["method"], planned["mbs"], planned["cp"]) == (r["method"], r["mbs"], r["cp"]), (r, planned)
    return planned


def _answers(out: dict) -> list[tuple]:
    """What ``recommend`` answers: method, MBS, CP, LoRA rank and peak of each recommendation, in order."""
    return [(r["method"], r["mbs"], r["cp"], r["lora_rank"], r["peak_memory_gib"]) for r in out["recommendations"]]


def test_every_recommendation_fits_as_the_preflight_check_plans_it() -> None:
    """Over a grid of models, GPU counts, lengths and precisions, each recommendation's strategy arguments, planned
    as the pre-flight check plans them (`plan_strategy`), fit with the recommended peak. (Ranking the paper's
    prototypes instead put 5 of 1,539 out of memory as the strategy runs them.)"""
    checked = 0
    for model, gpus, seq_len, precision in itertools.product(("llama3.2-1b", "llama3.2-3b", "llama3.1-8b"),
                                                             (1, 2, 4, 8), (1024, 4096, 16384, 65536, 262144),
                                                             ("bf16-mixed", "fp32")):
        for p in recommend(model, gpus, seq_len, precision=precision):
            strategy = StrategyConfig(**p.config.strategy.as_arguments())
            planned, _ = plan_strategy(model, strategy, gpus, seq_len, precision)
            memory = estimate_memory(planned)
            assert memory.fits and memory.peak_gib == pytest.approx(p.peak_memory_gib, abs=1e-9), (
                model, gpus, seq_len, precision, strategy, p.peak_memory_gib, memory.peak_gib)
            checked += 1
    assert checked > 1000


def test_runs_the_strategy_plans_out_of_memory_are_not_recommended() -> None:
    """8B at 1k tokens: ZeRO-DP+ at MBS 1 on 2 GPUs (77 GiB as the paper's prototype, 87 GiB as the strategy runs it)
    and V1 at MBS 1, CP 1 on 4 GPUs with model states sharded over all of them (73 GiB as the prototype; the strategy
    runs it as V2, whose one-sample gradient is then captured per sample, 73 GiB; whole on each GPU, 150 GiB)."""
    assert not any(p.config.method.name == "zero-dp" for p in recommend("llama3.1-8b", 2, 1024))
    cp1 = [p for p in recommend("llama3.1-8b", 4, 1024) if p.config.method.name in ("v1", "v2")
           and (p.config.micro_batch_size, p.config.cp_size) == (1, 1)]
    assert [(p.config.method.name, p.config.shard_over) for p in cp1] == [("v2", "all")]
    one_run = recommend("llama3.2-1b", 4, 4096, methods=("v1", "v2"), mbs_options=(1,))  # V1 at MBS 1 runs as V2
    assert len(one_run) == len({(p.config.cp_size, p.config.shard_over) for p in one_run})


def test_recommendations_fed_back_to_fit_config_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each recommendation, written as the run file it describes, is planned by ``fit --config`` as recommended."""
    checked = 0
    for model, gpus, seq_len in itertools.product(("llama3.2-1b", "llama3.1-8b"), (1, 2, 4, 8), ("1k", "16k")):
        status = main(["recommend", "--model", model, "--gpus", str(gpus), "--seq-len", seq_len, "--json"])
        out = json.loads(capsys.readouterr().out)
        assert status == (0 if out["fits"] else 1)
        for recommendation in out["recommendations"]:
            planned = _fed_back(tmp_path, capsys, recommendation)
            assert planned["fits"] and planned["peak_memory_gib"] == recommendation["peak_memory_gib"]
            checked += 1
    assert checked > 100


def test_recommend_plans_the_run_files_lora_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """8B with LoRA rank 8 on 2 GPUs at 32k: the file's rank is planned (full fine-tuning fits nothing there), as
    ``--lora-rank`` plans it, and each answer fits as ``fit --config`` plans it."""
    path = _run_file(tmp_path / "lora.yaml", "llama3.1-8b", 2, 32768, init_args={"micro_batch_size": 1},
                     lora={"rank": 8})
    out = _json(capsys, "recommend", "--config", str(path))
    assert out["fits"] and {r["lora_rank"] for r in out["recommendations"]} == {8}
    assert "zero-dp" not in {r["method"] for r in out["recommendations"]}  # not modelled with LoRA
    flags = ("recommend", "--model", "llama3.1-8b", "--gpus", "2", "--seq-len", "32k")
    assert _answers(_json(capsys, *flags, "--lora-rank", "8")) == _answers(out)
    assert not _json(capsys, *flags, status=1)["fits"]
    for recommendation in out["recommendations"]:
        assert _fed_back(tmp_path, capsys, recommendation, lora={"rank": 8})["fits"]
    with pytest.raises(SystemExit) as exit_info:
        main([*flags, "--lora-rank", "8", "--methods", "zero-dp"])
    assert exit_info.value.code == 2 and "not zero-dp; drop --lora-rank" in capsys.readouterr().err


def test_recommend_plans_the_run_files_loss_chunking(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """1B at 256k on 4 GPUs with ``loss_chunk_tokens: null`` (the whole logits, 94 GiB per rank at CP 4): nothing
    fits, as ``fit --config`` says of the file; with the module's default chunking V3 does."""
    path = _run_file(tmp_path / "nochunk.yaml", "llama3.2-1b", 4, 262144,
                     init_args={"activation_checkpointing": True}, loss_chunk_tokens=None)
    assert not _json(capsys, "fit", "--config", str(path), status=1)["fits"]
    assert _json(capsys, "recommend", "--config", str(path), status=1)["recommendations"] == []
    chunked = _json(capsys, "recommend", "--config", str(path), "--loss-chunk-tokens", "auto")
    assert chunked["fits"] and {r["loss_chunk_tokens"] for r in chunked["recommendations"]} == {"auto"}
    whole = _json(capsys, "recommend", "--config", str(path), "--seq-len", "64k")
    assert whole["fits"] and {r["loss_chunk_tokens"] for r in whole["recommendations"]} == {None}
    for recommendation in whole["recommendations"]:
        assert _fed_back(tmp_path, capsys, recommendation, loss_chunk_tokens=None)["fits"]


def test_recommend_plans_the_run_files_clipping_and_gpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Per-layer clipping with its kernel is planned and recommended as strategy arguments (no ZeRO-DP+: it forms no
    per-sample gradient to clip per layer); 8 devices at CP 4 get recommendations for all 8 GPUs."""
    clipping = {"class_path": "lightning_longshield.PerLayerClipping", "init_args": {"kernel": "auto"}}
    path = _run_file(tmp_path / "per_layer.yaml", "llama3.2-1b", 1, 4096, init_args={"clipping": clipping})
    out = _json(capsys, "recommend", "--config", str(path))
    assert out["fits"] and "zero-dp" not in {r["method"] for r in out["recommendations"]}
    for recommendation in out["recommendations"]:
        assert (recommendation["clipping"], recommendation["per_layer_kernel"]) == ("per_layer", "auto")
        assert recommendation["strategy_arguments"]["clipping"] == clipping
        assert _fed_back(tmp_path, capsys, recommendation)["fits"]
    path = _run_file(tmp_path / "dp.yaml", "llama3.1-8b", 8, 65536,
                     init_args={"context_parallel_size": 4, "activation_checkpointing": True})
    out = _json(capsys, "recommend", "--config", str(path))
    assert out["gpus"] == 8 and {r["gpus"] for r in out["recommendations"]} == {8}
    assert 8 in {r["cp"] for r in out["recommendations"]}
