"""DP-safe activation checkpointing (V3): same updates as without it, activations really freed, no leak."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.checkpoint import checkpoint

from lightning_longshield import LongShieldStrategy
from lightning_longshield.activation_checkpointing import CheckpointedForward, apply_activation_checkpointing
from lightning_longshield.loss import per_sample_token_loss
from lightning_longshield.models import Llama
from lightning_longshield.privacy import PerSampleGradCapture
from tests.support.helpers import (
    CountLiveTensors,
    RandomTokens,
    assert_models_close,
    loader,
    make_module,
    make_trainer,
    reference_dp_sgd,
    samples,
    small_config,
)

CLIP, BATCH = 0.05, 4


class CheckpointedBlocks(Callback):
    """Records which of the model's blocks are checkpointed while it trains."""

    def on_train_start(self, trainer, pl_module):
        self.pattern = [isinstance(b.__dict__.get("forward"), CheckpointedForward) for b in pl_module.model.layers]


def fit_and_compare(policy, micro_batch_size: int, tie_embeddings: bool = False, module=None) -> LongShieldStrategy:
    dataset = RandomTokens(size=8, seq_len=16)
    module = module or make_module(small_config(n_layers=3, tie_embeddings=tie_embeddings))
    initial = copy.deepcopy(module.model)
    strategy = LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=CLIP, micro_batch_size=micro_batch_size,
                                  poisson_sampling=False, activation_checkpointing=policy, seed=0)
    strategy.checkpointed = CheckpointedBlocks()
    make_trainer(strategy, max_steps=2, callbacks=[strategy.checkpointed]).fit(module, loader(dataset, BATCH))
    batches = [samples(dataset, range(k * BATCH, (k + 1) * BATCH)) for k in range(2)]
    for block in initial.layers:  # the reference runs without checkpointing
        block.__dict__.pop("forward", None)
    assert_models_close(module.model, reference_dp_sgd(initial, batches, CLIP, BATCH))
    return strategy


@pytest.mark.parametrize("micro_batch_size", [1, 2])
@pytest.mark.parametrize(
    "policy, expected",
    [(True, [True] * 3), (2, [True, False, True]), (lambda index, block: index == 1, [False, True, False])],
    ids=["all", "every-2nd", "callable"],
)
def test_checkpointed_updates_match_reference(policy, expected, micro_batch_size):
    strategy = fit_and_compare(policy, micro_batch_size, tie_embeddings=micro_batch_size == 2)
    assert strategy.checkpointed.pattern == expected
    # Given back after the fit: a wrapper left in place ran a layer frozen in this fit and trainable in the next
    # inside a checkpoint, beside its per-sample capture (silently wrong gradients).
    assert not any(isinstance(m.__dict__.get("forward"), CheckpointedForward)
                   for m in strategy.lightning_module.modules())


def test_trainable_layers_in_a_module_list_are_not_checkpointed():
    """A list of plain layers is not a list of blocks: checkpointing a layer keeps its input, all it saves anyway, and
    its recomputation would run outside the capture (with the real parameters where the first forward had detached
    ones). With B x T equal to the width the recomputed input silently took the weight's place."""

    class LinearList(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(64, 8)
            self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])
            self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())])
            self.head = torch.nn.Linear(8, 64, bias=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.emb(ids)
            for layer in [*self.layers, *self.blocks]:
                h = h + torch.tanh(layer(h))
            return self.head(h)

    torch.manual_seed(0)
    model = LinearList()
    ids = torch.randint(0, 64, (2, 4))  # B x T = 8, the width

    def per_sample_gradients(net: torch.nn.Module) -> dict[str, torch.Tensor]:
        capture = PerSampleGradCapture(net)
        capture.start_microbatch(2)
        per_sample_token_loss(net(ids), ids).sum().backward()
        grads = capture.collect()
        capture.remove()
        return grads

    expected = per_sample_gradients(copy.deepcopy(model))
    assert apply_activation_checkpointing(model, True) == 1  # the block only
    assert not any(isinstance(layer.__dict__.get("forward"), CheckpointedForward) for layer in model.layers)
    got = per_sample_gradients(model)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, msg=name)
    with pytest.raises(TypeError, match="a list of trainable layers"):
        apply_activation_checkpointing(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)])), True)


class MixtureBlock(torch.nn.Module):
    """A block holding a list of its own (experts): part of the block, not blocks of the model."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(4, 4)) for _ in range(3)])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + sum(torch.tanh(expert(h)) for expert in self.experts)


def checkpointed(modules: list[torch.nn.Module]) -> list[bool]:
    return [isinstance(module.__dict__.get("forward"), CheckpointedForward) for module in modules]


@pytest.mark.parametrize("root_list", [False, True], ids=["attribute", "root"])
def test_an_int_policy_counts_the_outermost_blocks_not_lists_inside_them(root_list):
    blocks = [MixtureBlock() for _ in range(4)]
    model = torch.nn.ModuleList(blocks) if root_list else torch.nn.Sequential(torch.nn.ModuleList(blocks))
    assert apply_activation_checkpointing(model, 2) == 2
    assert checkpointed(blocks) == [True, False, True, False]
    experts = [expert for block in blocks for expert in block.experts]
    assert not any(checkpointed(experts))  # no checkpoint inside a checkpoint, none counted
    assert apply_activation_checkpointing(model, True) == 4 and not any(checkpointed(experts))
    h = torch.randn(2, 4, requires_grad=True)
    for block in blocks:
        h = block(h)
    h.sum().backward()  # checkpointed blocks recompute their experts once


def test_blocks_grouped_in_lists_of_lists_are_the_blocks():
    """Stages of blocks (a list of lists): the blocks are checkpointed, not the stages' lists."""
    blocks = [MixtureBlock() for _ in range(4)]
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.ModuleList(blocks[:2]), torch.nn.ModuleList(blocks[2:])]))
    assert apply_activation_checkpointing(model, 2) == 2 and checkpointed(blocks) == [True, False, True, False]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_model_with_its_own_checkpointing_is_handled(use_reentrant):
    """A model that checkpoints inside DP-hooked layers still gets exact per-sample gradients."""
    module = make_module(small_config(n_layers=2))
    for block in module.model.layers:
        forward = block.forward
        block.forward = lambda *a, f=forward: checkpoint(f, *a, use_reentrant=use_reentrant)
    fit_and_compare(False, micro_batch_size=2, module=module)


class KeywordBlock(torch.nn.Module):
    """A block whose keyword arguments share names with `checkpoint`'s options, and one a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.seen: dict[str, object] = {}

    def forward(self, x: torch.Tensor, scale: torch.Tensor, **options: object) -> torch.Tensor:
        self.seen = options
        return self.lin(x) * scale * (2.0 if options.get("debug") else 1.0)


def test_a_checkpointed_block_gets_its_keyword_arguments():
    """``debug``, ``context_fn``, ``determinism_check``, ``preserve_rng_state`` and ``use_reentrant`` given to a
    checkpointed block reach its forward (checkpoint took them as its options, or refused ``use_reentrant``), and a
    tensor keyword gets the same gradient as without checkpointing."""
    options = dict(debug=True, context_fn="mine", determinism_check="mine", preserve_rng_state="mine",
                   use_reentrant="mine")
    torch.manual_seed(0)
    model = torch.nn.ModuleList([KeywordBlock()])
    x, scale = torch.randn(2, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    expected = model[0](x, scale=scale, **options)
    expected_grads = torch.autograd.grad(expected.square().sum(), (x, scale, model[0].lin.weight))
    assert apply_activation_checkpointing(torch.nn.Sequential(model), True) == 1
    out = model[0](x, scale=scale, **options)
    assert model[0].seen == options
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    grads = torch.autograd.grad(out.square().sum(), (x, scale, model[0].lin.weight))
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)


def test_keyword_tensors_reach_checkpoint_as_its_arguments(monkeypatch):
    """Torch saves and restores the RNG state (dropout's) of the devices of the tensors `checkpoint` is given: bound
    in a ``partial``, the tensors of a block called with keywords alone were hidden from it, and on a GPU its
    recomputation drew other dropout masks. A wrapper's forward is given back afterwards."""
    from lightning_longshield import activation_checkpointing as ac

    given = []

    def recording(function, *args, **options):
        given.extend(args)
        return checkpoint(function, *args, **options)

    monkeypatch.setattr(ac, "checkpoint", recording)
    model = torch.nn.ModuleList([KeywordBlock()])
    x, scale = torch.randn(2, 4), torch.randn(4)
    expected = model[0](x=x, scale=scale)
    ac.apply_activation_checkpointing(torch.nn.Sequential(model), True)
    torch.testing.assert_close(model[0](x=x, scale=scale), expected, rtol=0, atol=0)
    assert any(value is x for value in given) and any(value is scale for value in given)
    ac.remove_activation_checkpointing(model)
    assert "forward" not in model[0].__dict__


def saved_tensor_bytes(model: torch.nn.Module, micro_batch: int = 2, seq_len: int = 256) -> int:
    """Bytes of the tensors autograd saves for backward during one per-sample-mode forward."""
    capture = PerSampleGradCapture(model)
    capture.start_microbatch(micro_batch)
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    ids = torch.randint(0, 64, (micro_batch, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = per_sample_token_loss(model(ids), ids).sum()
    loss.backward()
    capture.collect()
    capture.remove()
    return total


def test_checkpointing_saves_only_block_inputs_and_what_lies_outside_blocks():
    torch.manual_seed(0)
    n_layers, micro_batch, seq_len, dim = 4, 2, 256, 64
    model = Llama(small_config(n_layers=n_layers, dim=dim, ffn_dim=256))
    without = saved_tensor_bytes(model, micro_batch, seq_len)
    apply_activation_checkpointing(model, True)
    with_checkpointing = saved_tensor_bytes(model, micro_batch, seq_len)
    blocks = list(model.layers)
    model.layers = torch.nn.ModuleList()
    outside_blocks = saved_tensor_bytes(model, micro_batch, seq_len)
    model.layers = torch.nn.ModuleList(blocks)
    block_inputs = n_layers * micro_batch * seq_len * dim * 4
    assert with_checkpointing == outside_blocks + block_inputs
    assert with_checkpointing < without / 2


@pytest.mark.slow
def test_no_leak_across_steps():
    counter = CountLiveTensors((5, 50))
    # Fixed logical batches: with secret Poisson sampling the two counted steps would hold batches of different sizes
    # (a one-sample micro-batch and a longer one keep different tensors), which is no leak.
    strategy = LongShieldStrategy(noise_multiplier=1.0, micro_batch_size=2, activation_checkpointing=True, seed=0,
                                  poisson_sampling=False)
    make_trainer(strategy, max_steps=50, callbacks=[counter]).fit(
        make_module(small_config(n_layers=2), optimizer="adamw", learning_rate=1e-3), loader(RandomTokens(size=64), 4)
    )
    assert counter.counts[50] <= counter.counts[5] + 5, counter.counts


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_with_checkpointing_equals_bf16_without(precision):
    updates = []
    for policy in (False, True):
        module = make_module(small_config(n_layers=2))
        strategy = LongShieldStrategy(noise_multiplier=0.5, micro_batch_size=2, poisson_sampling=False,
                                      activation_checkpointing=policy, noise_seed=3)
        make_trainer(strategy, max_steps=2, precision=precision).fit(module, loader(RandomTokens(size=8), BATCH))
        updates.append(torch.cat([p.detach().float().flatten() for p in module.parameters()]))
    torch.testing.assert_close(updates[0], updates[1])


@pytest.mark.slow
def test_checkpoint_and_resume_with_checkpointing(tmp_path):
    def run(max_steps, ckpt_path=None, save=None):
        module = make_module(small_config(n_layers=2), optimizer="adamw", learning_rate=1e-2)
        strategy = LongShieldStrategy(noise_multiplier=0.7, micro_batch_size=2, activation_checkpointing=True,
                                      noise_seed=4)
        trainer = make_trainer(strategy, max_steps=max_steps)
        trainer.fit(module, loader(RandomTokens(size=16), BATCH), ckpt_path=ckpt_path)
        if save:
            trainer.save_checkpoint(save)
        return module

    run(2, save=tmp_path / "ac.ckpt")
    resumed = run(4, ckpt_path=tmp_path / "ac.ckpt")
    assert_models_close(resumed.model, run(4).model, rtol=0, atol=0)


def test_opacus_hooks_with_checkpointing_keep_activations_alive():
    """Why V3 exists: Opacus's hook-based capture pins the first forward's activations under checkpointing."""
    from opacus import GradSampleModule

    torch.manual_seed(0)
    model = Llama(small_config(n_layers=2))
    apply_activation_checkpointing(model, True)
    dp_model = GradSampleModule(model, batch_first=True, loss_reduction="sum")  # the "hooks" mode
    ids = torch.randint(0, 64, (2, 16))
    pinned = []
    for _ in range(3):
        per_sample_token_loss(dp_model(ids), ids).sum().backward()
        pinned.append(sum(len(getattr(m, "activations", None) or []) for m in model.modules()))
        dp_model.zero_grad()
    assert pinned[0] > 0 and pinned[2] > pinned[0], f"dangling activations per step: {pinned}"


@pytest.mark.slow
def test_peak_memory_of_a_step_drops_with_checkpointing():
    """Peak RSS growth of one training step, each in a fresh process, with large allocations returned to the OS
    (glibc would otherwise keep freed blocks in its heap and hide what is live)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    growth = {}
    for flag in ("0", "1"):
        result = subprocess.run([sys.executable, "-m", "tests.support.ac_memory_probe", flag], env=env,
                                capture_output=True, text=True, check=True, cwd=root)
        growth[flag] = json.loads(result.stdout.strip().splitlines()[-1])["step_peak_growth"]
    # Six blocks: without checkpointing all their activations are alive at the start of backward; with it, only
    # their inputs and one block's recomputation. Activations dominate this model, so expect at least half saved.
    assert growth["1"] < 0.5 * growth["0"], growth
