"""``longshield-plan``: exit status of ``fit``'s verdict and what it advises, ``--cp`` advice for GPU counts that
cannot split a power-of-two sequence, and ``--model`` as a local Hugging Face checkpoint folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from simulate.cli import EXIT_DOES_NOT_FIT, main
from simulate.specs import MODEL_PRESETS

# The config.json of Llama-3.2-1B as Hugging Face ships it (shapes only; no weights are read).
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 128256, "tie_word_embeddings": True, "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "hidden_act": "silu",
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


def _folder(tmp_path: Path, config: dict) -> str:
    folder = tmp_path / "my-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


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


def test_max_seq_and_recommend_exit_1_when_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys, "max-seq", "--model", "llama3.2-1b", "--gpus", "4", "--method", "v3")[0] == 0
    assert _run(capsys, "max-seq", "--model", "llama3.1-70b", "--gpus", "1", "--gpu", "a100-40")[0] == 1
    assert _run(capsys, "recommend", "--model", "llama3.2-1b", "--gpus", "4", "--seq-len", "16k")[0] == 0
    status, out = _run(capsys, "recommend", "--model", "llama3.1-70b", "--gpus", "1", "--seq-len", "1M", "--json")
    assert status == 1 and json.loads(out)["fits"] is False


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


def test_a_hugging_face_folder_plans_like_the_preset_of_its_shape(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    folder = _folder(tmp_path, LLAMA_3_2_1B)
    for argv in (["fit", "--gpus", "4", "--method", "v2", "--seq-len", "64k"], ["max-seq", "--gpus", "4"]):
        status, from_folder = _run(capsys, *argv, "--model", folder, "--json")
        _, from_preset = _run(capsys, *argv, "--model", "llama3.2-1b", "--json")
        assert status == 0
        from_folder, from_preset = json.loads(from_folder), json.loads(from_preset)
        assert from_folder.pop("model") == folder and from_preset.pop("model") == "llama3.2-1b"
        from_folder.get("plan", {}).pop("model", None), from_preset.get("plan", {}).pop("model", None)
        assert from_folder == from_preset


def test_a_run_files_model_folder_is_planned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("yaml")  # --config reads YAML (PyYAML comes with Lightning)
    folder = _folder(tmp_path, LLAMA_3_2_1B)
    run = tmp_path / "run.yaml"
    run.write_text(f"model: {{config: {json.dumps(folder)}}}\n"
                   "data: {class_path: my.Data, init_args: {seq_len: 4096}}\n"
                   "trainer: {devices: 4, precision: bf16-mixed}\n")
    status, from_file = _run(capsys, "fit", "--config", str(run), "--json")
    _, from_preset = _run(capsys, "fit", "--model", "llama3.2-1b", "--gpus", "4", "--seq-len", "4096", "--json")
    assert status == 0 and json.loads(from_file)["model"] == folder
    assert json.loads(from_file)["peak_memory_gib"] == json.loads(from_preset)["peak_memory_gib"]


def test_a_folder_is_read_without_torch(tmp_path: Path) -> None:
    folder = _folder(tmp_path, LLAMA_3_2_1B)
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers', 'lightning', 'lightning_longshield'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from simulate.specs import get_model_spec\n"
        f"print(get_model_spec({folder!r}) == get_model_spec('llama3.2-1b'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "True", result.stderr[-2000:]


def test_every_preset_round_trips_through_a_config_json(tmp_path: Path) -> None:
    from simulate.hf_config import read_hf_config

    for name, spec in MODEL_PRESETS.items():
        scaling = spec.rope_scaling
        config = {
            "model_type": "llama", "hidden_size": spec.dim, "intermediate_size": spec.ffn_dim,
            "num_hidden_layers": spec.n_layers, "num_attention_heads": spec.n_heads,
            "num_key_value_heads": spec.n_kv_heads, "vocab_size": spec.vocab_size,
            "tie_word_embeddings": spec.tie_embeddings, "max_position_embeddings": spec.max_seq_len,
            "rms_norm_eps": spec.norm_eps, "rope_theta": spec.rope_theta,
            "rope_scaling": None if scaling.factor == 1 else {
                "rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_seq_len},
        }
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        assert read_hf_config(tmp_path / name) == spec


@pytest.mark.parametrize(("config", "message"), [
    (None, "No config.json"),
    ({"model_type": "gpt2"}, "only Llama"),
    ({**LLAMA_3_2_1B, "head_dim": 128}, "head_dim=128"),
    ({**LLAMA_3_2_1B, "num_hidden_layers": -4}, "config.json: num_hidden_layers=-4: must be a positive integer"),
    ({**LLAMA_3_2_1B, "num_attention_heads": 0}, "config.json: num_attention_heads=0: must be a positive integer"),
    ({**LLAMA_3_2_1B, "num_hidden_layers": 0}, "config.json: num_hidden_layers=0"),
    ({**LLAMA_3_2_1B, "num_key_value_heads": 0}, "config.json: num_key_value_heads=0"),
    ({**LLAMA_3_2_1B, "vocab_size": -5}, "config.json: vocab_size=-5"),
    ({**LLAMA_3_2_1B, "hidden_size": 2048.5}, "config.json: hidden_size=2048.5"),
    ({**LLAMA_3_2_1B, "rope_scaling": "yes"}, "config.json: rope_scaling='yes': must be a mapping"),
])
def test_a_folder_that_is_not_a_llama_is_refused_clearly(tmp_path: Path, config: dict | None, message: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--model", str(folder), "--seq-len", "4096"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err


def test_unknown_models_name_the_presets_and_folders(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["fit", "--model", "llama9", "--seq-len", "4096"])
    error = capsys.readouterr().err
    assert "Unknown model preset 'llama9'" in error and "config.json" in error
