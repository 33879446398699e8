"""Per-rank memory model: tensor counts, model states, per-method ordering, the breakdown's arithmetic."""

from __future__ import annotations

from dataclasses import replace

import pytest

from simulate import calibration, layers, make_config, memory
from simulate.config import planned_as_run
from simulate.memory import GIB, estimate_memory, model_state_bytes
from simulate.specs import get_model_spec, lora_numel


def test_block_saved_bytes_match_a_hand_count() -> None:
    """bf16: two composite RMSNorms (fp32 input + fp32 rstd + bf16 normalised), two shared linear inputs, q, k, v,
    SDPA output and wo's contiguous copy (d each), fp32 log-sum-exp per head, SwiGLU's four ffn-wide tensors."""
    m = get_model_spec("llama3.1-8b")
    d, f, h = m.dim, m.ffn_dim, m.n_heads
    by_hand = 2 * (4 * d + 4 + 2 * d) + 2 * 2 * d + 5 * 2 * d + 4 * h + 4 * 2 * f
    saved = layers.block_saved_tensors(m, act=2, context_parallel=False)
    assert sum(s.nbytes(1, 1) for s in saved) == by_hand


def test_cp_attention_saves_the_gathered_kv() -> None:
    m = get_model_spec("llama3.2-1b")
    local, n = 1000, 4
    plain = sum(s.nbytes(local, n) for s in layers.block_saved_tensors(m, 2, context_parallel=False))
    cp = sum(s.nbytes(local, n) for s in layers.block_saved_tensors(m, 2, context_parallel=True))
    assert cp - plain == 2 * m.dim * 2 * local * (n - 1)


def test_model_states_are_16_bytes_per_parameter_sharded_over_all_gpus() -> None:
    cfg = make_config(model="llama3.1-8b", gpus=4, method="v2", seq_len=4096)
    assert model_state_bytes(cfg) == pytest.approx(16 * cfg.model.num_parameters / 4)
    # Infinitely many GPUs: only the DP clipped sum remains, sharded over one CP group (whole under ZeRO-DP+).
    p = cfg.model.num_parameters
    assert model_state_bytes(cfg.replace(gpus="inf", cp=4, shard_over="all")) == pytest.approx(4 * p / 4)
    zero_dp_plus = planned_as_run(cfg.replace(gpus="inf", method="zero-dp", cp=1, shard_over="all"))
    assert model_state_bytes(zero_dp_plus) == pytest.approx(4 * p)
    assert model_state_bytes(cfg.replace(gpus="inf", method="nondp-fsdp", cp=1, shard_over="all")) == 0.0
    per_group = cfg.replace(gpus="inf", cp=4)  # the strategy's default: each CP group holds its own copy
    assert model_state_bytes(per_group) == pytest.approx(model_state_bytes(cfg))


def test_dp_accumulator_follows_the_per_sample_gradients() -> None:
    """Per data-parallel group: 1/N of the model under V2, the whole model on every CP rank under V1."""
    v2 = make_config(model="llama3.2-1b", gpus=8, method="v2", cp=4, seq_len=4096, shard_over="all")
    p = v2.model.num_parameters
    assert model_state_bytes(v2) == pytest.approx(12 * p / 8 + 4 * p / 4)
    assert model_state_bytes(v2.replace(method="v1")) == pytest.approx(12 * p / 8 + 4 * p)


def test_model_states_are_sharded_over_each_cp_group_by_default() -> None:
    """``shard_over="context_parallel"`` (the strategy's default): every data-parallel group holds the model states
    of its CP group; at CP 1 each GPU holds them whole, ZeRO-DP+'s book-keeping included (the review's 8B repro:
    about 120 GiB per GPU, OOM, where sharding over all 4 GPUs fits)."""
    v3 = make_config(model="llama3.1-8b", gpus=8, method="v3", cp=2, seq_len=65536)
    p = v3.model.num_parameters
    assert (v3.shard_over, v3.shard_size, v3.data_parallel_size) == ("context_parallel", 2, 4)
    assert model_state_bytes(v3) == pytest.approx(16 * p / 2)
    assert not estimate_memory(v3).fits and estimate_memory(v3.replace(shard_over="all")).fits
    zero = planned_as_run(make_config(model="llama3.1-8b", gpus=4, method="zero-dp", seq_len=2048))
    replicas = zero.replace(shard_over="context_parallel")
    assert model_state_bytes(replicas) == pytest.approx(16 * p) and model_state_bytes(zero) < 16 * p / 2
    assert not estimate_memory(replicas).fits and estimate_memory(zero).fits


def test_reserved_and_fit_arithmetic() -> None:
    mem = estimate_memory(make_config(model="llama3.1-8b", gpus=4, method="v2", mbs=1, seq_len=16384))
    assert mem.reserved == pytest.approx(mem.allocated * (1 + calibration.ALLOCATOR_FRAGMENTATION))
    outside = (calibration.CUDA_CONTEXT_GIB + calibration.NCCL_BUFFERS_GIB) * GIB
    assert mem.device_total == pytest.approx(mem.reserved + outside)
    assert mem.fits == (mem.device_total <= mem.capacity)
    gib = mem.as_gib()
    assert gib["reserved"] == pytest.approx(mem.peak_gib)
    assert gib["allocated"] == pytest.approx(sum(gib[k] for k in ("model_states", "fsdp_buffers", "activations",
                                                                  "logits_loss", "per_sample_grads", "ghost_norm",
                                                                  "communication")))


def test_sharding_per_sample_grads_and_checkpointing_save_memory() -> None:
    cfg = make_config(model="llama3.1-8b", gpus=4, method="v1", mbs=2, seq_len=8192)
    v1, v2, v3 = (estimate_memory(cfg.replace(method=m)).reserved for m in ("v1", "v2", "v3"))
    assert v3 < v2 < v1


def test_full_per_sample_grads_peak_at_the_end_of_backward() -> None:
    """V1 with MBS 4: per-sample gradients of the whole model outgrow the activations they replace. They are bf16
    under bf16-mixed, but the embedding's is fp32: the lookup runs outside autocast."""
    cfg = make_config(model="llama3.1-8b", gpus=4, method="v1", mbs=4, seq_len=4096)
    mem = estimate_memory(cfg)
    assert mem.phase == "backward: embedding"
    embedding = cfg.model.embedding_numel
    assert mem.per_sample_grads == pytest.approx(4 * (2 * (cfg.model.num_parameters - embedding) + 4 * embedding))


def test_zero_dp_needs_more_than_non_dp_fsdp() -> None:
    cfg = make_config(model="llama3.1-8b", gpus=4, method="nondp-fsdp", mbs=1, seq_len=4096)
    assert estimate_memory(cfg.replace(method="zero-dp")).reserved > estimate_memory(cfg).reserved


def test_zero_dp_peaks_after_backward_with_book_kept_gradients() -> None:
    """The retained graph plus book-kept output gradients outgrow the loss peak for the 8B model."""
    mem = estimate_memory(make_config(model="llama3.1-8b", gpus=4, method="zero-dp", mbs=1, seq_len=4096))
    assert mem.phase == "book-keeping: clipped sum" and mem.ghost_norm > 0


@pytest.mark.parametrize("method", ["nondp-fsdp", "zero-dp", "nondp-cp", "nondp-cp-ac", "v1", "v2", "v3"])
def test_memory_grows_with_seq_len_and_shrinks_with_gpus(method: str) -> None:
    # Long enough that activations, not V1's per-sample gradients at the end of backward, bind.
    cfg = make_config(model="llama3.2-3b", gpus=8, method=method, mbs=1, seq_len=16384, shard_over="all")
    assert estimate_memory(cfg.replace(seq_len=32768)).reserved > estimate_memory(cfg).reserved
    more_gpus = cfg.replace(gpus=16, cp=cfg.cp_size, shard_over="all")
    assert estimate_memory(more_gpus).reserved < estimate_memory(cfg).reserved


def test_fp32_training_needs_more_memory_than_bf16() -> None:
    cfg = make_config(model="llama3.2-1b", gpus=4, method="v2", seq_len=16384)
    assert estimate_memory(cfg.replace(precision="fp32")).reserved > estimate_memory(cfg).reserved


def test_loss_memory_is_fp32_cross_entropy_over_the_vocabulary() -> None:
    m = get_model_spec("llama3.2-1b")
    assert layers.loss_backward_bytes_per_token(m, 2) == 12 * m.vocab_size
    assert layers.loss_forward_bytes_per_token(m, 2) == 10 * m.vocab_size
    assert layers.loss_forward_bytes_per_token(m, 4) == 8 * m.vocab_size  # fp32 logits need no upcast copy


def test_cp_size_one_counts_the_micro_batch_gradient_once_as_fsdps_gradient() -> None:
    """CP size 1 runs FSDP2 on a one-rank mesh, the path of every CP size: at MBS 1 the sample's gradient is FSDP's
    fp32 gradient, near the whole model (4 bytes per parameter) by block 0 and counted once (with the per-sample
    gradients, not again as a growing ``.grad``), while the FSDP buffers hold one block's worth, not the model's."""
    cfg = make_config(model="llama3.2-3b", gpus=1, method="v2", cp=1, mbs=1, seq_len=1024)
    peak = estimate_memory(cfg)
    params = cfg.model.num_parameters
    assert peak.phase == "backward: block 0"
    assert 0.9 * 4 * params <= peak.per_sample_grads <= 4 * params
    assert peak.fsdp_buffers < 2 * params / 2  # under half a bf16 copy of the model


def test_lora_keeps_states_and_per_sample_gradients_of_the_adapters_only() -> None:
    """Under LoRA the fp32 weights stay whole, while AdamW moments, the clipped sum and the per-sample gradients
    shrink to the adapters' share (`lora_numel`, checked against the real module in tests/hf/test_lora.py)."""
    full = make_config(model="tiny", gpus=4, method="v2", cp=4, mbs=2, seq_len=4096)  # the peak in a block
    lora = full.replace(lora_rank=16)
    share = lora_numel(full.model, 16) / full.model.num_parameters
    assert 0 < share < 0.1
    full_peak, lora_peak = estimate_memory(full), estimate_memory(lora)
    weights = full.model.num_parameters * 4 / 4  # fp32 master weights, sharded over 4 GPUs
    assert lora_peak.model_states == pytest.approx(weights * (1 + 3 * share))
    assert full_peak.model_states == pytest.approx(weights * 4)
    assert 0 < lora_peak.per_sample_grads <= share * full_peak.per_sample_grads * 1.01
    with pytest.raises(ValueError, match="not zero-dp"):
        make_config(model="llama3.2-1b", gpus=4, method="zero-dp", lora_rank=8)


@pytest.mark.parametrize("method, cp", [("v1", 2), ("v2", 1), ("v2", 4), ("v3", 4)])
def test_per_layer_clipping_holds_about_one_layer_of_per_sample_gradients(method, cp) -> None:
    """Flat clipping holds every layer's per-sample gradients until the norm is known; per-layer clipping holds the
    layer being clipped (its share under V2/V3) plus the same in-flight partials."""
    flat = make_config(model="tiny", gpus=cp, method=method, cp=cp, mbs=8, seq_len=256)
    per_layer = flat.replace(clipping="per_layer", per_layer_kernel="torch")
    most = {cfg.clipping: max(p.get("per_sample_grads", 0.0) for _, p in memory._phases(cfg))
            for cfg in (flat, per_layer)}
    unit = 8 * flat.precision.activation_bytes
    share = 1 / cp if method != "v1" else 1.0
    largest = max(flat.trainable.largest_in_block, flat.model.embedding_numel)
    in_flight = 2 * unit * largest if method != "v1" and cp > 1 else 0.0
    assert most["per_layer"] <= unit * largest * share + in_flight + 1
    assert most["flat"] > 2 * most["per_layer"]  # under V2 both hold the same two unreduced partials


@pytest.mark.parametrize("tied", [False, True])
def test_fused_per_layer_kernels_hold_no_linear_per_sample_gradient(tied) -> None:
    """On one GPU at CP 1 the fused kernels take every linear weight used once: what per-sample gradients are formed
    are the RMSNorm weights' and the embedding's (a tied one from the head's backward to the embedding's)."""
    model = replace(get_model_spec("tiny"), tie_embeddings=tied)
    fused = make_config(model=model, gpus=1, method="v2", mbs=8, seq_len=256, clipping="per_layer",
                        per_layer_kernel="auto")
    torch_path = fused.replace(per_layer_kernel="torch")
    assert fused.fused_linear_weights and not torch_path.fused_linear_weights
    most = {cfg.per_layer_kernel: max(p.get("per_sample_grads", 0.0) for _, p in memory._phases(cfg))
            for cfg in (fused, torch_path)}
    unit = 8 * fused.precision.activation_bytes
    embedding = model.vocab_size * model.dim
    # The embedding's (fp32: the lookup runs outside autocast); a tied one is added into the head's per-sample
    # gradient, held from the head's backward, row by row: per token two fp32 row sums and the head's row, plus an
    # index per (sample, row).
    rows = 8 * 256 * model.dim * (2 * 4 + 2) + 8 * 8 * model.vocab_size
    expected = unit * embedding + rows if tied else 8 * fused.precision.master_bytes * embedding
    assert most["auto"] == expected
    # While the blocks run, the PyTorch path holds a linear weight's per-sample gradients, the fused one none.
    blocks = {cfg.per_layer_kernel: max(p.get("per_sample_grads", 0.0) for name, p in memory._phases(cfg)
                                        if name.startswith("backward: block")) for cfg in (fused, torch_path)}
    assert blocks["torch"] >= unit * max(lin.numel for lin in model.block_linears()) > blocks["auto"]
    linears = model.n_layers * sum(lin.numel for lin in model.block_linears()) + (0 if tied else embedding)
    assert fused.trainable.linear_weights == linears


def test_fused_per_layer_kernels_only_where_the_strategy_runs_them() -> None:
    """Not under CP, not with the model sharded over several GPUs, not with flat clipping or the PyTorch path; on
    data-parallel replicas that each hold the whole model (CP 1, ``shard_over="context_parallel"``), yes."""
    per_layer = dict(model="tiny", mbs=2, seq_len=256, clipping="per_layer", per_layer_kernel="auto")
    assert make_config(gpus=1, method="v1", **per_layer).fused_linear_weights
    assert not make_config(gpus=2, method="v2", **per_layer).fused_linear_weights  # CP 2
    assert not make_config(gpus=4, method="v2", cp=1, shard_over="all", **per_layer).fused_linear_weights  # FSDP
    assert make_config(gpus=4, method="v2", cp=1, **per_layer).fused_linear_weights  # 4 whole replicas
    assert not make_config(gpus=1, method="v2", mbs=2, seq_len=256, model="tiny").fused_linear_weights
    assert not make_config(gpus=1, method="v1", **{**per_layer, "per_layer_kernel": "torch"}).fused_linear_weights
    default = make_config(gpus=1, method="v1", model="tiny", mbs=2, seq_len=256, clipping="per_layer")
    assert default.per_layer_kernel == "torch" and not default.fused_linear_weights  # the strategy's default
    with pytest.raises(ValueError, match="Unknown per-layer kernel"):
        make_config(gpus=1, method="v2", **{**per_layer, "per_layer_kernel": "cuda"})


def test_the_triton_kernel_is_refused_where_the_strategy_refuses_it() -> None:
    """``PerLayerClipping(kernel="triton")`` under CP or with the model sharded over data-parallel replicas: the
    strategy refuses it (`use_fused_kernel`), and so does the planner, naming ``kernel='auto'``."""
    triton = dict(model="tiny", mbs=2, seq_len=256, clipping="per_layer", per_layer_kernel="triton")
    assert make_config(gpus=1, method="v2", **triton).fused_linear_weights
    assert make_config(gpus=4, method="v2", cp=1, **triton).fused_linear_weights  # whole replicas
    for layout in (dict(gpus=2), dict(gpus=4, cp=1, shard_over="all")):
        with pytest.raises(ValueError, match="kernel='auto'"):
            make_config(method="v2", **layout, **triton)


def test_per_layer_clipping_is_refused_where_it_is_not_modelled() -> None:
    for method in ("zero-dp", "nondp-cp"):
        with pytest.raises(ValueError, match="Per-layer clipping is modelled"):
            make_config(model="tiny", gpus=4, method=method, clipping="per_layer")
    with pytest.raises(ValueError, match="Unknown clipping"):
        make_config(model="tiny", gpus=4, method="v2", clipping="layerwise")
