"""Hugging Face Llama checkpoints: import into `Llama` and export from it give transformers' logits exactly (fp32)."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from lightning_longshield.hf import check_weights, checkpoint, export, require_hf, shard_bytes
from lightning_longshield.models import Llama, LlamaConfig
from simulate.specs import RopeScaling
from tests.support import hf_workers
from tests.support.helpers import (
    RandomTokens,
    assert_models_close,
    full_state,
    loader,
    make_trainer,
    write_sentencepiece_tokenizer,
)
from tests.support.process_runner import run_processes

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
SIZES = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, max_position_embeddings=64)
SEQ = 24  # beyond original_max_position_embeddings, so Llama-3 scaling matters
CLOSE = dict(rtol=1e-5, atol=1e-5)
VARIANTS = {"untied": (False, None), "tied": (True, None), "llama3": (False, LLAMA3), "tied-llama3": (True, LLAMA3)}


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights everywhere, norms included (around 1), so that no tensor can be mixed up unnoticed."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)


def write_hf_llama(
    directory: Path, tie: bool = False, rope_scaling: Optional[dict] = None, max_shard_size: Any = "5GB", **sizes: Any
) -> Any:
    """Save a tiny random transformers `LlamaForCausalLM` in ``directory``; returns it (eval mode)."""
    rope_scaling = dict(rope_scaling) if rope_scaling else None  # transformers adds keys to the dict it is given
    config = transformers.LlamaConfig(**{**SIZES, **sizes}, tie_word_embeddings=tie, rope_scaling=rope_scaling,
                                      attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).eval()
    randomize_(model)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size=max_shard_size)
    return model


def hf_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def our_logits(model: Llama, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(1))


def test_weights_not_downloaded_whole_are_refused_up_front_naming_the_fix(tmp_path: Path) -> None:
    """The up-front check read only the index: a shard missing from a download cut short passed it and failed in
    ``configure_model``, after the data; a Git LFS pointer in place of the weights failed with safetensors' "header
    too large"."""
    write_hf_llama(tmp_path / "sharded", max_shard_size="20KB")
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError,
                       match=rf"{re.escape(shard.name)} is missing: .* not downloaded whole.*hf download"):
        check_weights(tmp_path / "sharded")
    write_hf_llama(tmp_path / "pointer")
    (tmp_path / "pointer" / checkpoint.WEIGHTS_FILE).write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n")
    with pytest.raises(ValueError,
                       match="is a Git LFS pointer, not the weights: .* 'git lfs pull'.* hf download <repo>"):
        check_weights(tmp_path / "pointer")
    # Cut short: safetensors said "incomplete metadata, file not fully covered", naming no file.
    write_hf_llama(tmp_path / "cut")
    weights = tmp_path / "cut" / checkpoint.WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{re.escape(str(weights))} is not a whole safetensors file .*hf download"):
        check_weights(tmp_path / "cut")
    index = tmp_path / "sharded" / checkpoint.WEIGHTS_INDEX_FILE
    for damaged, reason in ((json.dumps({"metadata": {}}), "no weight_map"), ('{"weight_map": {', "Expecting")):
        index.write_text(damaged)
        with pytest.raises(ValueError, match=rf"is not a whole safetensors index \({reason}.*hf download"):
            check_weights(tmp_path / "sharded")


@pytest.mark.parametrize(("tie", "rope_scaling"), list(VARIANTS.values()), ids=list(VARIANTS))
def test_import_gives_transformers_logits(tmp_path: Path, ids: torch.Tensor, tie: bool, rope_scaling: Any) -> None:
    hf = write_hf_llama(tmp_path, tie, rope_scaling)
    model = checkpoint.load_model(tmp_path)
    assert model.config.tie_embeddings == tie and (model.output.weight is model.tok_embeddings.weight) == tie
    assert model.config.rope_scaling.factor == (8.0 if rope_scaling else 1.0)
    torch.testing.assert_close(our_logits(model, ids), hf_logits(hf, ids), **CLOSE)


def test_llama3_scaling_changes_the_logits(tmp_path: Path, ids: torch.Tensor) -> None:
    write_hf_llama(tmp_path, rope_scaling=LLAMA3)
    model = checkpoint.load_model(tmp_path)
    scaled = our_logits(model, ids)
    model.config = dataclasses.replace(model.config, rope_scaling=RopeScaling())
    assert (our_logits(model, ids)[:, 16:] - scaled[:, 16:]).abs().max() > 1e-2


def test_loading_without_the_rope_permutation_differs(
    tmp_path: Path, ids: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf = write_hf_llama(tmp_path)
    monkeypatch.setattr(checkpoint, "to_interleaved", lambda weight, head_dim: weight)
    assert (our_logits(checkpoint.load_model(tmp_path), ids) - hf_logits(hf, ids)).abs().max() > 1e-2


def test_permutations_are_inverse() -> None:
    weight = torch.randn(24, 5)
    interleaved = checkpoint.to_interleaved(weight, 8)
    assert torch.equal(interleaved[:2, 0], weight[[0, 4], 0])  # pair (x[0], x[4]) of head 0 becomes adjacent
    assert torch.equal(checkpoint.to_halves(interleaved, 8), weight)


def test_sharded_checkpoint_loads(tmp_path: Path, ids: torch.Tensor) -> None:
    hf = write_hf_llama(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / checkpoint.WEIGHTS_INDEX_FILE).read_text())
    assert not (tmp_path / checkpoint.WEIGHTS_FILE).exists() and len(set(index["weight_map"].values())) > 1
    torch.testing.assert_close(our_logits(checkpoint.load_model(tmp_path), ids), hf_logits(hf, ids), **CLOSE)


@pytest.mark.parametrize("shard_size", ["5GB", "6KB"], ids=["one-file", "sharded"])
@pytest.mark.parametrize(("tie", "rope_scaling"), list(VARIANTS.values()), ids=list(VARIANTS))
def test_export_gives_transformers_logits(tmp_path: Path, ids: torch.Tensor, tie: bool, rope_scaling: Any,
                                          shard_size: str) -> None:
    scaling = RopeScaling(8.0, 1.0, 4.0, 16) if rope_scaling else RopeScaling()
    config = LlamaConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64,
                         rope_theta=10000.0, tie_embeddings=tie, rope_scaling=scaling)
    torch.manual_seed(0)
    model = Llama(config)
    randomize_(model)
    export.save_pretrained(model, tmp_path, max_shard_size=shard_size)
    files = checkpoint.weight_map(tmp_path)
    assert ("lm_head.weight" in files) != tie
    assert (len(set(files.values())) > 1) == (shard_size != "5GB")
    assert (tmp_path / checkpoint.WEIGHTS_INDEX_FILE).exists() == (shard_size != "5GB")
    for file in set(files.values()):  # a file beyond the limit holds one tensor alone
        with safetensors_torch.safe_open(file, "pt") as handle:
            assert len(handle.keys()) == 1 or file.stat().st_size <= shard_bytes(shard_size) + 2048
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.dtype == torch.float32
    torch.testing.assert_close(hf_logits(hf, ids), our_logits(model, ids), **CLOSE)
    assert checkpoint.read_config(tmp_path) == config
    reloaded = dict(checkpoint.load_model(tmp_path).named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(reloaded[name], param, rtol=0, atol=0)


def test_an_export_over_a_sharded_checkpoint_removes_its_index_and_shards(tmp_path: Path, ids: torch.Tensor) -> None:
    """A loader that follows the index would otherwise read the old shards beside the export's model.safetensors."""
    write_hf_llama(tmp_path, max_shard_size="20KB")
    shards = set(json.loads((tmp_path / checkpoint.WEIGHTS_INDEX_FILE).read_text())["weight_map"].values())
    (tmp_path / "notes.txt").write_text("kept")
    model = checkpoint.load_model(tmp_path)
    randomize_(model)
    with pytest.warns(UserWarning, match=f"its index and {len(shards)} shards were removed"):
        export.save_pretrained(model, tmp_path)
    assert not (tmp_path / checkpoint.WEIGHTS_INDEX_FILE).exists()
    assert not any((tmp_path / shard).exists() for shard in shards) and (tmp_path / "notes.txt").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    torch.testing.assert_close(hf_logits(hf, ids), our_logits(model, ids), **CLOSE)


def test_an_export_beside_a_malformed_index_stops_before_writing(tmp_path: Path) -> None:
    (tmp_path / checkpoint.WEIGHTS_INDEX_FILE).write_text("not json")
    with pytest.raises(ValueError, match="is not a safetensors index"):
        export.save_pretrained(Llama(LlamaConfig(vocab_size=96, dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                                     ffn_dim=64, max_seq_len=64)), tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == [checkpoint.WEIGHTS_INDEX_FILE]


def test_an_export_to_a_home_relative_folder_lands_in_home(tmp_path: Path, monkeypatch) -> None:
    """``export_to: ~/model`` (YAML, or ``--export_to=~/model``, which no shell expands) was checked in the home
    folder but written to a folder named ``~`` under the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    export.save_pretrained(Llama(LlamaConfig(vocab_size=96, dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                             ffn_dim=64, max_seq_len=64)), "~/model")
    assert (tmp_path / "home" / "model" / checkpoint.CONFIG_FILE).is_file() and not (tmp_path / "~").exists()


def test_an_export_cut_short_leaves_the_checkpoint_there_as_it_was(tmp_path: Path, monkeypatch) -> None:
    write_hf_llama(tmp_path)
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    model = checkpoint.load_model(tmp_path)
    randomize_(model)

    def disk_full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors_torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export.save_pretrained(model, tmp_path)
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before


@pytest.mark.parametrize("before", ["one-file", "sharded"])
def test_a_sharded_export_cut_short_leaves_the_checkpoint_there_as_it_was(tmp_path: Path, monkeypatch,
                                                                          before: str) -> None:
    write_hf_llama(tmp_path, **({"max_shard_size": "20KB"} if before == "sharded" else {}))
    contents = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    model = checkpoint.load_model(tmp_path)
    randomize_(model)
    save_file, written = safetensors_torch.save_file, []

    def disk_full_at_the_third_shard(tensors, filename, metadata=None):
        if len(written) == 2:
            Path(filename).write_bytes(b"partial")
            raise OSError("No space left on device")
        written.append(filename)
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors_torch, "save_file", disk_full_at_the_third_shard)
    with pytest.raises(OSError, match="No space left"):
        export.save_pretrained(model, tmp_path, max_shard_size="16KB")
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == contents


def test_a_sharded_export_cut_short_after_its_shards_never_leaves_the_old_file_in_charge(tmp_path, monkeypatch):
    """Loaders read model.safetensors before an index: an export into several files over one file, cut short after
    renaming its shards in (here writing config.json), left the old file beside them, and loading gave the old
    weights."""
    write_hf_llama(tmp_path)
    model = checkpoint.load_model(tmp_path)
    randomize_(model)
    replace_durably = export.replace_durably

    def config_fails(target, write):
        if target.name == checkpoint.CONFIG_FILE:
            raise OSError("No space left on device")
        return replace_durably(target, write)

    monkeypatch.setattr(export, "replace_durably", config_fails)
    with pytest.raises(OSError, match="No space left"):
        export.save_pretrained(model, tmp_path, max_shard_size="40KB")
    assert not (tmp_path / checkpoint.WEIGHTS_FILE).exists()
    assert len(set(checkpoint.weight_map(tmp_path).values())) > 1  # the new shards, under their index


@pytest.mark.parametrize("before", ["one-file", "sharded"])
def test_a_sharded_export_replaces_the_weights_there(tmp_path: Path, ids: torch.Tensor, before: str) -> None:
    """Over one file (which loaders read before an index) or over more shards of an earlier export: nothing of the
    old weights is left for a loader, or a glob of ``*.safetensors``, to read."""
    write_hf_llama(tmp_path, **({"max_shard_size": "4KB"} if before == "sharded" else {}))
    old = {path.name for path in tmp_path.glob("*.safetensors")}
    model = checkpoint.load_model(tmp_path)
    randomize_(model)
    if before == "sharded":
        with pytest.warns(UserWarning, match=f"its index and {len(old)} shards were removed or overwritten, replaced"
                                             " by the export's [0-9]+ shards"):
            export.save_pretrained(model, tmp_path, max_shard_size="40KB")
    else:
        export.save_pretrained(model, tmp_path, max_shard_size="40KB")
    files = set(checkpoint.weight_map(tmp_path).values())
    assert len(files) > 1 and (before == "one-file" or len(files) < len(old))  # fewer: some old shards removed
    assert {path.name for path in tmp_path.glob("*.safetensors")} == {file.name for file in files}
    assert not list(tmp_path.glob(".*partial"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    torch.testing.assert_close(hf_logits(hf, ids), our_logits(model, ids), **CLOSE)


def test_an_export_writes_each_shard_as_it_fills(tmp_path: Path, monkeypatch) -> None:
    """The writer holds one shard, not the model: the first file is written before the last tensor is gathered."""
    model = Llama(LlamaConfig(vocab_size=96, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64))
    events: list[str] = []
    save_file = safetensors_torch.save_file

    def recorded_save(tensors, filename, metadata=None):
        events.append("write")
        save_file(tensors, filename, metadata=metadata)

    def gathered():
        for name, tensor in model.state_dict().items():
            events.append("gather")
            yield name, tensor

    monkeypatch.setattr(safetensors_torch, "save_file", recorded_save)
    export.write_pretrained(gathered(), model.config, tmp_path, max_shard_size="16KB")
    assert events.count("write") > 3 and events.index("write") < len(events) // 4
    assert events[-1] == "write"  # the last shard, once everything is gathered


def test_shard_sizes_read_as_transformers_reads_them() -> None:
    assert shard_bytes("5GB") == 5 * 10**9 and shard_bytes("2GiB") == 2**31 and shard_bytes("20 kb") == 20_000
    assert shard_bytes(4096) == 4096 and shard_bytes("1.5MB") == 1_500_000
    assert shard_bytes("1000000000") == 10**9  # a command line's bytes
    for bad in ("5 parsecs", "GB", 0, -1, True, "0KB"):
        with pytest.raises(ValueError, match="max_shard_size"):
            shard_bytes(bad)


def test_dtypes_on_load_and_export(tmp_path: Path) -> None:
    write_hf_llama(tmp_path / "hf")
    model = checkpoint.load_model(tmp_path / "hf", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    export.save_pretrained(model.float(), tmp_path / "out", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "out" / checkpoint.CONFIG_FILE).read_text())["dtype"] == "bfloat16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert hf.dtype == torch.bfloat16


def test_legacy_rope_fields_read_like_rope_parameters() -> None:
    common = dict(model_type="llama", **SIZES)
    legacy = dict(common, rope_theta=5e5, rope_scaling={**LLAMA3, "type": "llama3", "rope_type": None})
    current = dict(common, rope_parameters={**LLAMA3, "rope_theta": 5e5})
    config = checkpoint.config_from_hf(current)
    assert checkpoint.config_from_hf(legacy) == config
    assert config.rope_theta == 5e5 and config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 16)
    assert checkpoint.config_from_hf(checkpoint.hf_config_dict(config)) == config


@pytest.mark.parametrize("fields", [
    # An export (both forms) whose legacy fields were edited for a longer context, as transformers 4's docs describe.
    dict(rope_theta=1e6, rope_scaling={**LLAMA3, "factor": 32.0}, rope_parameters={**LLAMA3, "rope_theta": 5e5}),
    dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5}, rope_scaling=LLAMA3, rope_theta=1e4),
    dict(rope_theta=5e5, rope_scaling={key: value for key, value in LLAMA3.items()
                                       if key != "original_max_position_embeddings"},
         original_max_position_embeddings=8),
], ids=["edited-legacy-fields", "scaling-beside-default-parameters", "top-level-original-length"])
def test_rope_fields_are_read_as_transformers_reads_them(tmp_path: Path, ids: torch.Tensor, fields: dict) -> None:
    """``rope_scaling`` takes priority over ``rope_parameters``, a mapping's ``rope_theta`` over the top-level one,
    and a top-level ``original_max_position_embeddings`` counts: read otherwise, the logits differed by up to 3.3."""
    write_hf_llama(tmp_path)
    config = json.loads((tmp_path / checkpoint.CONFIG_FILE).read_text())
    config.pop("rope_parameters", None)
    config.pop("rope_scaling", None)
    (tmp_path / checkpoint.CONFIG_FILE).write_text(json.dumps({**config, **fields}))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(our_logits(checkpoint.load_model(tmp_path), ids), hf_logits(hf_model, ids), **CLOSE)


@pytest.mark.parametrize(("override", "message"), [
    (dict(rope_scaling={**LLAMA3, "factor": None}), r"rope_scaling.factor=None: must be a number"),
    (dict(rope_theta="abc"), r"rope_theta='abc': must be a number"),
    (dict(rms_norm_eps="1e-5"), r"rms_norm_eps='1e-5': must be a number"),
    (dict(rope_scaling={**LLAMA3, "original_max_position_embeddings": 8.5}),
     r"rope_scaling.original_max_position_embeddings=8.5: must be a positive integer"),
])
def test_a_value_of_the_wrong_type_is_named(override: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        checkpoint.config_from_hf({"model_type": "llama", **SIZES, **override})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "model_type='gpt2'.*only Llama"),
        # transformers builds Mistral (its sliding window) whatever the architectures say
        (dict(model_type="mistral", architectures=["LlamaForCausalLM"], sliding_window=4), "model_type='mistral'"),
        (dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4)), "RoPE type 'yarn'"),
        (dict(rope_theta=1e4, rope_scaling=dict(type="linear", factor=2.0)), "RoPE type 'linear'"),
        (dict(head_dim=16), "head_dim=16"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(quantization_config=dict(quant_method="fp8")), "pre-quantized .* Use the unquantized release"),
    ],
)
def test_unsupported_configs_are_refused(override: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        checkpoint.config_from_hf({"model_type": "llama", **SIZES, **override})


def test_a_gpt2_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="gpt2", architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ValueError, match="only Llama checkpoints"):
        checkpoint.load_model(tmp_path)


def test_a_tied_checkpoint_storing_another_head_is_refused(tmp_path: Path, ids: torch.Tensor) -> None:
    """A tied config whose file also stores ``lm_head.weight``: a copy of the embedding loads (tied), a different
    head is refused (transformers 4 would drop it, 5 keeps it) with the fix."""
    hf_model = write_hf_llama(tmp_path, tie=True)
    tensors = safetensors_torch.load_file(tmp_path / checkpoint.WEIGHTS_FILE)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    safetensors_torch.save_file(tensors, tmp_path / checkpoint.WEIGHTS_FILE, metadata={"format": "pt"})
    torch.testing.assert_close(our_logits(checkpoint.load_model(tmp_path), ids), hf_logits(hf_model, ids), **CLOSE)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0
    safetensors_torch.save_file(tensors, tmp_path / checkpoint.WEIGHTS_FILE, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="stores an lm_head.weight that differs.*tie_word_embeddings to false"):
        checkpoint.load_model(tmp_path)


def test_missing_files_and_tensors_are_named(tmp_path: Path) -> None:
    write_hf_llama(tmp_path)
    tensors = safetensors_torch.load_file(tmp_path / checkpoint.WEIGHTS_FILE)
    tensors["extra.weight"] = tensors.pop("model.layers.1.mlp.up_proj.weight")
    safetensors_torch.save_file(tensors, tmp_path / checkpoint.WEIGHTS_FILE, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\].*'extra.weight'"):
        checkpoint.load_model(tmp_path)
    (tmp_path / checkpoint.WEIGHTS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}.*model.safetensors and model.safetensors.index.json"):
        checkpoint.load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="No Hugging Face model directory at .*nowhere': no such directory.*"
                                                "e.g. hf download <repo> --local-dir <folder>"):
        checkpoint.load_model(tmp_path / "nowhere")
    (tmp_path / checkpoint.CONFIG_FILE).write_text('{"model_type": "llama",')  # cut short
    with pytest.raises(ValueError, match=f"{tmp_path}/config.json is not valid JSON"):
        checkpoint.load_model(tmp_path)


def test_byte_level_data_for_a_pretrained_checkpoint_is_refused(tmp_path: Path) -> None:
    """Byte values are not the checkpoint's token ids (``StdlibTextDataModule``, or ``LocalTextDataModule`` without a
    tokenizer): the fit stops before training and names the tokenizer to use."""
    from lightning_longshield import CausalLMModule, LongShieldStrategy
    from lightning_longshield.text_data import StdlibTextDataModule

    write_hf_llama(tmp_path / "hf", vocab_size=300)
    trainer = make_trainer(LongShieldStrategy(noise_multiplier=1.0), max_steps=1)
    with pytest.raises(ValueError, match=r"encodes text as UTF-8 bytes .* LocalTextDataModule\(files, tokenizer='"):
        trainer.fit(CausalLMModule(tmp_path / "hf"), datamodule=StdlibTextDataModule(seq_len=16, max_bytes=20_000))
    assert trainer.global_step == 0


def test_the_module_takes_a_path_and_tells_a_missing_directory_from_an_unknown_preset(tmp_path: Path) -> None:
    from lightning_longshield import CausalLMModule

    write_hf_llama(tmp_path / "hf")
    module = CausalLMModule(tmp_path / "hf")  # a Path, not only a str
    assert module.config == checkpoint.read_config(tmp_path / "hf") and module.hparams["config"] == str(tmp_path / "hf")
    module.configure_model()
    expected = checkpoint.load_model(tmp_path / "hf").state_dict()
    assert all(torch.equal(value, expected[name]) for name, value in module.model.state_dict().items())
    for mistyped in (tmp_path / "hf-typo", str(tmp_path / "hf-typo"), "./hf-typo"):
        with pytest.raises(FileNotFoundError, match="No Hugging Face model directory at '.*hf-typo': no such dir"):
            CausalLMModule(mistyped)
    with pytest.raises(FileNotFoundError, match=f"No Hugging Face model directory at '{tmp_path}': no config.json in"):
        CausalLMModule(str(tmp_path))
    with pytest.raises(ValueError, match=r"Unknown model preset 'llama3-8b': choose one of \[.*'tiny'\]"):
        CausalLMModule("llama3-8b")
    (tmp_path / "bin").mkdir()  # PyTorch .bin weights only: refused when the module is built, before any data
    (tmp_path / "bin" / checkpoint.CONFIG_FILE).write_bytes((tmp_path / "hf" / checkpoint.CONFIG_FILE).read_bytes())
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="No weights in .*bin: .*convert PyTorch .bin weights first"):
        CausalLMModule(tmp_path / "bin")


def test_require_hf_names_the_fix() -> None:
    assert require_hf("json") is json
    with pytest.raises(ImportError, match=r'pip install "lightning-longshield\[hf\]"'):
        require_hf("lightning_longshield_missing_dependency")


def test_core_modules_do_not_import_hf_packages_at_import_time() -> None:
    root = Path(checkpoint.__file__).parents[1]
    for path in (root / "models" / "llama.py", root / "hf" / "__init__.py"):
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in top for a in n.names} | {n.module for n in top if isinstance(n, ast.ImportFrom)}
        assert not {name for name in names if name and name.split(".")[0] in ("transformers", "safetensors")}
        assert "lightning_longshield.hf.checkpoint" not in names


@pytest.mark.slow
def test_fsdp_sharded_meta_model_loads_its_shards_on_two_ranks(tmp_path: Path) -> None:
    # 3 kv heads of 8 over 2 ranks: a row shard of wk ends inside a head; vocab 97 shards unevenly
    write_hf_llama(tmp_path / "hf", vocab_size=97, hidden_size=48, num_attention_heads=6, num_key_value_heads=3,
                   intermediate_size=80)
    run_processes(2, tmp_path, hf_workers.check_sharded_load, str(tmp_path / "hf"), str(tmp_path / "export"))


@pytest.mark.slow
def test_fine_tuning_a_checkpoint_under_cp_equals_one_process(tmp_path: Path) -> None:
    """The strategy builds `CausalLMModule(config=directory)` on the meta device under CP 2 and each rank loads
    its shards: two DP steps end where the same steps on one process end."""
    write_hf_llama(tmp_path / "hf", tie=True, rope_scaling=LLAMA3)
    run_processes(2, tmp_path, hf_workers.fine_tune_from_directory, str(tmp_path / "hf"), str(tmp_path / "cp2.pt"))
    _, module = hf_workers.fine_tune(str(tmp_path / "hf"))
    loaded = checkpoint.load_model(tmp_path / "hf").state_dict()
    trained = full_state(module.model)
    assert any(not torch.equal(trained[name], loaded[name]) for name in loaded)  # the steps did move the model
    assert_models_close(torch.load(tmp_path / "cp2.pt"), trained)


def test_lora_fine_tuning_of_a_checkpoint_exports_its_merged_model(tmp_path: Path, ids: torch.Tensor) -> None:
    from lightning_longshield import CausalLMModule, LongShieldStrategy
    from lightning_longshield.lora import LoraOptions

    write_hf_llama(tmp_path / "hf")
    module = CausalLMModule(str(tmp_path / "hf"), lora=LoraOptions(rank=4, target_modules=["wq", "wv", "w2"]),
                            optimizer="sgd", learning_rate=1.0)
    strategy = LongShieldStrategy(noise_multiplier=1.0, max_grad_norm=1.0, micro_batch_size=2,
                                  poisson_sampling=False)
    make_trainer(strategy, max_steps=2).fit(module, loader(RandomTokens(size=8, vocab=96), 4))
    module.save_pretrained(str(tmp_path / "out"))
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    with torch.no_grad():
        # merged weights round differently from base + adapter in fp32
        torch.testing.assert_close(hf_logits(exported, ids), module.model(ids), rtol=1e-4, atol=1e-4)


def test_a_lora_adapter_on_a_tied_head_is_exported_untied(tmp_path: Path, ids: torch.Tensor) -> None:
    """Llama 3.2's head is its embedding; an adapter on the head changes the head alone, so the export must carry
    its own ``lm_head.weight`` (and say it is untied), or transformers would use the embedding there."""
    from lightning_longshield.lora import LoraOptions, apply_lora

    write_hf_llama(tmp_path / "hf", tie=True)
    model = checkpoint.load_model(tmp_path / "hf")
    torch.manual_seed(0)  # the adapters' A
    apply_lora(model, LoraOptions(rank=2, dropout=0.0, target_modules=["q_proj", "lm_head"]))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    export.save_pretrained(model, tmp_path / "out")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert not exported.config.tie_word_embeddings
    # Merged weights round differently from the adapted layers' two products: LoRA's tolerance, as in the CLI's test.
    # Exported tied, the head would be the embedding: logits off by up to 4 here.
    torch.testing.assert_close(hf_logits(exported, ids), our_logits(model.eval(), ids), rtol=1e-4, atol=1e-4)


def test_an_export_carries_the_checkpoints_tokenizer_special_tokens_and_dtype(tmp_path: Path) -> None:
    from lightning_longshield.hf.demo import train_bpe_tokenizer

    source = tmp_path / "hf"
    hf = write_hf_llama(source, bos_token_id=90, eos_token_id=[91, 92])
    hf.to(torch.bfloat16).save_pretrained(source)  # a bf16 checkpoint, as released
    train_bpe_tokenizer(["def f(x):\n    return x + 1\n"] * 4, source, vocab_size=96)
    model = checkpoint.load_model(source)  # trained in fp32
    assert model.source_directory == str(source) and {p.dtype for p in model.parameters()} == {torch.float32}
    export.save_pretrained(model, tmp_path / "out")
    written = json.loads((tmp_path / "out" / checkpoint.CONFIG_FILE).read_text())
    assert (written["dtype"], written["bos_token_id"], written["eos_token_id"]) == ("bfloat16", 90, [91, 92])
    carried = [name for name in checkpoint.CARRIED_FILES if (source / name).is_file()]
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(carried)
    for name in carried:
        assert (tmp_path / "out" / name).read_bytes() == (source / name).read_bytes(), name
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert exported.dtype == torch.bfloat16 and exported.generation_config.eos_token_id == [91, 92]
    text = "return x + 1"
    assert (transformers.AutoTokenizer.from_pretrained(tmp_path / "out")(text).input_ids
            == transformers.AutoTokenizer.from_pretrained(source)(text).input_ids)
    export.save_pretrained(model, tmp_path / "fp32", dtype=torch.float32)  # an explicit dtype wins
    assert json.loads((tmp_path / "fp32" / checkpoint.CONFIG_FILE).read_text())["dtype"] == "float32"
    source.rename(tmp_path / "moved")
    with pytest.warns(UserWarning, match="is gone: the export in .* has no tokenizer"):
        export.save_pretrained(model, tmp_path / "orphan")
    assert not (tmp_path / "orphan" / "tokenizer.json").exists()


def test_an_export_of_a_model_built_here_declares_the_tokenizers_ids_or_none(tmp_path: Path) -> None:
    """A model built from a preset or a config has no checkpoint to take special tokens' ids from: none were
    written, and transformers read Llama 2's bos 1 and eos 2, on which generation would stop. With the tokenizer it
    trained with, its ids and files are written; without, the ids are null."""
    from lightning_longshield.hf.demo import train_bpe_tokenizer

    model = Llama(LlamaConfig(vocab_size=96, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64,
                              max_seq_len=64))
    export.save_pretrained(model, tmp_path / "bare")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "bare")
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (None, None, None)
    tokenizer = train_bpe_tokenizer(["def f(x):\n    return x + 1\n"] * 4, tmp_path / "tokenizer", vocab_size=96)
    export.save_pretrained(model, tmp_path / "with-tokenizer", tokenizer=tokenizer)
    config = transformers.AutoConfig.from_pretrained(tmp_path / "with-tokenizer")
    assert (config.eos_token_id, config.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    saved = transformers.AutoTokenizer.from_pretrained(tmp_path / "with-tokenizer")
    assert saved("return x").input_ids == tokenizer("return x").input_ids
    # A checkpoint's config without the ids: the export leaves them out as it does (not null), read alike.
    write_hf_llama(tmp_path / "source")
    source_config = json.loads((tmp_path / "source" / checkpoint.CONFIG_FILE).read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        source_config.pop(key, None)
    (tmp_path / "source" / checkpoint.CONFIG_FILE).write_text(json.dumps(source_config))
    export.save_pretrained(checkpoint.load_model(tmp_path / "source"), tmp_path / "from-source")
    written = json.loads((tmp_path / "from-source" / checkpoint.CONFIG_FILE).read_text())
    assert not {"bos_token_id", "eos_token_id", "pad_token_id"} & set(written)


@pytest.mark.parametrize("tokenizer", ["sentencepiece", "vocab-and-merges"])
def test_an_export_carries_tokenizers_saved_without_tokenizer_json_and_the_license(tmp_path: Path,
                                                                                   tokenizer: str) -> None:
    """A Llama 2 tokenizer is often only ``tokenizer.model``; a byte-level BPE one can be ``vocab.json`` and
    ``merges.txt``. The export reads as the source does, and carries the license a derivative must."""
    import textwrap

    texts = [Path(textwrap.__file__).read_text(encoding="utf-8")]
    source = tmp_path / "hf"
    write_hf_llama(source, vocab_size=300)
    if tokenizer == "sentencepiece":
        pytest.importorskip("sentencepiece")
        write_sentencepiece_tokenizer(source, texts)
    else:
        from lightning_longshield.hf.demo import train_bpe_tokenizer

        train_bpe_tokenizer(texts, tmp_path / "bpe", vocab_size=280)._tokenizer.model.save(str(source))
        (source / "tokenizer_config.json").write_text(json.dumps(dict(
            tokenizer_class="GPT2Tokenizer", eos_token="<eos>", bos_token="<eos>", unk_token="<eos>")))
    (source / "LICENSE.txt").write_text("license text")
    (source / "USE_POLICY.md").write_text("use policy")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tokenizer.json").write_text("{}")  # an earlier export's: transformers would prefer it
    with pytest.warns(UserWarning, match="held tokenizer.json, which .* does not have: another model's, removed"):
        export.save_pretrained(checkpoint.load_model(source), tmp_path / "out")
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    assert (tmp_path / "out" / "LICENSE.txt").read_text() == "license text"
    assert (tmp_path / "out" / "USE_POLICY.md").read_text() == "use policy"
    text = "def wrap(text, width=70):"
    expected = transformers.AutoTokenizer.from_pretrained(source)(text).input_ids
    assert len(expected) > 1
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out")(text).input_ids == expected

