"""Context-parallel DP-SGD (V1, V2 input- and output-stationary, each also with activation checkpointing; mixed and
ghost norms with book-keeping; per-layer clipping) on a data x context mesh equals CP size 1 and the independent
per-sample-loop reference (noise 0, SGD lr 1, clipping active)."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from typing import Optional

import pytest
import torch
from opacus.accountants import create_accountant
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_longshield import LongShieldStrategy, StrategyConfig
from lightning_longshield.sharded_checkpoints import read_model_state
from tests.support.cp_training_workers import (
    DATASET,
    LOGICAL_BATCH,
    RANDOMIZED_RUNS,
    SHARDED_OVER_ALL,
    STEPS,
    UNEVEN_BATCH,
    UNEVEN_FFN,
    UNEVEN_RUNS,
    context_parallel_errors,
    fit,
    fit_bf16,
    leak_check,
    load_checkpoint_data_parallel,
    meta_initialisation,
    noise_and_epsilon,
    restored_state,
    save_checkpoint_under_cp,
    sharded_over_all,
    train_configurations,
    uneven_micro_batches,
)
from tests.support.helpers import (
    RandomTokens,
    layer_bounds,
    loader,
    make_module,
    make_trainer,
    reference_dp_sgd,
    samples,
    small_config,
)
from tests.support.process_runner import run_processes

CLIP = 0.05
EXCHANGES = {
    "v1": dict(exchange="all_reduce"),
    "v2_input_stationary": dict(exchange="reduce_scatter"),
    "v2_output_stationary": dict(exchange="output_stationary"),
}


def configurations(context_parallel_size: int) -> dict[str, dict]:
    """Runs by name, e.g. ``"v1_mbs2_untied"`` or ``"v2_input_stationary_checkpointed_mbs1"`` (LongShield-V3)."""
    return {
        f"{exchange}_mbs{mbs}_{'tied' if tie else 'untied'}": dict(
            strategy_kwargs=dict(context_parallel_size=context_parallel_size, micro_batch_size=mbs, **kwargs),
            tie_embeddings=tie,
            max_grad_norm=CLIP,
        )
        for exchange, kwargs in EXCHANGES.items()
        for mbs, tie in ((1, False), (2, True), (2, False))
    } | {  # LongShield-V3: the same runs with every block checkpointed
        f"{exchange}_checkpointed_mbs{mbs}": dict(
            strategy_kwargs=dict(context_parallel_size=context_parallel_size, micro_batch_size=mbs,
                                 activation_checkpointing=True, **kwargs),
            tie_embeddings=False,
            max_grad_norm=CLIP,
        )
        for exchange, kwargs in EXCHANGES.items()
        for mbs in (1, 2)
    } | {  # norms without per-sample gradients: mixed (ghost for wq and the MLP, materialised for wk/wv at T=16)
        # and ghost, book-kept clipped sums reduce-scattered over the group
        "v2_mixed_mbs2_tied": dict(
            strategy_kwargs=dict(context_parallel_size=context_parallel_size, micro_batch_size=2, norms="mixed"),
            tie_embeddings=True,
            max_grad_norm=CLIP,
        ),
        "v1_ghost_checkpointed_mbs2": dict(
            strategy_kwargs=dict(context_parallel_size=context_parallel_size, micro_batch_size=2, norms="ghost",
                                 exchange="all_reduce", activation_checkpointing=True),
            tie_embeddings=False,
            max_grad_norm=CLIP,
        ),
    }


def reference_states(
    tie_embeddings: bool, logical_batch: int = LOGICAL_BATCH, per_layer: Optional[str] = None
) -> list[dict[str, torch.Tensor]]:
    """The reference's state after each step: flat clipping, or per-layer with the ``per_layer`` rule's bounds."""
    dataset = RandomTokens(**DATASET)
    initial = make_module(small_config(tie_embeddings=tie_embeddings)).model
    batches = [samples(dataset, range(k * logical_batch, (k + 1) * logical_batch)) for k in range(STEPS)]
    bounds = layer_bounds(initial, CLIP, per_layer) if per_layer is not None else None
    return [reference_dp_sgd(copy.deepcopy(initial), batches[: k + 1], CLIP, logical_batch,
                             layer_thresholds=bounds).state_dict()
            for k in range(STEPS)]


def check_against_reference(out_dir, names: Iterable[str]) -> dict[str, float]:
    """Check every named run against the reference; return each run's per-sample-gradient bytes (largest rank's)."""
    references = {tie: reference_states(tie) for tie in (False, True)}
    held = {}
    for run in names:
        result = torch.load(out_dir / f"{run}.pt", weights_only=False)
        expected = references[result["config"]["tie_embeddings"]]
        assert len(result["states"]) == STEPS
        for step, (state, reference) in enumerate(zip(result["states"], expected)):
            for name, value in reference.items():
                torch.testing.assert_close(
                    state[name], value, rtol=1e-4, atol=1e-6,
                    msg=lambda m, name=name, step=step, c=result["config"]: f"{c} step {step + 1} {name}: {m}",
                )
        held[run] = result["held_bytes"]
    return held


@pytest.mark.slow
def test_chunked_loss_under_context_parallelism_matches_reference(tmp_path):
    """Each rank's shard (8 tokens) in chunks of 3, 3 and 2: the head's per-sample partials of every chunk summed by
    each exchange (one sample per micro-batch through FSDP2's gradient, two through the exchange, tied and untied)
    equal the unchunked per-sample loop."""
    runs = {"v1": (1, False), "v2_input_stationary": (2, True), "v2_output_stationary": (2, False)}
    configs = {
        f"chunked_{exchange}_mbs{mbs}_{'tied' if tied else 'untied'}": dict(
            strategy_kwargs=dict(context_parallel_size=2, micro_batch_size=mbs, **EXCHANGES[exchange]),
            tie_embeddings=tied, max_grad_norm=CLIP, module_kwargs=dict(loss_chunk_tokens=3),
        )
        for exchange, (mbs, tied) in runs.items()
    }
    run_processes(2, tmp_path, train_configurations, configs, str(tmp_path))
    check_against_reference(tmp_path, configs)


@pytest.mark.slow
@pytest.mark.parametrize("world_size, context_parallel_size", [(2, 2), (4, 4), (4, 2)], ids=["cp2", "cp4", "dp2xcp2"])
def test_context_parallel_updates_match_reference(tmp_path, world_size, context_parallel_size):
    configs = configurations(context_parallel_size)
    run_processes(world_size, tmp_path, train_configurations, configs, str(tmp_path))
    held = check_against_reference(tmp_path, configs)
    # Per-rank per-sample-gradient bytes held after backward (micro-batch 2, untied): V2 holds 1/N of V1.
    v1 = held["v1_mbs2_untied"]
    v2_input = held["v2_input_stationary_mbs2_untied"]
    v2_output = held["v2_output_stationary_mbs2_untied"]
    assert v2_input == pytest.approx(v1 / context_parallel_size, rel=0.02)
    assert v2_output == pytest.approx(v1 / context_parallel_size, rel=0.02)


@pytest.mark.slow
def test_uneven_micro_batches_bucketing_and_per_layer_clipping_match_reference(tmp_path):
    """Logical batches of 3 at micro-batch size 2 mix the per-sample capture (2 samples) with the summed-gradient
    path (1 sample) under V1 and V2; bucketing V2's reduce-scatters changes nothing, bit for bit. Per-layer clipping
    (V1 and V2 with checkpointing, V2 with a reduce-scatter and a norm all-reduce per parameter and tied embeddings,
    output-stationary V2 with proportional bounds of the sharded parameters) equals the per-layer reference."""
    run_processes(2, tmp_path, uneven_micro_batches, str(tmp_path))
    results = torch.load(tmp_path / "uneven.pt", weights_only=False)
    assert set(results) == set(UNEVEN_RUNS)
    references = {}
    for run, states in results.items():
        kwargs, tied = UNEVEN_RUNS[run]
        per_layer = StrategyConfig(clipping=kwargs.get("clipping", "flat")).per_layer
        per_layer = per_layer.thresholds if per_layer is not None else None
        if (tied, per_layer) not in references:
            references[tied, per_layer] = reference_states(tied, UNEVEN_BATCH, per_layer)
        for step, reference in enumerate(references[tied, per_layer]):
            for name, value in reference.items():
                torch.testing.assert_close(states[step][name], value, rtol=1e-4, atol=1e-6,
                                           msg=lambda m, r=run, n=name, s=step: f"{r} step {s + 1} {n}: {m}")
    for bucketed, unbucketed in zip(results["v2_bucket_all"], results["v2_bucket_0"]):
        assert all(torch.equal(bucketed[name], unbucketed[name]) for name in unbucketed)
    # Randomized clipping: the ranks' partial sketches complete the estimate of the whole sequence, so CP 2 equals
    # CP 1 with the same projections (and clipping is active: the update differs from the exact-norm reference).
    randomized = torch.load(tmp_path / "randomized.pt", weights_only=False)
    for run, states in randomized.items():
        kwargs, tied = RANDOMIZED_RUNS[run]
        _, single = fit(1, dict(context_parallel_size=1, micro_batch_size=2, **kwargs), tie_embeddings=tied,
                        max_grad_norm=CLIP, logical_batch=UNEVEN_BATCH)
        for step, (got, want) in enumerate(zip(states, single)):
            for name, value in want.items():
                torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6,
                                           msg=lambda m, r=run, n=name, s=step: f"{r} step {s + 1} {n}: {m}")
        exact = references.get((tied, None)) or reference_states(tied, UNEVEN_BATCH, None)
        assert any(not torch.allclose(states[-1][n], exact[-1][n], rtol=1e-3, atol=1e-5) for n in exact[-1]), run
    # An FFN of 51 does not split over CP 2: output-stationary shards w2 along its output features (FSDP2 refused the
    # input features at setup), and the run equals CP 1.
    kwargs, model_config = UNEVEN_FFN
    _, single = fit(1, dict(context_parallel_size=1, micro_batch_size=2, **kwargs), tie_embeddings=False,
                    max_grad_norm=CLIP, logical_batch=UNEVEN_BATCH, model_config=model_config)
    for got, want in zip(torch.load(tmp_path / "uneven_ffn.pt", weights_only=False), single):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_noise_is_added_once_across_data_parallel_groups_and_epsilon_matches(tmp_path):
    run_processes(4, tmp_path, noise_and_epsilon, str(tmp_path))
    result = torch.load(tmp_path / "noise.pt", weights_only=False)
    # The clipped sum has norm <= 4e-3 in all; the update is noise / B to within 1e-3.
    noise = torch.cat([update.flatten() for update in result["updates"].values()])
    expected_std = 1000.0 * 1e-3 / LOGICAL_BATCH
    assert abs(noise.std().item() / expected_std - 1) < 0.03, "noise added once, not once per data-parallel group"
    # Replicas of a CP shard in the two data-parallel groups are identical (one noise draw).
    shards = result["shards"]
    assert torch.equal(shards["dp0_cp0"], shards["dp1_cp0"]) and torch.equal(shards["dp0_cp1"], shards["dp1_cp1"])
    cp0, cp1 = shards["dp0_cp0"], shards["dp0_cp1"]
    assert not torch.equal(cp0[: cp1.numel()], cp1[: cp0.numel()])
    # The two CP shards draw independent noise: each parameter's two halves along its sharded dim 0 (CP ranks 0
    # and 1) are uncorrelated element by element (the same stream on both ranks would correlate them fully).
    halves = torch.cat([u.reshape(2, -1) for u in result["updates"].values() if u.shape[0] % 2 == 0], dim=1)
    assert abs(torch.corrcoef(halves)[0, 1].item()) < 0.05
    reference = create_accountant("rdp")
    for _ in range(3):
        reference.step(noise_multiplier=1.1, sample_rate=LOGICAL_BATCH / DATASET["size"])
    assert result["history"] == [(1.1, LOGICAL_BATCH / DATASET["size"], 3)]
    assert result["epsilon"] == pytest.approx(reference.get_epsilon(delta=1e-3), rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("activation_checkpointing, checkpoint_format", [(False, "auto"), (True, "full")],
                         ids=["v2-sharded-async", "v3-full"])
def test_checkpoint_saved_under_cp_resumes_on_one_process(tmp_path, activation_checkpointing, checkpoint_format):
    path = tmp_path / "cp2.ckpt"
    run_processes(2, tmp_path, save_checkpoint_under_cp, str(path), activation_checkpointing, checkpoint_format,
                  "adamw", 0.0, checkpoint_format == "auto")  # the sharded save written in the background
    assert path.is_dir() == (checkpoint_format == "auto")  # asynchronous saves are sharded
    saved = read_model_state(path) if path.is_dir() else torch.load(path, weights_only=False)["state_dict"]
    module = make_module(small_config(), optimizer="adamw", learning_rate=1e-2)
    assert set(saved) == {f"model.{k}" for k in module.model.state_dict()}

    def strategy():
        # Poisson draws are keyed by the DP step: with the same (test-only) noise_seed, the resumed run sees exactly
        # the batches it would have.
        return LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=0.05, micro_batch_size=2, noise_seed=0,
                                  activation_checkpointing=activation_checkpointing)

    resumed = module
    make_trainer(strategy(), max_steps=3).fit(resumed, loader(RandomTokens(**DATASET), LOGICAL_BATCH), ckpt_path=path)
    uninterrupted = make_module(small_config(), optimizer="adamw", learning_rate=1e-2)
    make_trainer(strategy(), max_steps=3).fit(uninterrupted, loader(RandomTokens(**DATASET), LOGICAL_BATCH))
    # Two AdamW steps under CP 2 vs on one process: the gradients agree to fp32 rounding (the SGD reference tests
    # check 1e-4), but AdamW's m / sqrt(v) turns a rounding difference in a near-zero gradient coordinate into an
    # O(lr) difference of that weight, so a few weights may differ by up to 1e-3 relative.
    for (name, value), expected in zip(resumed.model.state_dict().items(), uninterrupted.model.state_dict().values()):
        torch.testing.assert_close(value, expected, rtol=1e-3, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, momentum", [("adamw", 0.0), ("sgd", 0.0), ("sgd", 0.9)],
                         ids=["adamw", "sgd", "sgd-momentum"])
def test_a_sharded_checkpoint_loads_at_cp_1_at_dp_2_and_into_one_process(tmp_path, optimizer, momentum):
    """Saved by CP 2 (each rank its shards): restored whole in this process (CP 1), by two data-parallel processes,
    and read without a process group for an export; parameters and optimizer state (AdamW's moments and step, SGD's
    momentum buffers, SGD's hyper-parameters alone) equal what was saved, exactly."""
    path = tmp_path / "cp2.ckpt"
    run_processes(2, tmp_path, save_checkpoint_under_cp, str(path), False, "sharded", optimizer, momentum)
    saved = read_model_state(path)
    whole = tmp_path / "whole.pt"
    dcp_to_torch_save(path, whole)
    saved_optimizer = torch.load(whole, weights_only=False)["optimizer_0"]
    saved_optimizer.setdefault("state", {})  # an empty state (SGD without momentum) is not stored
    assert bool(saved_optimizer["state"]) == (optimizer == "adamw" or momentum > 0)

    module = make_module(small_config(), optimizer=optimizer, learning_rate=1e-2, momentum=momentum)
    strategy = LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=0.05, micro_batch_size=2, noise_seed=0)
    trainer = make_trainer(strategy, max_steps=2)
    trainer.fit(module, loader(RandomTokens(**DATASET), LOGICAL_BATCH), ckpt_path=path)
    loading = tmp_path / "dp2"  # a rendezvous of its own: the save's store holds the other run's addresses
    loading.mkdir()
    run_processes(2, loading, load_checkpoint_data_parallel, str(path), str(loading), optimizer, momentum)
    for restored in (restored_state(module, trainer), torch.load(loading / "restored.pt", weights_only=False)):
        assert restored["model"].keys() == saved.keys()
        for name, value in saved.items():
            torch.testing.assert_close(restored["model"][name], value, rtol=0, atol=0)
        assert restored["optimizer"]["state"].keys() == saved_optimizer["state"].keys()
        for name, state in saved_optimizer["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(restored["optimizer"]["state"][name][key], value, rtol=0, atol=0)
        assert restored["optimizer"]["param_groups"][0]["lr"] == saved_optimizer["param_groups"][0]["lr"]


@pytest.mark.slow
def test_context_parallel_errors_name_the_fix(tmp_path):
    run_processes(2, tmp_path, context_parallel_errors, str(tmp_path))
    messages = torch.load(tmp_path / "errors.pt")
    assert "not divisible by 2 x context_parallel_size" in messages["seq_len"]
    message, steps = messages["configured_seq_len"]  # refused as the data is set up, before any step or draw
    assert "not divisible by 2 x context_parallel_size" in message and steps == 0
    assert "attention_fn" in messages["attention"] and "context_parallel_size=1" in messages["attention"]
    assert "Trainer.validate with LongShieldStrategy(context_parallel_size=2" in messages["validate"]
    assert "evaluate within fit" in messages["validate"]
    assert math.isfinite(messages["validate_after_fit"])  # fit lays the model out; evaluating it then works
    # test batches are sharded as validation's (unsharded, each rank took the whole sequence for its shard)
    assert messages["test_after_fit"] == pytest.approx(messages["validate_after_fit"], rel=1e-6)
    assert "would return each process's shard" in messages["predict"]
    assert messages["steps_after_second_fit"] == 2  # a second fit of the sharded module (FSDP2 applied it once)


@pytest.mark.slow
def test_no_leak_with_checkpointing_under_context_parallelism(tmp_path):
    run_processes(2, tmp_path, leak_check, str(tmp_path))
    for rank in range(2):
        counts = torch.load(tmp_path / f"leak{rank}.pt")
        assert counts["after_step_50"] <= counts["after_step_5"] + 5, counts


@pytest.mark.slow
def test_bf16_mixed_under_context_parallelism_is_close_to_the_fp32_reference(tmp_path):
    """bf16 gathers and per-sample gradients, fp32 norms, sums and master weights: the update stays within 5%."""
    run_processes(2, tmp_path, fit_bf16, str(tmp_path))
    results = torch.load(tmp_path / "bf16.pt", weights_only=False)
    dataset = RandomTokens(**DATASET)
    initial = make_module(small_config()).model
    expected = reference_dp_sgd(copy.deepcopy(initial), [samples(dataset, range(LOGICAL_BATCH))], CLIP, LOGICAL_BATCH)
    start = torch.cat([v.flatten() for v in initial.state_dict().values()])
    expected_update = torch.cat([v.flatten() for v in expected.state_dict().values()]) - start
    for run, state in results.items():  # "v2" and "v3" (with activation checkpointing)
        update = torch.cat([state[name].float().flatten() for name in initial.state_dict()]) - start
        relative_error = ((update - expected_update).norm() / expected_update.norm()).item()
        assert relative_error < 0.05, (run, relative_error)


@pytest.mark.slow
def test_model_built_in_configure_model_is_initialised_shard_by_shard(tmp_path):
    """Under CP the model is built on the meta device and each rank initialises only its own shards: with the
    model's own distribution, independent across ranks, reproducible from the strategy's seed."""
    run_processes(2, tmp_path, meta_initialisation, str(tmp_path))
    rank0, rank1 = (torch.load(tmp_path / f"meta{rank}.pt", weights_only=False) for rank in range(2))
    # The gathered full state (rank 0 holds it: full state dicts are offloaded to rank 0's CPU).
    first, again, other = (rank0[run]["full"] for run in ("first", "again", "other"))
    for name, value in first.items():
        torch.testing.assert_close(value, again[name], rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    assert all(not torch.equal(value, other[name]) for name, value in first.items() if "norm" not in name)
    local0, local1 = (results["first"]["local"]["tok_embeddings.weight"] for results in (rank0, rank1))
    assert local0.shape == local1.shape and not torch.equal(local0, local1)
    # What FSDP2 leaves whole is one value on both ranks (each drew its own before).
    whole0, whole1 = (results["first"]["buffers"]["random_projection.projection"] for results in (rank0, rank1))
    assert torch.equal(whole0, whole1) and whole0.std() > 0.5
    config = small_config()
    assert abs(first["tok_embeddings.weight"].std().item() - 1.0) < 0.1
    layers = range(config.n_layers)
    wq = torch.cat([first[f"layers.{i}.attention.wq.weight"].flatten() for i in layers])
    wo = torch.cat([first[f"layers.{i}.attention.wo.weight"].flatten() for i in layers])
    assert abs(wq.std().item() / 0.02 - 1) < 0.1
    assert abs(wo.std().item() / (0.02 / (2 * config.n_layers) ** 0.5) - 1) < 0.1
    assert all(torch.equal(value, torch.ones_like(value)) for name, value in first.items() if "norm" in name)


@pytest.mark.slow
def test_meta_device_set_up_needs_well_under_the_whole_model_per_rank(tmp_path):
    """A ~0.8 GiB fp32 model under CP 2: building it before fit costs every rank the whole model plus its shard at
    set-up; built in configure_model (meta device, then only the rank's shards) the peak stays below 0.65x."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from lightning_longshield.models import Llama, LlamaConfig
    from tests.support.meta_init_memory_probe import CONFIG

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # large blocks go back to the OS when freed
    growth = {}
    for mode in ("prebuilt", "meta"):
        out = tmp_path / mode
        out.mkdir()
        run = subprocess.run([sys.executable, "-m", "tests.support.meta_init_memory_probe", mode, str(out)], env=env,
                             timeout=600, capture_output=True, text=True, cwd=root)
        assert run.returncode == 0, f"the {mode} probe failed:\n{run.stderr[-4000:]}"
        growth[mode] = [json.loads((out / f"rank{rank}.json").read_text())["peak_growth"] for rank in range(2)]
    with torch.device("meta"):
        model_bytes = 4 * sum(p.numel() for p in Llama(LlamaConfig(**CONFIG)).parameters())
    assert min(growth["prebuilt"]) > 1.3 * model_bytes, growth  # the whole fp32 model and its shard were there
    assert max(growth["meta"]) < 0.65 * min(growth["prebuilt"]), growth


@pytest.mark.slow
def test_sharding_over_all_ranks_matches_reference_and_adds_noise_once(tmp_path):
    """FSDP2 over data 2 x CP 2 (V1, V2, mixed ghost norms, one-sample micro-batches) and ZeRO-DP+ (data 4, CP 1,
    mixed + book-keeping) equal the per-sample-loop reference; model states are a quarter per rank; a pure-noise
    step has the noise std sigma C / B: each coordinate's noise is drawn once, by the rank that owns it."""
    run_processes(4, tmp_path, sharded_over_all, str(tmp_path), CLIP)
    results = torch.load(tmp_path / "sharded_over_all.pt", weights_only=False)
    references = {}
    total = sum(p.numel() for p in make_module(small_config()).model.parameters())
    for name, config in SHARDED_OVER_ALL.items():
        result = results[name]
        key = (config["tie_embeddings"], config.get("logical_batch", LOGICAL_BATCH))
        if key not in references:
            references[key] = reference_states(*key)
        for step, (state, reference) in enumerate(zip(result["states"], references[key], strict=True)):
            for param, value in reference.items():
                torch.testing.assert_close(state[param], value, rtol=1e-4, atol=1e-6,
                                           msg=lambda m, n=name, p=param, s=step: f"{n} step {s + 1} {p}: {m}")
        tied = config["tie_embeddings"]
        whole = total - (small_config().vocab_size * small_config().dim if tied else 0)
        assert result["local_numel"] <= whole / 4 + 64, f"{name}: model states are not sharded over all 4 ranks"
    noise = torch.cat([update.flatten() for update in results["noise_updates"].values()])
    expected_std = 1000.0 * 1e-3 / LOGICAL_BATCH
    assert abs(noise.std().item() / expected_std - 1) < 0.03, "noise added once per coordinate"
