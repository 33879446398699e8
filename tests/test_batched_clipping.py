"""Clipping and accumulation are batched: the number of compute ops per micro-batch does not grow with the number
of parameter tensors (counted with the profiler on CPU, where CUDA would launch the same ops as kernels)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from helpers import small_config
from lightning_longshield.loss import causal_lm_loss
from lightning_longshield.models import Llama
from lightning_longshield.privacy import DPSGDEngine, GaussianNoise, PrivacyAccountant

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


@pytest.mark.parametrize("batch", [1, 3])
def test_fold_issues_a_constant_number_of_batched_ops(batch):
    small, small_params = compute_ops_of_one_fold(layers=1, batch=batch)
    large, large_params = compute_ops_of_one_fold(layers=6, batch=batch)
    assert large_params > 4 * small_params
    assert small == large, (small, large)
    assert small.count("aten::_foreach_norm") == 1
    assert small.count("aten::_foreach_mul_") == batch  # per sample: one scale over all parameters
    assert small.count("aten::_foreach_add_") <= batch  # and one add (the first sample of a sum is adopted)
    assert len(small) <= 20 + batch, small  # the rest act on B-element vectors: norms, factors
    assert not {"aten::mm", "aten::bmm", "aten::tensordot", "aten::addmm"} & set(small)
