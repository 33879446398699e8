"""Poisson sampling gives data-parallel groups different numbers of micro-batches (none, in some steps). With FSDP2
over every rank (``shard_over="all"``, ZeRO-DP+) every rank must still issue the same collectives: groups with fewer
samples run zero-weight padding micro-batches. The run must finish and equal the per-sample-loop reference over the
union of the groups' samples (the padding adds exactly nothing); the default layout (FSDP2 per CP group) as well."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support.helpers import layer_bounds, make_module, reference_dp_sgd, small_config
from tests.support.process_runner import run_processes
from tests.support.uneven_poisson_workers import CLIP, COLLECTIVE_TIMEOUT, GROUP_BATCH, RUNS, STEPS, fit_uneven_groups


@pytest.mark.slow
@pytest.mark.timeout(100)
def test_uneven_and_empty_poisson_groups_do_not_deadlock_and_match_reference(tmp_path):
    run_processes(2, tmp_path, fit_uneven_groups, str(tmp_path), timeout=COLLECTIVE_TIMEOUT)
    check_against_reference(torch.load(tmp_path / "uneven_poisson.pt", weights_only=False), RUNS)


def check_against_reference(results: dict, runs: dict) -> None:
    """Every run released `STEPS` steps, each equal to the reference over the union of the groups' batches."""
    initial = make_module(small_config()).model
    for name, kwargs in runs.items():
        result = results[name]
        assert result["steps"] == result["global_step"] == STEPS, f"{name}: every logical batch is one released step"
        # Logical batch k: the union of the data-parallel groups' k-th batches.
        logical = [[{"input_ids": group[k]["input_ids"][i], "labels": group[k]["labels"][i]}
                    for group in result["batches"] for i in range(len(group[k]["input_ids"]))]
                   for k in range(STEPS)]
        bounds = layer_bounds(initial, CLIP) if kwargs.get("clipping") == "per_layer" else None
        for step, state in enumerate(result["states"]):
            reference = reference_dp_sgd(copy.deepcopy(initial), logical[: step + 1], CLIP, 2 * GROUP_BATCH,
                                         layer_thresholds=bounds).state_dict()
            for param, value in reference.items():
                torch.testing.assert_close(
                    state[param], value, rtol=1e-4, atol=1e-6,
                    msg=lambda m, p=param, s=step, run=name, sizes=result["sizes"]:
                        f"{run} step {s + 1} (sizes {sizes}) {p}: {m}",
                )
