"""The ops a DP step adds to the same non-DP step, counted (not timed): a regression in the hot path (a parallel
wrapper on one rank, a pass per tensor per micro-batch) shows up here in CI. Both sides run the same Lightning loop
on the same micro-batches; the count is per micro-batch of one optimizer step, after warm-up."""

from __future__ import annotations

import collections

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_longshield import LongShieldStrategy
from lightning_longshield.privacy.keystream_normals import BLOCK_VALUES
from tests.support.helpers import RandomTokens, loader, make_module, small_config

ACCUMULATION = 4
#: Ops that compute nothing (views, aliases, dtype dispatch, allocation): not counted.
METADATA_OPS = {
    "aten::as_strided", "aten::view", "aten::reshape", "aten::_unsafe_view", "aten::select", "aten::slice",
    "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::t", "aten::transpose", "aten::permute", "aten::alias",
    "aten::detach", "aten::result_type", "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::to",
    "aten::_to_copy", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::contiguous",
}
PROFILED_STEP = 2  # optimizer steps 0 and 1 warm up (optimizer state, lazy buffers)


class CountOps(Callback):
    """Self counts of the aten ops run during optimizer step ``PROFILED_STEP`` (every micro-batch and the update)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._profile = None

    def on_train_batch_start(self, trainer: L.Trainer, *_) -> None:
        if trainer.global_step == PROFILED_STEP and self._profile is None:
            self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._profile.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, *_) -> None:
        if self._profile is not None and trainer.global_step == PROFILED_STEP + 1 and not self.counts:
            self._profile.__exit__(None, None, None)
            self.counts.update({e.key: e.count for e in self._profile.key_averages()
                                if e.key.startswith("aten::") and e.key not in METADATA_OPS})


def op_counts(private: bool, micro_batch_size: int = 1) -> tuple[collections.Counter[str], list[torch.nn.Parameter]]:
    """Computing aten op counts of one optimizer step of ``ACCUMULATION`` micro-batches, and the trainable
    parameters."""
    module = make_module(small_config(), optimizer="adamw", learning_rate=1e-3)
    counter = CountOps()
    samples = RandomTokens(size=32 * micro_batch_size)
    if private:
        strategy = LongShieldStrategy(noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
                                      micro_batch_size=micro_batch_size, preflight=False)
        data, accumulate = loader(samples, ACCUMULATION * micro_batch_size), 1
    else:
        strategy, data, accumulate = "auto", loader(samples, micro_batch_size), ACCUMULATION
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=PROFILED_STEP + 1,
                        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[counter])
    trainer.fit(module, data)
    return counter.counts, [p for p in module.parameters() if p.requires_grad]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_one_sample_micro_batch_adds_a_bounded_number_of_ops():
    """At micro-batch 1 the DP step adds, per micro-batch, one blocked norm reduction per parameter and one fp64 sum
    of squares over all of their blocks, the clip factor, one scale-and-add per parameter (one foreach call), and once
    per step the noise (one keystream for all parameters: its Box-Muller ops once per block of values, then one
    scaled add per parameter). Measured on this model (21 parameters): 45 computing ops per micro-batch beyond
    non-DP; bounded at 2 per parameter + 10, below what one more pass over every gradient would add (66). Before: 178
    (a cast, a square and a sum per parameter after its norm), and before that 399 (19 per parameter), of which FSDP2
    on the one-rank mesh (its all-gather and reduce-scatter copies, ~74 `aten::copy_` per micro-batch beyond non-DP)
    and a per-tensor `aten::nan_to_num_` pass (23 per micro-batch)."""
    private, trainable = op_counts(True)
    baseline, _ = op_counts(False)
    parameters = len(trainable)
    assert private["aten::mm"] == baseline["aten::mm"] > 0  # the same forward and backward passes
    added = (sum(private.values()) - sum(baseline.values())) / ACCUMULATION
    assert added <= 2 * parameters + 10, (added, parameters)
    assert (private["aten::copy_"] - baseline["aten::copy_"]) / ACCUMULATION <= parameters
    assert private["aten::nan_to_num_"] <= 2 * ACCUMULATION  # the clip factors' own, not one per tensor
    assert private["aten::normal_"] == 0  # CPU noise: an AES-256-CTR keystream, not torch's generator
    blocks = -(-sum(p.numel() for p in trainable) // BLOCK_VALUES)
    added_by_noise = [private[op] - baseline[op] for op in ("aten::cos", "aten::sin_", "aten::log_")]
    assert added_by_noise == [blocks] * 3  # one draw for all parameters: Box-Muller once per block


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_micro_batch_of_several_samples_adds_a_bounded_number_of_ops():
    """With per-sample capture (micro-batch 2) every linear weight's gradient product is one ``bmm`` over the
    samples instead of non-DP's ``mm`` (as many matrix products in all), and the DP step adds, per micro-batch, one
    blocked norm and one matrix-vector product per parameter, the clip factors, the RMSNorm node's few products
    (`PerSampleRMSNorm`, in place of autograd's composite nodes and the sampler's recomputation) and once per step the
    noise. Measured on this model (21 parameters, 5 RMSNorm layers): 30 computing ops per micro-batch beyond non-DP;
    bounded at 1 per parameter + 20, below what one more pass over every per-sample gradient would add (51). With
    the RMSNorm layers behind taps, as before `PerSampleRMSNorm`: 130."""
    private, trainable = op_counts(True, micro_batch_size=2)
    baseline, _ = op_counts(False, micro_batch_size=2)
    parameters = len(trainable)
    assert private["aten::mm"] + private["aten::bmm"] == baseline["aten::mm"] > 0
    linears = sum(isinstance(module, torch.nn.Linear) for module in make_module(small_config()).modules())
    assert private["aten::bmm"] == ACCUMULATION * linears
    added = (sum(private.values()) - sum(baseline.values())) / ACCUMULATION
    assert added <= parameters + 20, (added, parameters)
    assert private["aten::linalg_vector_norm"] == ACCUMULATION * parameters  # one blocked norm per tensor


def mesh_slices(steps: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """How many times training ``steps`` DP steps slices a device mesh (`DeviceMesh.__getitem__`)."""
    from torch.distributed.device_mesh import DeviceMesh

    calls = []
    slice_mesh = DeviceMesh.__getitem__

    def counted(mesh: DeviceMesh, names: object) -> DeviceMesh:
        calls.append(names)
        return slice_mesh(mesh, names)

    monkeypatch.setattr(DeviceMesh, "__getitem__", counted)
    strategy = LongShieldStrategy(noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False, micro_batch_size=1,
                                  preflight=False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(make_module(small_config(), optimizer="adamw"), loader(RandomTokens(size=32), ACCUMULATION))
    monkeypatch.undo()
    return len(calls)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_step_slices_the_device_mesh_only_at_set_up(monkeypatch: pytest.MonkeyPatch):
    """Slicing a device mesh takes about 0.25 ms: done per micro-batch (is this run context-parallel?) it cost about
    1 ms a step at micro-batch 1. The strategy slices each dimension once per mesh."""
    assert mesh_slices(1, monkeypatch) == mesh_slices(3, monkeypatch) > 0


def autograd_nodes(output: torch.Tensor) -> int:
    """How many autograd nodes backward from ``output`` runs (every node reachable from its ``grad_fn``)."""
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
    return len(seen)


def test_per_sample_capture_adds_no_autograd_nodes():
    """With per-sample capture (micro-batch 2) the forward builds no more autograd nodes than non-DP's: a linear
    layer is one node (`PerSampleLinear`) where autograd's linear takes a matrix product and its views, an fp32 RMSNorm
    on CPU one node (`PerSampleRMSNorm`) where autograd's takes six, and every other layer adds one tap. Before, a
    forward pre-hook and hook per layer added the tap to autograd's own nodes: 188 nodes against non-DP's 183 on this
    two-block model; then 143 with `PerSampleLinear`, now 113."""
    from lightning_longshield.models import Llama
    from lightning_longshield.privacy import PerSampleGradCapture

    torch.manual_seed(0)
    model = Llama(small_config())
    ids = torch.randint(0, 64, (2, 16))
    baseline = autograd_nodes(model(ids).sum())
    capture = PerSampleGradCapture(model)
    capture.start_microbatch(2)
    assert capture.enabled
    assert autograd_nodes(model(ids).sum()) <= baseline
