"""Planner answers, input validation, and configurations the paper does not list (generalisation)."""

from __future__ import annotations

import pytest

from simulate import compare, make_config, max_seq_len, plan, recommend
from simulate.config import METHODS
from simulate.planner import candidate_seq_lens


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(model="llama9"), "Unknown model preset"),
    (dict(model="demo/tiny-llama"), "No Hugging Face model directory at .*demo/tiny-llama': no such folder"),
    (dict(gpu="tpu"), "Unknown GPU"),
    (dict(method="v9"), "Unknown method"),
    (dict(mbs=0), "positive integer"),
    (dict(gpus=0), "positive integer or 'inf'"),
    (dict(gpus="many"), "positive integer or 'inf'"),
    (dict(cp=3), "must divide the GPU count"),
    (dict(seq_len=1004, cp=4), "divisible by 2 x CP size = 8"),
    (dict(gpus="inf"), "give --cp N with --gpus inf"),
    (dict(method="zero-dp", cp=2), "does not use context parallelism"),
    (dict(precision="fp8"), "Unknown precision"),
])
def test_bad_inputs_name_the_fix(kwargs: dict, message: str) -> None:
    inputs = dict(model="llama3.1-8b", gpus=4, method="v2", mbs=1, seq_len=4096) | kwargs
    with pytest.raises(ValueError, match=message):
        make_config(**inputs)


def test_non_power_of_two_cp_cannot_split_power_of_two_lengths() -> None:
    assert candidate_seq_lens(4)[0] == 8
    with pytest.raises(ValueError, match="power-of-two --cp"):
        max_seq_len(model="llama3.2-1b", gpus=6, method="v2")


def test_plan_reports_gap_against_the_matching_non_dp_run() -> None:
    p = plan(model="llama3.1-8b", gpus=4, method="v3", mbs=1, seq_len=16384)
    base = plan(model="llama3.1-8b", gpus=4, method="nondp-cp-ac", mbs=1, seq_len=16384)
    assert p.baseline_tokens_per_second == base.tokens_per_second_per_gpu
    assert p.dp_gap == pytest.approx(base.tokens_per_second_per_gpu / p.tokens_per_second_per_gpu) and p.dp_gap >= 1
    assert base.dp_gap is None


def test_max_seq_len_is_the_largest_fitting_power_of_two() -> None:
    best = max_seq_len(model="llama3.2-1b", gpus=4, method="v2", mbs=1)
    assert best.fits
    assert not plan(**(best.config.inputs() | {"seq_len": 2 * best.config.seq_len})).fits
    assert max_seq_len(model="llama3.1-70b", gpus=4, method="zero-dp", mbs=1) is None


def test_recommendations_all_fit_and_are_ranked_by_throughput() -> None:
    plans = recommend("llama3.1-8b", 4, 16384)
    assert plans and all(p.fits and p.config.seq_len == 16384 for p in plans)
    assert {p.config.method.name for p in plans} <= {"zero-dp", "v1", "v2", "v3"}
    speeds = [p.tokens_per_second_per_gpu for p in plans]
    assert speeds == sorted(speeds, reverse=True)
    assert recommend("llama3.1-70b", 1, 16384) == []
    # At CP 1 V1 and V2 are one run: the strategy's default exchange comes first, not V1's extra argument.
    assert recommend("llama3.2-1b", 1, 4096, methods=("v1", "v2"))[0].config.method.name == "v2"


def test_compare_covers_methods_times_micro_batch_sizes() -> None:
    rows = compare("llama3.2-1b", 4, mbs_options=(1, 2))
    assert [(m, b) for m, b, _ in rows] == [(m, b) for m in METHODS for b in (1, 2)]
    assert all(p is None or p.fits for _, _, p in rows)


# --- configurations the paper does not list ---------------------------------------------------------------

def test_more_cp_ranks_extend_the_context_linearly() -> None:
    four = max_seq_len(model="llama3.2-1b", gpus=4, method="v2", mbs=1).config.seq_len
    eight = max_seq_len(model="llama3.2-1b", gpus=8, method="v2", mbs=1).config.seq_len
    assert eight == 2 * four


def test_h200_reaches_at_least_as_far_as_h100() -> None:
    for method in ("zero-dp", "v2", "v3"):
        h100 = max_seq_len(model="llama3.1-8b", gpus=4, method=method, mbs=1, gpu="h100").config.seq_len
        h200 = max_seq_len(model="llama3.1-8b", gpus=4, method=method, mbs=1, gpu="h200").config.seq_len
        assert h200 >= 2 * h100 if method == "zero-dp" else h200 >= h100


def test_a100_40gb_fits_less_than_a100_80gb() -> None:
    small = max_seq_len(model="llama3.2-3b", gpus=8, method="v3", mbs=1, gpu="a100-40").config.seq_len
    large = max_seq_len(model="llama3.2-3b", gpus=8, method="v3", mbs=1, gpu="a100-80").config.seq_len
    assert small < large


def test_multi_node_70b_fits_only_with_enough_gpus() -> None:
    assert max_seq_len(model="llama3.1-70b", gpus=8, method="v2", mbs=1) is None
    over_all = dict(model="llama3.1-70b", gpus=32, method="v3", mbs=1, shard_over="all")
    assert max_seq_len(**over_all, cp=8) is None  # 1/8 accumulator
    big = max_seq_len(**over_all, cp=16)
    assert big is not None and big.config.seq_len >= 32768 and big.tokens_per_second_per_gpu > 0
    assert max_seq_len(**{**over_all, "shard_over": "context_parallel"}, cp=16) is None  # states over 16 GPUs only


def test_fsdp_ceiling_with_infinite_gpus_has_no_throughput() -> None:
    p = max_seq_len(model="llama3.1-8b", gpus="inf", method="nondp-fsdp", mbs=1)
    assert p.memory.model_states == 0 and p.tokens_per_second_per_gpu is None
