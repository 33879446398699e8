"""Benchmark scripts that a GPU run depends on stay runnable: each runs once at a toy size on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_benchmark(script: str, *args: str, timeout: int, env: dict[str, str] | None = None) -> str:
    """Standard output of ``benchmarks/<script> args``, which must exit with status 0 (else: its stderr's end)."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                            timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_cp_attention_benchmark_runs_and_reports_ratios():
    stdout = run_benchmark("cp_attention.py", "--device", "cpu", "--seq-lens", "64", "--heads", "4", "--kv-heads", "2",
                           "--head-dim", "8", "--repeats", "1", timeout=300)
    report = json.loads(stdout)
    (row,) = report["results"]
    assert row["seq_len"] == 64 and row["prefix_over_flash_share"] > 0 and row["masked_over_flash_share"] > 0


@pytest.mark.slow
def test_gpu_throughput_benchmark_runs_and_reports_ratios():
    stdout = run_benchmark("gpu_throughput.py", "--device", "cpu", "--preset", "tiny", "--points", "32x1", "--methods",
                           "nondp_lightning", "longshield", "--accumulation", "2", "--warmup", "1", "--steps", "1",
                           "--precision", "32-true", timeout=600)
    report = json.loads(stdout)
    (row,) = report["results"]
    assert (row["seq_len"], row["micro_batch_size"]) == (32, 1)
    assert row["longshield"]["tokens_per_s"] > 0 and row["nondp_lightning"]["tokens_per_s"] > 0
    assert row["longshield_over_nondp"] == round(
        row["longshield"]["tokens_per_s"] / row["nondp_lightning"]["tokens_per_s"], 3)
    noise = report["noise"]
    assert noise["secure_noise_gb_per_s"] > 0 and set(noise["per_step"]) == {"3279104"}


def test_noise_generation_benchmark_reports_the_keyed_and_secure_costs():
    stdout = run_benchmark("noise_generation.py", "--params", "100000", "300000", "--secure-elements", "65536",
                           "--repeats", "1", timeout=600)
    report = json.loads(stdout)
    assert set(report["per_step"]) == {"100000", "300000"} and report["secure_noise_gb_per_s"] > 0
    for row in report["per_step"].values():
        assert row["keyed_over_seeded"] == row["keyed_s"] / row["seeded_32bit_s"]
        assert row["release_over_torch_release"] == row["release_s"] / row["torch_release_s"]


def test_fused_linear_clip_benchmark_times_each_projection_and_sums_the_model():
    stdout = run_benchmark("fused_linear_clip.py", "--device", "cpu", "--preset", "tiny", "--seq-len", "16", "--dtype",
                           "fp32", "--repeats", "1", timeout=300, env={**os.environ, "TRITON_INTERPRET": "0"})
    report = json.loads(stdout)
    shapes = [(row["in_features"], row["out_features"]) for row in report["projections"]]
    assert shapes == [(256, 128), (256, 256), (256, 768), (768, 256)]  # the tiny preset: k / v, q / o, w1 / w3, w2
    assert all(row["nondp_ms"] > 0 and row["torch_path_ms"] > 0 and row["fused_ms"] == {}
               for row in report["projections"])
    assert not report["config"]["fused_kernels"] and "fused_ms" not in report["model"]
    per_model = {(256, 128): 8, (256, 256): 8, (256, 768): 8, (768, 256): 4}  # per block x 4 layers
    for path in ("nondp_ms", "torch_path_ms"):
        expected = sum(row[path] * per_model[row["in_features"], row["out_features"]] for row in report["projections"])
        assert report["model"][path] == pytest.approx(expected, abs=1e-3)


def test_gpu_throughput_benchmark_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # in this process: a refusal needs no fresh one
    from gpu_throughput import main

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # as on this CPU-only machine, also where not
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2 and "CUDA is not available" in capsys.readouterr().err


@pytest.mark.slow
def test_lora_vs_full_benchmark_reports_side_by_side_ratios():
    stdout = run_benchmark("lora_vs_full.py", "--seq-len", "32", "--micro-batch-size", "2", "--steps", "1", "--warmup",
                           "0", "--lora-rank", "4", timeout=300)
    report = json.loads(stdout)
    ratios = report["lora_over_full"]
    assert 0 < ratios["trainable_parameters"] < 0.1 and ratios["step_s"] > 0
    # per-sample gradients exist only for the adapters: the byte ratio is the parameter ratio
    assert ratios["per_sample_grad_bytes"] == ratios["trainable_parameters"]


@pytest.mark.slow
def test_zero_dp_vs_longshield_benchmark_reports_every_method_against_its_non_dp_loop():
    stdout = run_benchmark("zero_dp_vs_longshield.py", "--seq-len", "32", "--micro-batch-sizes", "2", "--accumulation",
                           "2", "--steps", "1", "--markdown", timeout=600)
    report = json.loads(stdout[: stdout.rindex("}") + 1])
    (row,) = report["results"]
    for method, baseline in (("zero_dp_plus", "nondp_lightning"), ("longshield", "nondp_lightning"),
                             ("longshield_v3", "nondp_lightning"), ("opacus_ghost", "nondp_torch")):
        expected = row[f"{method}_step_s"] / row[f"{baseline}_step_s"]  # of the rounded step times
        assert abs(row[f"{method}_over_nondp"] / expected - 1) < 0.01
    assert row["zero_dp_plus_bookkept_mib"] > 0 and row["longshield_bookkept_mib"] == 0
    assert "| 2 | " in stdout and "ZeRO-DP+ step / non-DP" in stdout


@pytest.mark.slow
def test_per_layer_clipping_benchmark_reports_flat_per_layer_and_opacus_against_non_dp():
    stdout = run_benchmark("per_layer_clipping.py", "--seq-len", "32", "--micro-batch-sizes", "2", "--accumulation",
                           "2", "--steps", "1", "--markdown", timeout=600)
    report = json.loads(stdout[: stdout.rindex("}") + 1])
    assert "longshield_per_layer_fused" not in report["config"]["methods"]  # CUDA only
    (row,) = report["results"]
    for method, baseline in (("longshield", "nondp_lightning"), ("longshield_per_layer", "nondp_lightning"),
                             ("opacus", "nondp_torch")):
        expected = row[f"{method}_step_s"] / row[f"{baseline}_step_s"]  # of the rounded step times
        assert abs(row[f"{method}_over_nondp"] / expected - 1) < 0.01
    # per-layer clipping holds one layer's per-sample gradients at a time; flat LongShield and Opacus hold all
    assert 0 < 4 * row["longshield_per_layer_per_sample_grad_mib"] < row["longshield_per_sample_grad_mib"]
    assert row["opacus_per_sample_grad_mib"] == row["longshield_per_sample_grad_mib"]
    assert "| LongShield per-layer | " in stdout


@pytest.mark.slow
def test_dp_overhead_reports_each_loop_against_non_dp_and_the_floors():
    stdout = run_benchmark("dp_overhead.py", "--micro-batch-sizes", "1", "2", "--seq-len", "32", "--methods",
                           "nondp_lightning", "longshield", "--repeats", "1", "--warmup", "1", "--steps", "1",
                           "--same-process", timeout=600)
    row, row_of_two = json.loads(stdout)["results"]
    # the least clipping adds lies above the noise alone: a read of each gradient at micro-batch 1, a write and two
    # reads of each per-sample gradient at 2
    for measured in (row, row_of_two):
        assert measured["longshield_passes_s"] > 0
        assert measured["longshield_passes_floor_over_nondp"] > measured["longshield_noise_floor_over_nondp"] > 1
    assert row["longshield_over_nondp"] > 0 and row["longshield_peak_mem_over_nondp"] > 0
    # peak tensor memory holds at least the parameters, their gradients and AdamW's two states (tiny: 12.5 MiB each)
    assert row["nondp_lightning_peak_mem_mib"] > 4 * 12.5 and row["longshield_peak_mem_mib"] > 4 * 12.5
    assert row["longshield_peak_rss_over_nondp"] > 0  # CPU: the peak RSS growth too
    assert row["longshield_over_nondp_same_process"] > 0 and "nondp_lightning_over_nondp_same_process" not in row
    assert row["longshield_noise_s"] > 0 and row["longshield_noise_floor_over_nondp"] > 1
    assert "nondp_lightning_noise_s" not in row


def test_fused_per_layer_worker_refuses_cpu(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from dp_overhead import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--worker", "longshield_per_layer_fused", "--micro-batch-size", "2", "--device", "cpu"])
    assert exit_info.value.code == 2 and "needs CUDA" in capsys.readouterr().err


@pytest.mark.slow
def test_dp_step_phases_reports_each_phase_against_non_dp():
    stdout = run_benchmark("dp_step_phases.py", "--seq-len", "16", "--micro-batch-size", "2", "--accumulation", "2",
                           "--steps", "2", "--warmup", "1", timeout=300)
    report = json.loads(stdout)
    medians = report["median_ms_per_step"]
    assert set(medians) == {"nondp", "flat", "per_layer", "opacus"}
    assert set(medians["flat"]) == set(medians["opacus"]) == {"forward", "backward", "clipping", "noise", "optimizer",
                                                              "step"}
    for phases in medians.values():  # the step's own timer spans its phases
        assert 0 < sum(value for phase, value in phases.items() if phase != "step") <= phases["step"] + 0.01
    for loop in ("flat", "per_layer", "opacus"):
        assert report[f"{loop}_over_nondp"] > 0
        assert report[f"{loop}_minus_nondp_ms"]["noise"] == medians[loop]["noise"]  # non-DP draws none
        quartiles = report[f"{loop}_over_nondp_quartiles"]
        assert len(quartiles) == 3 and 0 < quartiles[0] <= quartiles[1] <= quartiles[2]
    assert report["opacus_over_flat"] == round(medians["opacus"]["step"] / medians["flat"]["step"], 3)
    assert len(report["opacus_over_per_layer_quartiles"]) == 3


def test_paired_quartiles_of_one_and_of_several_rounds(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from dp_step_phases import paired_quartiles

    def rounds(*steps: float) -> list[dict[str, float]]:
        return [{"step": step} for step in steps]

    assert paired_quartiles(rounds(3.0), rounds(2.0)) == [1.5, 1.5, 1.5]
    # Ratios 1.0, 1.1, 1.2, 1.3, 1.4 in another order: the quartiles of the rounds' own ratios.
    assert paired_quartiles(rounds(2.8, 1.0, 2.2, 1.3, 2.4), rounds(2.0, 1.0, 2.0, 1.0, 2.0)) == [1.1, 1.2, 1.3]


@pytest.mark.slow
def test_chunked_loss_benchmark_runs_and_reports_ratios():
    stdout = run_benchmark("chunked_loss.py", "--seq-len", "64", "--vocab", "512", "--chunk-tokens", "16", "--repeats",
                           "1", timeout=600)
    report = json.loads(stdout)
    for kind in ("loss_phase", "dp_step"):
        assert report[kind]["peak_chunked_over_whole"] > 0 and report[kind]["time_chunked_over_whole"] > 0


@pytest.mark.slow
def test_a_sharded_save_holds_its_own_shard_and_the_full_save_the_whole_state():
    """Measured, not timed: at 58 M parameters (0.7 GB of fp32 model and AdamW state) on two CP ranks, the full
    save grows rank 0's resident memory by about the whole state (it gathers it), a sharded save by well under one
    rank's shard; both checkpoints hold the same bytes."""
    stdout = run_benchmark("checkpoint_formats.py", "--presets", "medium", timeout=600)
    (row,) = json.loads(stdout)["results"]
    state_mib = row["parameters"] * 12 / 2**20  # fp32 parameters and AdamW's two moments
    full, sharded = row["full"], row["sharded"]
    assert full["rank0_save_memory_growth_mib"] > 0.5 * state_mib
    assert sharded["save_memory_growth_mib"] < 0.25 * state_mib / 2  # a quarter of one rank's shard
    assert sharded["mib_on_disk"] == pytest.approx(full["mib_on_disk"], rel=0.05)


def test_no_timed_dp_step_includes_the_epsilon_of_the_last_step(monkeypatch):
    """The privacy monitor computes epsilon at the end of a fit's first and last steps: the Lightning loop's timed
    steps (after the warm-up) include neither."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import time

    import dp_overhead

    from lightning_longshield import LongShieldStrategy

    args = dp_overhead.parse_args(["--seq-len", "16", "--accumulation", "1", "--warmup", "1", "--steps", "2",
                                   "--worker", "longshield", "--micro-batch-size", "1"])
    total_steps = args.warmup + args.steps + 1
    computed: list[float] = []
    get_epsilon = LongShieldStrategy.get_epsilon

    def timed_get_epsilon(self, *rest, **options):
        computed.append(time.perf_counter())
        return get_epsilon(self, *rest, **options)

    monkeypatch.setattr(LongShieldStrategy, "get_epsilon", timed_get_epsilon)
    dataset = dp_overhead._dataset(args, total_steps * args.micro_batch_size)
    ends = dp_overhead._lightning_step_ends(args, dataset, True, total_steps, {})
    first_timed_start, last_timed_end = ends[args.warmup], ends[total_steps - 1]
    assert computed and not [moment for moment in computed if first_timed_start < moment < last_timed_end]


def test_phase_timer_on_cuda_reads_its_events_once_the_step_has_ended(monkeypatch):
    """CUDA phases are timed by stream events, synchronised once at the step's end (no sync inside the step)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import torch
    from dp_step_phases import PhaseTimer

    clock, synchronised = [0.0], []

    class FakeEvent:  # a stream's clock that advances by 1 ms per recorded event
        def __init__(self, enable_timing: bool) -> None:
            self.at = None

        def record(self) -> None:
            clock[0] += 1.0
            self.at = clock[0]

        def synchronize(self) -> None:
            synchronised.append(self.at)

        def elapsed_time(self, end: FakeEvent) -> float:
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = PhaseTimer(torch.device("cuda"))

    def step() -> None:
        for _ in range(2):
            timer("forward", lambda: None)
        assert not timer.seconds and not synchronised  # nothing read, nothing synchronised inside the step

    timer("step", step)
    assert synchronised == [6.0]  # the step's end event: step start 1, forward 2-3 and 4-5, step end 6
    assert timer.seconds == {"forward": 2e-3, "step": 5e-3}


def test_dp_overhead_profiles_one_step_once(monkeypatch, tmp_path):
    """``--profile-dir`` writes the profiled step's table and trace once, however many micro-batches end after it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import dp_overhead

    args = dp_overhead.parse_args(["--seq-len", "16", "--accumulation", "2", "--warmup", "1", "--steps", "1",
                                   "--worker", "nondp_lightning", "--micro-batch-size", "1",
                                   "--profile-dir", str(tmp_path)])
    total_steps = args.warmup + args.steps + 1
    dataset = dp_overhead._dataset(args, 2 * total_steps * args.accumulation)
    dp_overhead._lightning_step_ends(args, dataset, False, total_steps, {})
    table = (tmp_path / "nondp_lightning_T16_mbs1.txt").read_text()
    assert "Self CPU" in table and (tmp_path / "nondp_lightning_T16_mbs1.trace.json").stat().st_size > 0
