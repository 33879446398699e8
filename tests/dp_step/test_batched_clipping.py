"""Clipping and accumulation are batched: accumulation issues a constant number of ops per sample whatever the number
of parameter tensors, norms a fixed number of row-wise reductions per tensor whatever the micro-batch size (counted
with the profiler on CPU, where CUDA would launch the same ops as kernels)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from lightning_longshield.loss import causal_lm_loss
from lightning_longshield.models import Llama
from lightning_longshield.privacy import DPSGDEngine, GaussianNoise, PrivacyAccountant
from tests.support.helpers import cpu_matmul_precision, small_config

# Ops that only make views or allocate (no kernel, no memory traffic).
METADATA_OPS = {"aten::select", "aten::unsqueeze", "aten::view", "aten::empty", "aten::as_strided", "aten::slice",
                "aten::detach", "aten::alias", "aten::_unsafe_view", "aten::reshape", "aten::lift_fresh"}


def compute_ops_of_one_fold(layers: int, batch: int) -> tuple[list[str], int]:
    torch.manual_seed(0)
    model = Llama(small_config(n_layers=layers))
    engine = DPSGDEngine(model, 0.05, GaussianNoise(torch.device("cpu")), PrivacyAccountant("rdp"))
    ids = torch.randint(0, 64, (batch, 16))
    engine.prepare_microbatch(batch)
    (causal_lm_loss(model(ids), ids) * batch).backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.accumulate_microbatch(batch)
    top_level = [event.name for event in prof.events() if event.cpu_parent is None]
    return sorted(name for name in top_level if name not in METADATA_OPS), len(list(model.parameters()))


def fold_ops(precision: str) -> dict[tuple[int, int], tuple[list[str], int]]:
    """The fold's ops for 1 and 6 layers and micro-batches of 1, 3 and 5, with fp32 matrix products at
    ``precision``."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        return {(layers, batch): compute_ops_of_one_fold(layers, batch) for layers in (1, 6) for batch in (1, 3, 5)}
    finally:
        torch.set_float32_matmul_precision(before)


def test_fold_issues_batched_ops():
    """Where fp32 matrix products may round through lower precision (here: ``"high"``), every sample is scaled and
    added by one foreach op over all parameters, never by a matrix product."""
    ops = fold_ops("high")
    small_params, large_params = ops[1, 1][1], ops[6, 1][1]
    assert large_params > 4 * small_params
    for batch in (1, 3, 5):
        small, large = ops[1, batch][0], ops[6, batch][0]
        for fold in (small, large):  # per sample: one scale-and-add over all parameters (or, first, a scale adopted)
            assert fold.count("aten::_foreach_addcmul_") + fold.count("aten::_foreach_mul_") == batch
            assert fold.count("aten::_foreach_add_") == 0
            products = {"aten::mm", "aten::bmm", "aten::tensordot", "aten::addmm", "aten::mv", "aten::addmv_"}
            assert not products & set(fold)
        # norms: a fixed number of reductions per parameter tensor (blocked: see clipping.NORM_BLOCK)
        assert large.count("aten::linalg_vector_norm") <= 2 * large_params
        assert len(large) - len(small) <= 8 * (large_params - small_params)
    without_accumulation = {
        batch: len(ops[6, batch][0]) - batch for batch in (3, 5)  # no op but the per-sample scale-and-add grows
    }
    assert without_accumulation[3] == without_accumulation[5], without_accumulation


def test_cpu_fold_adds_each_parameter_by_one_matrix_vector_product():
    """On CPU at full fp32 precision, micro-batches of several samples add each parameter's clipped sum by one fp32
    matrix-vector product (``mv``, then ``addmv_``): the number of ops does not grow with the samples. One sample
    keeps the foreach scale-and-add."""
    ops = fold_ops("highest")
    for layers in (1, 6):
        params = ops[layers, 1][1]
        assert ops[layers, 1][0].count("aten::_foreach_mul_") == 1
        for batch in (3, 5):
            fold = ops[layers, batch][0]
            assert fold.count("aten::mv") == params  # the first micro-batch: the product is the sum
            assert not {"aten::_foreach_addcmul_", "aten::_foreach_mul_", "aten::mm", "aten::bmm"} & set(fold)
        assert len(ops[layers, 3][0]) == len(ops[layers, 5][0])


def test_newer_precision_api_selects_the_batched_forms(monkeypatch):
    """``torch.backends.*.fp32_precision`` (the newer API, after which `torch.get_float32_matmul_precision` raises)
    set to bf16 keeps the clipped sums off matrix products, and the step does not fail on the legacy query."""

    def legacy_query_raises() -> str:
        raise RuntimeError("mix of the legacy and new APIs")

    monkeypatch.setattr(torch, "get_float32_matmul_precision", legacy_query_raises)
    with cpu_matmul_precision("bf16"):
        fold, _ = compute_ops_of_one_fold(1, 3)
    assert fold.count("aten::_foreach_addcmul_") + fold.count("aten::_foreach_mul_") == 3
    assert not {"aten::mv", "aten::addmv_", "aten::mm", "aten::bmm"} & set(fold)
