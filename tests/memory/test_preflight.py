"""Pre-flight memory check: the planner's verdict before the first forward (raises on CUDA, logs on CPU)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_longshield import LongShieldStrategy, PreflightMemoryError, preflight
from lightning_longshield.models import LlamaConfig
from simulate import get_gpu_spec, get_model_spec, make_config, memory
from simulate.config import RANDOMIZED_CLIPPING_NOTE, method_for, precision_of
from simulate.strategy_config import METHOD_PRESETS, PerLayerClipping, StrategyConfig
from tests.support.helpers import RandomTokens, full_state, loader, make_module, make_trainer, small_config

GIB = 2**30


def layout(method: str = "v2", cp: int = 1, mbs: int = 1, **choices) -> StrategyConfig:
    """The strategy's arguments of one of the planner's method presets."""
    return StrategyConfig(**{"context_parallel_size": cp, **METHOD_PRESETS[method]}, micro_batch_size=mbs, **choices)


def predict(model: str, method: str, gpus: int, cp: int, mbs: int, seq_len: int, capacity_gib: float = 80,
            **options) -> preflight.PreflightResult:
    return preflight.predict(get_model_spec(model), layout(method, cp, mbs, **options.pop("choices", {})), gpus,
                             seq_len, "bf16-mixed", capacity_gib * GIB, **options)


def check(model: str = "llama3.1-8b", method: str = "v2", gpus: int = 1, cp: int = 1, mbs: int = 1,
          seq_len: int = 131072, capacity_gib: float = 80) -> preflight.PreflightResult:
    return predict(model, method, gpus, cp, mbs, seq_len, capacity_gib, gpu_name="NVIDIA H100 80GB HBM3").check()


def test_infeasible_config_names_peak_breakdown_and_a_fix():
    with pytest.raises(PreflightMemoryError) as error:
        check()
    message = str(error.value)
    memory = predict("llama3.1-8b", "v2", 1, 1, 1, 131072).memory
    assert "does not fit in GPU memory" in message and isinstance(error.value, MemoryError)
    assert f"predicted peak {memory.reserved / GIB:.1f} GiB per GPU" in message
    assert "vs 80.0 GiB capacity of the NVIDIA H100 80GB HBM3" in message
    for name in ("model_states", "activations"):  # the logits: one chunk of the chunked loss, under 0.01 GiB
        assert f"{name} {memory.as_gib()[name]:.2f}" in message
    assert "Fits instead: LongShieldStrategy(" in message and "context_parallel_size=" in message
    assert "preflight=False" in message


def test_alternative_on_the_same_gpus_is_a_constructor_change():
    with pytest.raises(PreflightMemoryError, match=r"instead: LongShieldStrategy\(activation_checkpointing=True\):"):
        check(gpus=8, cp=8, mbs=2, seq_len=65536)
    result = predict("llama3.1-8b", "v1", 8, 8, 8, 32768)
    alternative = preflight.find_alternative(result.strategy, result.config, world_size=8)
    assert alternative is not None and alternative.memory.fits and alternative.gpus is None
    # V1's per-sample gradients do not fit at MBS 8: shard them, or take one sample per micro-batch (where V1 runs
    # V2's path: the sample's gradient is FSDP's shard), the fastest that fits.
    assert {"micro_batch_size=1", "exchange='reduce_scatter'"} & set(alternative.arguments), alternative.arguments


def test_nothing_fits_says_so():
    with pytest.raises(PreflightMemoryError, match="Nothing the planner tried fits"):
        check(capacity_gib=1)


def test_feasible_config_passes():
    result = check(model="tiny", seq_len=1024)
    assert result.fits and result.config.model_name == "tiny"
    assert result.memory.capacity == 80 * GIB


def test_policy_and_v1_checkpointing_are_estimated_as_v3_with_a_note():
    assert method_for(StrategyConfig()) == ("v2", ())
    assert method_for(StrategyConfig(exchange="all_reduce")) == ("v1", ())
    v1_at_mbs_1 = predict("tiny", "v1", 2, 2, 1, 1024)
    assert v1_at_mbs_1.config.method.name == "v2"  # V1 at micro-batch 1 runs V2's path
    assert method_for(StrategyConfig(activation_checkpointing=True)) == ("v3", ())
    method, notes = method_for(StrategyConfig(exchange="all_reduce", activation_checkpointing=2))
    assert method == "v3" and "every block is checkpointed" in notes[0] and "exchange='all_reduce'" in notes[1]


def test_book_keeping_is_planned_as_zero_dp_plus_over_all_gpus():
    assert method_for(StrategyConfig(**METHOD_PRESETS["zero-dp"])) == ("zero-dp", ())
    method, notes = method_for(StrategyConfig(norms="ghost", context_parallel_size=2))
    assert method == "zero-dp" and "approximate" in notes[0]
    result = predict("llama3.2-1b", "zero-dp", 4, 1, 2, 4096)
    assert result.config.method.name == "zero-dp" and result.config.num_gpus == 4 and result.config.cp_size == 1
    alone = predict("llama3.2-1b", "zero-dp", 1, 1, 2, 4096)
    # Parameters and AdamW moments sharded over the 4 GPUs; the clipped sum whole on each (reduced once per step).
    assert result.memory.model_states < alone.memory.model_states / 2
    assert not result.config.method.retained_norm_pass  # the strategy's one-backward book-keeping


@pytest.mark.parametrize("precision, name", [("bf16-mixed", "bf16-mixed"), ("bf16-true", "bf16-mixed"),
                                             ("32-true", "fp32"), ("64-true", None)])
def test_precision_mapping(precision, name):
    assert precision_of(precision) == name


def test_model_spec_from_llama_config():
    assert preflight.model_spec_of(LlamaConfig.from_name("llama3.1-8b")) == get_model_spec("llama3.1-8b")
    assert preflight.model_spec_of(small_config()).dim == 32
    assert preflight.model_spec_of(None) is None


def test_gpu_spec_takes_the_device_capacity_and_the_closest_preset():
    spec = preflight.gpu_spec_for("NVIDIA A100-SXM4-40GB", 39 * GIB)
    assert spec.memory_bytes == 39 * GIB and spec.bf16_flops == get_gpu_spec("a100-40").bf16_flops
    assert preflight.gpu_spec_for("", 10 * GIB).bf16_flops == get_gpu_spec("h100").bf16_flops


def test_per_layer_clipping_is_planned_with_the_kernel_the_strategy_runs(monkeypatch):
    """Fused where `use_fused_kernel` takes linear weights (CP 1, not sharded over replicas, Triton on CUDA; off CUDA
    the logged estimate is CUDA's), the PyTorch path elsewhere; the fused plan holds fewer per-sample bytes."""
    from lightning_longshield.privacy import per_layer

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    auto = StrategyConfig(clipping=PerLayerClipping(kernel="auto"))
    forced = StrategyConfig(clipping=PerLayerClipping(kernel="torch"))
    everywhere = StrategyConfig(clipping="per_layer", shard_over="all")
    monkeypatch.setattr(per_layer, "triton_runs_on", lambda device: True)
    assert preflight.planned_per_layer_kernel(auto, cuda, 1, 4) == "auto"  # data-parallel replicas: whole models
    assert preflight.planned_per_layer_kernel(auto, cpu, 1, 1) == "auto"
    assert preflight.planned_per_layer_kernel(forced, cuda, 1, 1) == "torch"
    assert preflight.planned_per_layer_kernel(auto, cuda, 2, 2) == "torch"  # context parallelism
    assert preflight.planned_per_layer_kernel(everywhere, cuda, 1, 2) == "torch"  # sharded over the replicas
    monkeypatch.setattr(per_layer, "triton_runs_on", lambda device: False)
    assert preflight.planned_per_layer_kernel(auto, cuda, 1, 1) == "torch"  # no Triton
    spec = get_model_spec("llama3.2-1b")
    fused, materialised = (preflight.predict(spec, layout("v2", 1, 4, clipping="per_layer"), 1, 1024, "bf16-mixed",
                                             80 * GIB, per_layer_kernel=kernel) for kernel in ("auto", "torch"))
    assert fused.config.fused_linear_weights and not materialised.config.fused_linear_weights
    # While the blocks run (at the end of backward the tied embedding's buffers, the same on both paths, bind).
    held = [max(p.get("per_sample_grads", 0.0) for name, p in memory._phases(r.config)
                if name.startswith("backward: block")) for r in (fused, materialised)]
    assert held[0] < held[1]


def test_make_config_takes_specs_and_replace_keeps_them():
    custom = small_config()
    spec = preflight.model_spec_of(custom)
    gpu = preflight.gpu_spec_for("My GPU", 24 * GIB)
    cfg = make_config(model=spec, gpus=2, method="v3", seq_len=64, gpu=gpu)
    assert (cfg.model_name, cfg.gpu_name) == ("custom", "My GPU")
    changed = cfg.replace(mbs=2)
    assert changed.model == spec and changed.gpu == gpu
    assert make_config(model=get_model_spec("tiny"), gpu=get_gpu_spec("h200")).inputs()["model"] == "tiny"


# ---------------------------------------------------------------------- wiring in the strategy


def fit(strategy: LongShieldStrategy, module: L.LightningModule | None = None) -> L.LightningModule:
    module = module or make_module(small_config(n_layers=1))
    make_trainer(strategy, max_steps=1).fit(module, loader(RandomTokens(size=8, seq_len=16), 2))
    return module


class PublicLengthTokens(RandomTokens):
    """`RandomTokens` that state their configured length, as `PackedTokenDataset` and `PaddedDocumentDataset` do."""

    def __init__(self, size: int, seq_len: int) -> None:
        super().__init__(size=size, seq_len=seq_len)
        self.seq_len = seq_len


def test_cpu_run_logs_the_prediction_and_trains(monkeypatch):
    messages = []
    monkeypatch.setattr(preflight, "rank_zero_info", messages.append)
    strategy = LongShieldStrategy(noise_multiplier=1.0)
    module = make_module(small_config(n_layers=1))
    make_trainer(strategy, max_steps=1).fit(module, loader(PublicLengthTokens(size=8, seq_len=16), 2))
    assert strategy.lightning_module.trainer.global_step == 1
    (message,) = [m for m in messages if "pre-flight" in m]
    assert "logged, not checked" in message and "predicted peak" in message and "sequence length 16" in message
    assert "Breakdown at the peak" in message


class OddLengthRecords(torch.utils.data.Dataset):
    """Samples of a distinctive length (1234 tokens) and no public ``seq_len``: a length read from the data."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(1234) % 64
        return {"input_ids": ids, "labels": ids.roll(-1)}


def test_a_length_read_from_the_data_is_planned_with_but_never_shown(monkeypatch):
    """Without a public ``seq_len`` the pre-flight plans with record 0's length but neither logs it nor the memory
    figures computed from it (nor puts them in the error when the run does not fit)."""
    messages = []
    monkeypatch.setattr(preflight, "rank_zero_info", messages.append)
    arguments = dict(module=make_module(small_config(n_layers=1)), dataset=OddLengthRecords(),
                     device=torch.device("cpu"), world_size=1, cp=1, precision="32-true",
                     config=StrategyConfig(micro_batch_size=2))
    result = preflight.run_preflight(**arguments)
    (message,) = messages
    assert "1234" not in message and "GiB" not in message and "first training sample's length" in message
    assert "seq_len` attribute" in message
    assert result.config.seq_len == 1234 and result.private_length  # planned with it

    monkeypatch.setattr(preflight, "is_cuda", lambda device: True)
    monkeypatch.setattr(preflight, "device_properties", lambda device: ("NVIDIA H100 80GB HBM3", GIB // 1000))
    with pytest.raises(PreflightMemoryError) as error:
        preflight.run_preflight(**arguments)
    assert "1234" not in str(error.value) and "per GPU" not in str(error.value)
    assert "does not fit" in str(error.value) and "capacity of the NVIDIA H100 80GB HBM3" in str(error.value)
    # which alternative fits is computed from the length too (context-parallel sizes that divide it, ...)
    assert "Fits instead" not in str(error.value) and "No alternative is searched" in str(error.value)


def test_randomized_clipping_is_planned_with_a_note(monkeypatch):
    """The planner does not model randomized clipping's book-kept tensors: the logged estimate says so."""
    messages = []
    monkeypatch.setattr(preflight, "rank_zero_info", messages.append)
    arguments = dict(module=make_module(small_config(n_layers=1)), dataset=RandomTokens(size=8, seq_len=16),
                     device=torch.device("cpu"), world_size=1, cp=1, precision="32-true")
    exact = preflight.run_preflight(**arguments, config=StrategyConfig(micro_batch_size=2))
    sketched = preflight.run_preflight(**arguments, config=StrategyConfig(micro_batch_size=2, norms="hutchinson"))
    assert exact.notes == () and sketched.notes == (RANDOMIZED_CLIPPING_NOTE,)
    assert "randomized clipping" not in messages[0] and RANDOMIZED_CLIPPING_NOTE in messages[1]


def test_preflight_false_skips_the_check(monkeypatch):
    def refuse(**kwargs):
        raise AssertionError("the pre-flight check ran")

    monkeypatch.setattr(preflight, "run_preflight", refuse)
    with pytest.raises(AssertionError, match="pre-flight check ran"):
        fit(LongShieldStrategy(noise_multiplier=1.0))
    fit(LongShieldStrategy(noise_multiplier=1.0, preflight=False))


def test_module_without_llama_config_skips_with_a_log(monkeypatch):
    messages = []
    monkeypatch.setattr(preflight, "rank_zero_info", messages.append)
    module = make_module(small_config(n_layers=1))
    module.config = None
    fit(LongShieldStrategy(noise_multiplier=1.0), module)
    assert any("pre-flight memory check skipped" in m and "LlamaConfig" in m for m in messages)


def test_cuda_device_that_is_too_small_stops_before_the_first_forward(monkeypatch):
    monkeypatch.setattr(preflight, "is_cuda", lambda device: True)
    monkeypatch.setattr(preflight, "device_properties", lambda device: ("NVIDIA H100 80GB HBM3", GIB))
    module = make_module(small_config(n_layers=1))
    forwards = []
    module.model.register_forward_pre_hook(lambda *args: forwards.append(1))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(PreflightMemoryError, match=r"exceeds the 1.0 GiB capacity of the NVIDIA H100 80GB HBM3"):
        fit(LongShieldStrategy(noise_multiplier=1.0), module)
    assert forwards == []
    assert all(torch.equal(v, before[k]) for k, v in full_state(module).items())


def test_cuda_device_that_is_large_enough_trains(monkeypatch):
    messages = []
    monkeypatch.setattr(preflight, "rank_zero_info", messages.append)
    monkeypatch.setattr(preflight, "is_cuda", lambda device: True)
    monkeypatch.setattr(preflight, "device_properties", lambda device: ("NVIDIA H100 80GB HBM3", 80 * GIB))
    strategy = LongShieldStrategy(noise_multiplier=1.0)
    fit(strategy)
    assert strategy.lightning_module.trainer.global_step == 1
    assert any("pre-flight: fits in 80.0 GiB" in m for m in messages)


def test_a_lora_module_is_planned_with_only_its_adapters_training(monkeypatch):
    """8B with rank-8 adapters at T 4096 fits one H100 (full fine-tuning does not); book-kept norms with LoRA, which
    the planner does not model, skip the check with the reason rather than plan full fine-tuning."""
    from types import SimpleNamespace

    from lightning_longshield.lora import LoraOptions

    messages: list[str] = []
    monkeypatch.setattr(preflight, "rank_zero_info", messages.append)
    config = LlamaConfig.from_name("llama3.1-8b")
    run = dict(dataset=PublicLengthTokens(size=2, seq_len=4096), device=torch.device("cpu"), world_size=1, cp=1,
               precision="bf16-mixed")
    lora = SimpleNamespace(config=config, lora=LoraOptions(rank=8), loss_chunk_tokens="auto")
    adapters = preflight.run_preflight(module=lora, config=StrategyConfig(), **run)
    full = preflight.run_preflight(module=SimpleNamespace(config=config, loss_chunk_tokens="auto"),
                                   config=StrategyConfig(), **run)
    assert adapters is not None and full is not None
    assert adapters.config.lora_rank == 8 and adapters.fits and "LoRA rank 8" in messages[0]
    assert full.config.lora_rank == 0 and not full.fits
    assert full.memory.model_states > 3 * adapters.memory.model_states
    assert preflight.run_preflight(module=lora, config=StrategyConfig(norms="mixed"), **run) is None
    assert "does not model LoRA adapters with book-kept norms" in messages[-1]


def test_book_kept_norms_over_context_parallel_ranks_skip_the_check(monkeypatch):
    """Book-kept norms are planned at CP 1 with the whole sequence on every GPU: at 1B, CP 4, T 65536 that is 129
    GiB against a traced 44, and on CUDA the check refused a run that fits. Skipped, with the reason; at CP 1 it
    still plans."""
    from types import SimpleNamespace

    messages: list[str] = []
    monkeypatch.setattr(preflight, "rank_zero_info", messages.append)
    module = SimpleNamespace(config=LlamaConfig.from_name("llama3.2-1b"), loss_chunk_tokens="auto")
    run = dict(module=module, device=torch.device("cuda"), precision="bf16-mixed")
    skipped = preflight.run_preflight(dataset=PublicLengthTokens(size=2, seq_len=65536), world_size=4, cp=4,
                                      config=StrategyConfig(norms="mixed", context_parallel_size=4), **run)
    assert skipped is None and "book-kept norms (norms='ghost' or 'mixed') at context-parallel size 1" in messages[-1]
    run["device"] = torch.device("cpu")
    planned = preflight.run_preflight(dataset=PublicLengthTokens(size=2, seq_len=1024), world_size=1, cp=1,
                                      config=StrategyConfig(norms="mixed"), **run)
    assert planned is not None


def test_shard_over_all_plans_model_states_over_every_process():
    """The default shards model states over each CP group (replicas elsewhere); ``shard_over="all"`` over all ranks:
    the planned model states are 1/CP and 1/world of the whole."""
    def planned(world: int, shard_over: str) -> preflight.PreflightResult:
        return predict("llama3.1-8b", "v3", world, 2, 2, 16384, choices={"shard_over": shard_over})

    group, all_four, all_eight = planned(4, "context_parallel"), planned(4, "all"), planned(8, "all")
    assert planned(8, "context_parallel").memory.model_states == group.memory.model_states
    assert all_eight.memory.model_states < all_four.memory.model_states < group.memory.model_states
    assert all_four.fits and not group.fits  # on 80 GiB
    longer = predict("llama3.1-8b", "v3", 4, 2, 2, 65536, choices={"shard_over": "all"})
    alternative = preflight.find_alternative(longer.strategy, longer.config, 4)
    assert not longer.fits and alternative is not None and alternative.memory.fits and alternative.gpus is None


@pytest.mark.parametrize("setting", [dict(precision="bf16-true"), dict(activation_checkpointing=2)],
                         ids=["bf16-true", "every-2nd-block"])
def test_runs_planned_far_from_what_they_run_are_logged_not_checked_on_cuda(monkeypatch, setting):
    """bf16-true is planned as bf16-mixed (fp32 master weights and moments: refused a 3B run that fits on an H100),
    a policy checkpointing some blocks as every block (passed an 8B run predicted at 31.6 GiB that needs about
    110): neither is refused on the plan, and the log says why."""
    messages = []
    monkeypatch.setattr(preflight, "rank_zero_info", messages.append)
    monkeypatch.setattr(preflight, "is_cuda", lambda device: True)
    monkeypatch.setattr(preflight, "device_properties", lambda device: ("NVIDIA H100 80GB HBM3", GIB // 1000))
    precision = setting.pop("precision", "32-true")
    strategy = LongShieldStrategy(noise_multiplier=1.0, **setting)
    make_trainer(strategy, max_steps=1, precision=precision).fit(make_module(small_config(n_layers=2)),
                                                                 loader(RandomTokens(size=8, seq_len=8), 2))
    assert strategy.lightning_module.trainer.global_step == 1
    assert any("logged, not checked" in m and "planned as" in m for m in messages), messages


def test_checkpointing_is_tried_for_runs_sharded_over_all_processes():
    """With shard_over="all" and materialised norms the search skipped checkpointing, and suggested 256 GPUs where
    checkpointing on the same 8 fits."""
    result = predict("llama3.1-8b", "v2", 8, 8, 1, 131072, choices={"shard_over": "all"})
    alternative = preflight.find_alternative(result.strategy, result.config, world_size=8)
    assert not result.fits and alternative is not None and alternative.gpus is None
    assert "activation_checkpointing=True" in alternative.arguments, alternative.arguments
