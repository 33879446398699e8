"""``longshield-train``: YAML + flags train with LongShieldStrategy, print the guarantee with its privacy unit, and
export a LoRA fine-tune that transformers loads; the installed console script exits with status 0, and a run
leaves nothing in the working directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

pytest.importorskip("jsonargparse")
transformers = pytest.importorskip("transformers")

from lightning_longshield import LongShieldStrategy  # noqa: E402
from lightning_longshield.cli import run_cli  # noqa: E402
from lightning_longshield.hf.demo import train_bpe_tokenizer, write_demo_llama  # noqa: E402
from lightning_longshield.progress import StepProgressBar  # noqa: E402
from lightning_longshield.text_data import python_stdlib_sources  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
QUICK = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false",
         "--trainer.enable_model_summary", "false"]
TINY_MODEL = json.dumps(dict(vocab_size=256, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64))


def test_yaml_run_prints_the_guarantee_with_its_privacy_unit(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = run_cli(["fit", "--config", str(CONFIGS / "stdlib_tiny.yaml"), *QUICK, "--data.init_args.max_bytes",
                   "100000", "--data.init_args.seq_len", "64", "--trainer.strategy.init_args.micro_batch_size", "8"])
    assert type(cli.trainer.strategy).__name__ == "LongShieldStrategy" and cli.trainer.global_step == 2
    out = capsys.readouterr().out
    assert "Privacy guarantee: (epsilon=" in out and "privacy unit: one window of 65 bytes" in out
    assert not list(tmp_path.iterdir())  # no config.yaml, nor anything else, in the working directory


def test_the_configuration_is_saved_only_into_a_loggers_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_cli(["fit", "--config", str(CONFIGS / "stdlib_tiny.yaml"), *QUICK, "--data.init_args.max_bytes", "100000",
             "--data.init_args.seq_len", "64", "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
             "--trainer.logger.save_dir", str(tmp_path / "logs")])
    assert [path.relative_to(tmp_path).parts[0] for path in tmp_path.rglob("config.yaml")] == ["logs"]


def test_console_script_exits_zero_and_prints_the_guarantee(tmp_path):
    script = Path(sys.executable).parent / "longshield-train"
    if not script.exists():
        pytest.skip("the longshield-train console script is not installed next to this Python")
    source = next(p for p in python_stdlib_sources() if p.stat().st_size > 20_000)
    (tmp_path / "data.txt").write_text(source.read_text(encoding="utf-8")[:20_000])
    workdir = tmp_path / "run"
    workdir.mkdir()
    command = [str(script), "fit", "--model.config", TINY_MODEL,
               "--data.class_path", "lightning_longshield.local_text_data.LocalTextDataModule",
               "--data.init_args.data_files", str(tmp_path / "data.txt"), "--data.init_args.seq_len", "32",
               "--data.init_args.cache_dir", str(tmp_path / "cache"), "--trainer.max_steps", "2",
               "--trainer.logger", "false", "--trainer.enable_checkpointing", "false", "--trainer.accelerator", "cpu",
               "--trainer.enable_model_summary", "false", "--trainer.strategy.init_args.target_epsilon", "8",
               "--trainer.strategy.init_args.micro_batch_size", "8"]
    result = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Privacy guarantee: (epsilon=" in result.stdout and "LongShieldCLI object" not in result.stderr
    assert not list(workdir.iterdir())


@pytest.mark.filterwarnings("ignore:noise_seed is set")
def test_the_saved_config_holds_no_noise_seed(tmp_path):
    """The log directory's config.yaml sits next to the checkpoints: a noise_seed saved there would undo the noise."""
    cli = run_cli(["fit", "--config", str(CONFIGS / "stdlib_tiny.yaml"), *QUICK, "--trainer.max_steps", "1",
                   "--data.init_args.max_bytes", "50000", "--data.init_args.seq_len", "32", "--trainer.logger", "true",
                   "--trainer.default_root_dir", str(tmp_path), "--trainer.strategy.init_args.noise_seed", "987654321"])
    assert cli.trainer.strategy.privacy.noise_seed == 987654321  # the run itself used it
    (saved,) = tmp_path.rglob("config.yaml")
    assert "987654321" not in saved.read_text() and "noise_seed: null" in saved.read_text()


@pytest.mark.parametrize("strategy", ["auto", "ddp", "lightning.pytorch.strategies.SingleDeviceStrategy"])
def test_a_strategy_without_dp_is_refused_unless_acknowledged(strategy, tmp_path):
    args = ["--config", str(CONFIGS / "stdlib_tiny.yaml"), "--trainer.strategy", strategy]
    forms = r"LongShieldStrategy \(or lightning_longshield.LongShieldStrategy, .*\(longshield, longshield_spawn\)"
    with pytest.raises(ValueError, match=f"trainer.strategy='{strategy}' is not LongShieldStrategy.* set it to"
                                         f" {forms}.*--non_private"):
        run_cli(args, run=False)


class SubclassedStrategy(LongShieldStrategy):
    """A user's subclass, named by its class path on the command line."""


@pytest.mark.parametrize("strategy", ["lightning_longshield.LongShieldStrategy", "LongShieldStrategy",
                                      "lightning_longshield.strategy.LongShieldStrategy", "longshield_spawn",
                                      f"{__name__}.SubclassedStrategy"])
def test_every_form_of_the_strategy_the_refusal_names_is_accepted(strategy):
    """A class path given alone stayed a string, which the check refused as "not LongShieldStrategy" (and Trainer
    would not take)."""
    cli = run_cli(["--config", str(CONFIGS / "stdlib_tiny.yaml"), "--trainer.strategy", strategy], run=False)
    expected = SubclassedStrategy if strategy.endswith("SubclassedStrategy") else LongShieldStrategy
    assert type(cli.trainer.strategy) is expected


def test_non_private_true_trains_without_dp_warns_and_prints_no_guarantee(capsys, tmp_path):
    with pytest.warns(UserWarning, match="NOT differentially private"):
        cli = run_cli(["fit", "--config", str(CONFIGS / "stdlib_tiny.yaml"), *QUICK, "--data.init_args.max_bytes",
                       "100000", "--data.init_args.seq_len", "64", "--trainer.default_root_dir", str(tmp_path),
                       "--trainer.strategy", "auto", "--non_private", "true"])
    assert cli.trainer.global_step == 2 and type(cli.trainer.strategy).__name__ == "SingleDeviceStrategy"
    captured = capsys.readouterr()
    assert "Privacy guarantee" not in captured.out and "NOT differentially private" in captured.err


def test_the_tokenizer_comes_from_the_model_directory_unless_given(tmp_path, monkeypatch):
    texts = [p.read_text(encoding="utf-8") for p in python_stdlib_sources() if 2_000 < p.stat().st_size < 8_000][:6]
    write_demo_llama(tmp_path / "hf", texts, vocab_size=300, hidden_size=32, intermediate_size=64)
    demo = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert demo["bos_token_id"] is None  # its tokenizer has no start token (transformers' default 1 is its <eos>)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    monkeypatch.setenv("HOME", str(tmp_path))  # the model as ~/hf: the model and its tokenizer both found
    args = ["--config", str(CONFIGS / "finetune_lora.yaml"), "--model.config", "~/hf",
            "--data.init_args.data_files", str(tmp_path / "docs.jsonl"), "--data.init_args.val_files", "null"]
    assert len(run_cli(args, run=False).datamodule.tokenizer) == 300
    train_bpe_tokenizer(texts, tmp_path / "other", vocab_size=280)
    explicit = run_cli([*args, "--data.init_args.tokenizer", str(tmp_path / "other")], run=False)
    assert len(explicit.datamodule.tokenizer) == 280
    by_name = run_cli(["--model.config", "~/hf", "--data", "LocalTextDataModule", "--data.data_files",
                       str(tmp_path / "docs.jsonl")], run=False)  # the class by its name, without its module
    assert type(by_name.datamodule).__name__ == "LocalTextDataModule" and len(by_name.datamodule.tokenizer) == 300


def test_any_tokenizer_file_makes_the_model_directory_the_tokenizer(tmp_path):
    """A directory with only ``tokenizer.json`` (no ``tokenizer_config.json``) holds a tokenizer; one with none is
    tokenized as bytes, with a warning that says how to fix it (the CLI and the fine-tuning example ask alike)."""
    from lightning_longshield.hf import model_tokenizer

    (tmp_path / "tokenizer.json").write_text("{}")
    assert model_tokenizer(tmp_path, "Fix it.") == str(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.warns(UserWarning, match="has no tokenizer .* tokenized as UTF-8 bytes.* Fix it."):
        assert model_tokenizer(tmp_path, "Fix it.") is None


def test_a_misspelt_lora_key_names_the_valid_keys():
    with pytest.raises(ValueError, match=r"Unknown LoRA option\(s\) \['rnk'\]: the valid keys are \['rank', 'alpha'"):
        run_cli(["--config", str(CONFIGS / "stdlib_tiny.yaml"), "--model.lora.rnk", "8"], run=False)


def test_the_progress_bar_counts_steps(tmp_path):
    args = ["--config", str(CONFIGS / "stdlib_tiny.yaml"), "--trainer.default_root_dir", str(tmp_path)]
    assert isinstance(run_cli(args, run=False).trainer.progress_bar_callback, StepProgressBar)
    quiet = run_cli([*args, "--trainer.enable_progress_bar", "false"], run=False)
    assert quiet.trainer.progress_bar_callback is None


def test_print_config_shows_the_strategy_and_lora(capsys):
    with pytest.raises(SystemExit):
        run_cli(["fit", "--config", str(CONFIGS / "finetune_lora.yaml"), "--print_config"])
    out = capsys.readouterr().out
    assert "class_path: lightning_longshield.LongShieldStrategy" in out and "rank: 8" in out


def test_training_beyond_the_checkpoints_positions_is_warned_and_exported(tmp_path):
    """A Llama-2-like window (max_position_embeddings 96) trained at seq_len 128: warned as the data is set up, and
    the export declares the length trained (it kept 96, and serving stacks cap the context there)."""
    texts = [p.read_text(encoding="utf-8") for p in python_stdlib_sources() if 2_000 < p.stat().st_size < 8_000][:12]
    write_demo_llama(tmp_path / "hf", texts, vocab_size=300, hidden_size=32, intermediate_size=64,
                     max_position_embeddings=96, rope_scaling=None)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    with pytest.warns(UserWarning, match=r"seq_len 128 is beyond the checkpoint's max_position_embeddings \(96\)"):
        run_cli(["fit", "--config", str(CONFIGS / "finetune_lora.yaml"), *QUICK, "--trainer.default_root_dir",
                 str(tmp_path), "--model.config", str(tmp_path / "hf"), "--data.init_args.data_files",
                 str(tmp_path / "docs.jsonl"), "--data.init_args.val_files", "null", "--data.init_args.seq_len", "128",
                 "--data.init_args.cache_dir", str(tmp_path / "cache"), "--export_to", str(tmp_path / "out")])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["max_position_embeddings"] == 128


def test_lora_fine_tune_from_flags_exports_a_checkpoint_transformers_loads(tmp_path):
    texts = [p.read_text(encoding="utf-8") for p in python_stdlib_sources() if 2_000 < p.stat().st_size < 8_000][:34]
    texts, public = texts[:30], texts[30:]  # validation on public documents, not held out from the private ones
    write_demo_llama(tmp_path / "hf", texts, vocab_size=300, hidden_size=32, intermediate_size=64)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in public))
    cli = run_cli(["fit", "--config", str(CONFIGS / "finetune_lora.yaml"), *QUICK,
                   "--trainer.default_root_dir", str(tmp_path),
                   "--model.config", str(tmp_path / "hf"), "--data.init_args.data_files", str(tmp_path / "docs.jsonl"),
                   "--data.init_args.val_files", str(tmp_path / "val.jsonl"), "--data.init_args.seq_len", "64",
                   "--data.init_args.cache_dir", str(tmp_path / "cache"), "--export_to", str(tmp_path / "out"),
                   "--export_max_shard_size", "64KB"])
    assert all(".lora_" in name for name, p in cli.model.named_parameters() if p.requires_grad)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()  # in shards of at most 64 KB
    assert len(cli.datamodule.tokenizer) == 300  # the model directory's tokenizer, not given in the flags or YAML
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    ids = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, cli.model.model(ids), rtol=1e-4, atol=1e-4)
    # The model directory's tokenizer and special tokens come along: the export is usable on its own.
    assert len(transformers.AutoTokenizer.from_pretrained(tmp_path / "out")) == 300
    source_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported.config.eos_token_id == source_config["eos_token_id"] is not None


def test_an_unknown_export_dtype_is_refused_before_training():
    with pytest.raises(ValueError, match=r"--export_dtype 'float8' is not one of \['float32', 'bfloat16', 'float16'\]"):
        run_cli(["--config", str(CONFIGS / "stdlib_tiny.yaml"), "--export_dtype", "float8"], run=False)


def test_the_command_prints_a_configuration_error_as_its_message_without_the_noise_seed(capsys):
    """jsonargparse's error for a strategy that refuses its arguments ends with a dump of the parsed values, the
    noise_seed among them, after two chained tracebacks: the command prints the reason alone, with status 2."""
    from lightning_longshield.cli import main

    args = ["fit", "--config", str(CONFIGS / "stdlib_tiny.yaml"), "--trainer.strategy.init_args.noise_seed", "424242"]
    with pytest.raises(SystemExit) as stopped:
        main([*args, "--trainer.strategy.init_args.secure_mode", "true"])
    said = capsys.readouterr().err
    assert stopped.value.code == 2 and "424242" not in said and "Traceback" not in said
    assert said.strip().endswith("longshield-train: error: secure_mode=True draws the noise and the sampling from OS"
                                 " entropy; remove noise_seed (reproducible noise is for tests) or set"
                                 " secure_mode=False.")
    with pytest.raises(SystemExit):
        main(["validate", "--config", str(CONFIGS / "stdlib_tiny.yaml"), "--export_to", "out"])
    assert "--export_to exports the model a fit trained; validate trains nothing" in capsys.readouterr().err


def test_subcommands_without_their_data_name_the_fix(tmp_path, monkeypatch, capsys):
    from lightning_longshield.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["test", "--config", str(CONFIGS / "stdlib_tiny.yaml")])
    assert "StdlibTextDataModule has no test_dataloader (its splits are training and validation)" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["fit", "--trainer.max_steps", "1"])
    assert "longshield-train fit needs data: pass --data" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no lightning_logs left behind


def test_a_fit_stopped_by_sigterm_says_that_nothing_was_exported(tmp_path, monkeypatch, capsys):
    """SIGTERM ends the job's script with status 0 and no end of fit: a pipeline would go on without the export."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    def stopped(*args, **kwargs):
        raise SIGTERMException()

    monkeypatch.setattr(L.Trainer, "fit", stopped)
    with pytest.raises(SIGTERMException):
        run_cli(["fit", "--config", str(CONFIGS / "stdlib_tiny.yaml"), *QUICK, "--export_to", str(tmp_path / "out")])
    assert "Stopped by SIGTERM before the end of fit: nothing was exported to" in capsys.readouterr().err


def test_a_bad_export_shard_size_is_refused_before_training():
    with pytest.raises(ValueError, match="max_shard_size='5 parsecs' is not a size"):
        run_cli(["--config", str(CONFIGS / "stdlib_tiny.yaml"), "--export_max_shard_size", "5 parsecs"], run=False)


def test_an_export_destination_it_could_not_write_is_refused_before_training(tmp_path):
    (tmp_path / "afile").write_text("")
    args = ["--config", str(CONFIGS / "stdlib_tiny.yaml")]
    with pytest.raises(ValueError, match="--export_to .* lies under .*afile'.*a file: name a folder"):
        run_cli([*args, "--export_to", str(tmp_path / "afile" / "sub")], run=False)
    with pytest.raises(ValueError, match="--export_to .* is a file, not a folder"):
        run_cli([*args, "--export_to", str(tmp_path / "afile")], run=False)
    run_cli([*args, "--export_to", str(tmp_path / "new" / "deeper")], run=False)  # to be created: accepted
    assert not (tmp_path / "new").exists()


def test_a_failed_export_keeps_the_trained_model_in_a_checkpoint(tmp_path, monkeypatch):
    """The run has spent its privacy budget: an export that fails after fit leaves the trained weights in a
    checkpoint, from which the documented recipe exports them."""
    from lightning_longshield import CausalLMModule

    def failing_export(self, *args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(CausalLMModule, "save_pretrained", failing_export)
    with pytest.warns(UserWarning, match="Exporting to .* failed .* saved to .*trained_before_failed_export.ckpt"):
        with pytest.raises(OSError, match="No space left"):
            run_cli(["fit", "--config", str(CONFIGS / "stdlib_tiny.yaml"), *QUICK, "--trainer.max_steps", "1",
                     "--data.init_args.max_bytes", "50000", "--data.init_args.seq_len", "32",
                     "--trainer.default_root_dir", str(tmp_path), "--export_to", str(tmp_path / "out")])
    monkeypatch.undo()
    saved = torch.load(tmp_path / "trained_before_failed_export.ckpt", weights_only=True)
    module = CausalLMModule("tiny")
    module.configure_model()
    module.load_state_dict(saved["state_dict"])
    assert all(torch.equal(module.state_dict()[name], value) for name, value in saved["state_dict"].items())


def test_optimizer_flags_are_the_modules_own():
    """LightningCLI's --optimizer would build an optimizer before the model has parameters: only the module's
    ``optimizer`` argument chooses it."""
    with pytest.raises(SystemExit):
        run_cli(["--config", str(CONFIGS / "stdlib_tiny.yaml"), "--optimizer", "AdamW"], run=False)
    cli = run_cli(["--config", str(CONFIGS / "stdlib_tiny.yaml"), "--model.optimizer", "sgd"], run=False)
    assert cli.model.optimizer_name == "sgd"


@pytest.mark.parametrize("order", ["rank first", "targets first"])
def test_lora_flags_combine_in_any_order(order):
    """``all-linear`` is a value of the field, not a mapping that would replace the rank given before it."""
    flags = [["--model.lora.rank", "4"], ["--model.lora.alpha", "32"], ["--model.lora.target_modules", "all-linear"]]
    if order == "targets first":
        flags.reverse()
    cli = run_cli(["--config", str(CONFIGS / "stdlib_tiny.yaml"), *[f for pair in flags for f in pair]], run=False)
    lora = cli.model.lora
    assert (lora.rank, lora.alpha) == (4, 32.0) and lora.target_modules == ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
