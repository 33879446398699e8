"""DP fine-tuning with LoRA: only the adapters train, exactly as the per-sample-loop reference over the adapter
parameters, with per-sample memory for the adapters alone; merged adapters reproduce the adapted model."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("peft")

from lightning_longshield import LongShieldStrategy  # noqa: E402
from lightning_longshield.lora import LoraOptions, apply_lora, merged_tensors  # noqa: E402
from lightning_longshield.models import Llama  # noqa: E402
from simulate.specs import lora_numel  # noqa: E402
from tests.support.cp_training_workers import DATASET, LOGICAL_BATCH, LORA_RUNS, lora_under_cp  # noqa: E402
from tests.support.cp_training_workers import STEPS as STEPS_CP  # noqa: E402
from tests.support.helpers import (  # noqa: E402
    RandomTokens,
    assert_models_close,
    full_state,
    loader,
    make_lora_module,
    make_trainer,
    reference_dp_sgd,
    samples,
    small_config,
)
from tests.support.process_runner import run_processes  # noqa: E402

BATCH, STEPS = 4, 2


def adapter_names(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def test_only_adapters_are_trainable_and_the_planner_counts_them():
    options = LoraOptions(rank=4, target_modules=("wq", "wv", "w2"))
    model = apply_lora(Llama(small_config()), options)
    trainable = adapter_names(model)
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[3] for n in trainable} == {"wq", "wv", "w2"}
    counted = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_numel(small_config(), options.rank, options.target_modules) == counted


@pytest.mark.parametrize("micro_batch_size", [1, 2])
@pytest.mark.parametrize("activation_checkpointing", [False, True], ids=["", "checkpointed"])
def test_lora_updates_match_the_per_sample_loop_over_adapters(micro_batch_size, activation_checkpointing):
    dataset = RandomTokens(size=BATCH * STEPS, seq_len=16)
    module = make_lora_module(small_config(), dropout=0.0)
    initial = copy.deepcopy(module.model)
    strategy = LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=0.05, micro_batch_size=micro_batch_size,
                                  poisson_sampling=False, seed=0, activation_checkpointing=activation_checkpointing)
    make_trainer(strategy, max_steps=STEPS).fit(module, loader(dataset, BATCH))
    norms = strategy.dp_engine.last_per_sample_norms
    assert (norms > 0.05).any(), "clipping must be active for the comparison to mean anything"
    batches = [samples(dataset, range(k * BATCH, (k + 1) * BATCH)) for k in range(STEPS)]
    expected = reference_dp_sgd(initial, batches, 0.05, BATCH)
    assert_models_close(module.model, expected)
    before, after = full_state(initial), full_state(module.model)
    for name in before:
        changed = not torch.equal(before[name], after[name])
        assert changed == (".lora_" in name), name


def test_frozen_base_weights_take_no_per_sample_memory():
    dataset = RandomTokens(size=BATCH, seq_len=16)
    module = make_lora_module(small_config())
    adapters = sum(p.numel() for p in module.model.parameters() if p.requires_grad)
    strategy = LongShieldStrategy(noise_multiplier=1.0, max_grad_norm=1.0, micro_batch_size=BATCH,
                                  poisson_sampling=False)
    make_trainer(strategy, max_steps=1).fit(module, loader(dataset, BATCH))
    assert strategy.dp_engine.last_held_bytes == BATCH * adapters * 4
    assert set(strategy.dp_engine.capture.parameters) == {f"model.{n}" for n in adapter_names(module.model)}


@pytest.mark.slow
def test_lora_under_context_parallelism_matches_the_reference(tmp_path):
    run_processes(2, tmp_path, lora_under_cp, str(tmp_path))
    results = torch.load(tmp_path / "lora.pt", weights_only=False)
    dataset = RandomTokens(**DATASET)
    initial = make_lora_module(small_config()).model
    batches = [samples(dataset, range(k * LOGICAL_BATCH, (k + 1) * LOGICAL_BATCH)) for k in range(STEPS_CP)]
    expected = reference_dp_sgd(initial, batches, 0.05, LOGICAL_BATCH).state_dict()
    assert results.keys() == LORA_RUNS.keys()
    for run, states in results.items():
        assert_models_close(states[-1], expected)
        assert any(not torch.equal(states[-1][n], v) for n, v in initial.state_dict().items() if ".lora_" in n), run


def test_merged_adapters_reproduce_the_adapted_model():
    module = make_lora_module(small_config(tie_embeddings=True))
    tokens = torch.randint(0, 64, (2, 12))
    plain = Llama(small_config(tie_embeddings=True))
    plain.load_state_dict(dict(merged_tensors(module.model)))
    torch.testing.assert_close(plain(tokens), module.model(tokens), rtol=1e-4, atol=1e-4)
    unmerged = Llama(small_config(tie_embeddings=True))
    unmerged.load_state_dict({k.replace(".base_layer", ""): v for k, v in module.model.state_dict().items()
                              if ".lora_" not in k})
    assert not torch.allclose(unmerged(tokens), module.model(tokens), atol=1e-4)  # the adapters do change it
    assert list(merged_tensors(module.model, keep=False)) == []  # a rank that does not write keeps no copy


def test_a_bf16_export_that_rounds_the_merged_updates_away_is_warned_about(tmp_path):
    """A DP fine-tune's updates can be far below bf16's resolution of the base weights (half a step is about 0.2% of
    a weight): merged and exported in bf16 they rounded away in silence. Warned where their relative error reaches
    10%, naming a float32 export; larger updates, and float32, are exported without it."""
    import warnings

    from lightning_longshield.hf import export
    from lightning_longshield.lora import MergedUpdates

    module = make_lora_module(small_config())
    model = module.model
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "base_layer" in name:
                param.copy_(param.bfloat16().float())  # as a bf16 checkpoint loads
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * 1e-7)
    measured = MergedUpdates(torch.bfloat16)
    list(merged_tensors(model, updates=measured))
    assert measured.relative_error > 0.5
    with pytest.warns(UserWarning, match=r"bfloat16 export .* relative error of \d+%.*--export_dtype float32"):
        export.save_pretrained(model, tmp_path / "small", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export.save_pretrained(model, tmp_path / "fp32", dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.mul_(1e5)  # updates of about 1e-2 survive bf16
        export.save_pretrained(model, tmp_path / "large", dtype=torch.bfloat16)


def test_hugging_face_target_names_adapt_the_same_layers():
    options = LoraOptions(target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj", "wq", "lm_head"])
    assert options.target_modules == ("wq", "wv", "w1", "w3", "w2", "output")
    model = apply_lora(Llama(small_config()), LoraOptions(rank=4, target_modules=["k_proj", "o_proj"]))
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name, p in model.named_parameters() if p.requires_grad}
    assert adapted == {"wk", "wo"}


def test_all_linear_adapts_every_block_projection_as_peft_does():
    assert LoraOptions(target_modules="all-linear").target_modules == LoraOptions().target_modules
    assert "output" not in LoraOptions(target_modules="all-linear").target_modules
    with pytest.raises(ValueError, match="non-empty list of layer names.*or 'all-linear'"):
        LoraOptions(target_modules="q_proj")


def test_unknown_target_names_are_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"Unknown LoRA target_modules \['qkv_proj'\]: valid names are \['wq', .*"
                                         r"Hugging Face names \['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj'"):
        LoraOptions(target_modules=["q_proj", "qkv_proj"])


def test_options_from_a_mapping_name_the_valid_keys():
    from lightning_longshield import CausalLMModule

    with pytest.raises(ValueError, match=r"Unknown LoRA option\(s\) \['rnk'\]: the valid keys are \['rank', 'alpha',"
                                         r" 'dropout', 'target_modules'\]"):
        CausalLMModule(small_config(), lora={"rnk": 8})
    module = CausalLMModule(small_config(), lora={"rank": 2, "target_modules": ["q_proj"]})
    assert module.lora == LoraOptions(rank=2, target_modules=("wq",))


def test_targets_that_match_nothing_name_the_layers():
    with pytest.raises(ValueError, match=r"match no layer of Sequential; its linear layers are named \['0'\]"):
        apply_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), LoraOptions(target_modules=("wq",)))


@pytest.mark.parametrize("options, match", [
    (dict(rank=0), "rank must be a positive integer"),
    (dict(rank=2.5), "rank must be a positive integer"),
    (dict(rank="8"), "rank must be a positive integer"),
    (dict(rank=True), "rank must be a positive integer"),
    (dict(alpha=0), "alpha must be positive"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
    (dict(target_modules="wq"), "non-empty list of layer names"),
])
def test_bad_lora_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        LoraOptions(**options)


def test_a_whole_float_rank_builds_adapters_of_that_rank():
    """``rank: 4.0`` (a JSON or YAML number) passed the check and failed in torch's ``empty`` at ``apply_lora``."""
    options = LoraOptions(rank=4.0, target_modules=("wq",))
    assert options.rank == 4 and type(options.rank) is int
    model = apply_lora(Llama(small_config()), options)
    assert any(param.shape[0] == 4 for name, param in model.named_parameters() if "lora_a" in name.lower())
