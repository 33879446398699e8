"""Per-layer clipping: the DP-SGD update equals an independent per-sample loop that clips each parameter's gradient to
its own bound C_l (micro-batches 1/2/4, with and without activation checkpointing, tied embeddings as one layer);
the bounds (equal, proportional, explicit) and their validation; every sample's clipped contribution has norm <= C
after rounding; per-sample gradients are clipped and freed layer by layer during backward."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from lightning_longshield import LongShieldStrategy
from lightning_longshield.loss import per_sample_token_loss
from lightning_longshield.models import Llama
from lightning_longshield.privacy import DPSGDEngine, GaussianNoise, PrivacyAccountant
from lightning_longshield.privacy.accumulator import ClippedGradientSum
from lightning_longshield.privacy.clipping import clip_factors, per_parameter_squared_norms
from lightning_longshield.privacy.grad_sample.exchange import LocalExchange
from lightning_longshield.privacy.per_layer import (
    FUSED_KERNEL_TOKEN_LIMIT,
    PerLayerClipper,
    fused_kernel_margin,
    per_layer_thresholds,
)
from simulate.strategy_config import PerLayerClipping, StrategyConfig
from tests.support.helpers import (
    AtenOpCounts,
    RandomTokens,
    assert_models_close,
    full_state,
    layer_bounds,
    loader,
    make_module,
    make_trainer,
    reference_dp_sgd,
    reference_sample_loss,
    samples,
    small_config,
)

CLIP = 0.05
BATCH = 4
STEPS = 2


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def fit(module, max_grad_norm: float, steps: int = STEPS, **strategy_kwargs) -> LongShieldStrategy:
    strategy = LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=max_grad_norm, poisson_sampling=False, seed=0,
                                  **{"clipping": "per_layer", **strategy_kwargs})
    make_trainer(strategy, max_steps=steps).fit(module, loader(RandomTokens(size=BATCH * steps, seq_len=16), BATCH))
    return strategy


def batches(steps: int = STEPS) -> list[list[dict[str, torch.Tensor]]]:
    dataset = RandomTokens(size=BATCH * steps, seq_len=16)
    return [samples(dataset, range(k * BATCH, (k + 1) * BATCH)) for k in range(steps)]


# ------------------------------------------------------------------------------------------- update vs reference


@pytest.mark.parametrize("activation_checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("micro_batch_size", [1, 2, 4])
@pytest.mark.parametrize("max_grad_norm", [CLIP, 1e6], ids=["clipping", "no-clipping"])
def test_updates_match_per_layer_reference(max_grad_norm, micro_batch_size, activation_checkpointing):
    module = make_module(small_config())
    initial = copy.deepcopy(module.model)
    fit(module, max_grad_norm, micro_batch_size=micro_batch_size, activation_checkpointing=activation_checkpointing)
    expected = reference_dp_sgd(initial, batches(), max_grad_norm, BATCH,
                                layer_thresholds=layer_bounds(initial, max_grad_norm))
    assert_models_close(module.model, expected)


@pytest.mark.parametrize("micro_batch_size", [1, 2])
def test_the_tensor_path_updates_match_the_reference(micro_batch_size, monkeypatch):
    """The factors as tensor ops and the sums without a host read in backward (every device but CPU; micro-batch 1:
    after backward, with one check) give the per-sample loop's update."""
    from lightning_longshield.privacy import per_layer

    monkeypatch.setattr(per_layer, "_factors_on_host", lambda squared: False)
    module = make_module(small_config())
    initial = copy.deepcopy(module.model)
    fit(module, CLIP, micro_batch_size=micro_batch_size)
    expected = reference_dp_sgd(initial, batches(), CLIP, BATCH, layer_thresholds=layer_bounds(initial, CLIP))
    assert_models_close(module.model, expected)


@pytest.mark.parametrize("micro_batch_size", [1, 2])
def test_tied_embeddings_are_one_layer(micro_batch_size):
    """The tied weight has one bound, and its gradient (the sum of both uses) is clipped as one."""
    module = make_module(small_config(tie_embeddings=True))
    initial = copy.deepcopy(module.model)
    strategy = fit(module, CLIP, micro_batch_size=micro_batch_size)
    bounds = layer_bounds(initial, CLIP)
    assert len(strategy.dp_engine.per_layer.thresholds) == len(bounds) == 2 * 9 + 2  # 9 per block, embedding, norm
    assert_models_close(module.model, reference_dp_sgd(initial, batches(), CLIP, BATCH, layer_thresholds=bounds))


def test_proportional_and_explicit_thresholds_match_reference():
    """Bounds C sqrt(n_l / N), and an explicit mapping (one bound per parameter, uneven), named as the module's."""
    config = small_config(n_layers=1)
    initial = make_module(config).model
    proportional = layer_bounds(initial, CLIP, "proportional")
    weights = {name: 1.0 + index for index, name in enumerate(trainable(initial))}
    scale = CLIP / math.sqrt(sum(w * w for w in weights.values()))
    explicit = {name: w * scale for name, w in weights.items()}
    for spec, bounds in (("proportional", proportional), ({f"model.{n}": c for n, c in explicit.items()}, explicit)):
        module = make_module(config)
        fit(module, CLIP, micro_batch_size=2, clipping=PerLayerClipping(thresholds=spec))
        assert_models_close(module.model, reference_dp_sgd(initial, batches(), CLIP, BATCH, layer_thresholds=bounds))


def test_clipping_is_active_and_per_layer_differs_from_flat():
    """Guard against vacuous comparisons: at C = 0.05 every sample with a gradient has clipped layers, and 20-80% of
    all (sample, layer) gradients exceed their bounds (both cases in one step); at 1e6 none does; the per-layer
    update is far from the flat one. The engine reports each sample's unclipped norm over all layers."""
    model = make_module(small_config()).model
    bounds = layer_bounds(model, CLIP)
    params = trainable(model)
    batch = batches(1)[0]
    layer_norms = []
    for sample in batch:
        grads = torch.autograd.grad(reference_sample_loss(model, sample["input_ids"], sample["labels"]),
                                    list(params.values()))
        layer_norms.append(torch.stack([g.double().norm() for g in grads]))
    layer_norms = torch.stack(layer_norms)  # (B, L)
    clipped = layer_norms > torch.tensor(list(bounds.values()), dtype=torch.float64)
    assert clipped[layer_norms.sum(1) > 0].any(1).all() and 0.2 < clipped.double().mean() < 0.8
    assert (layer_norms < 1e6 / math.sqrt(len(bounds))).all()
    flat = reference_dp_sgd(model, [batch], CLIP, BATCH)
    per_layer = reference_dp_sgd(model, [batch], CLIP, BATCH, layer_thresholds=bounds)
    start, flat_update, layer_update = (torch.cat([p.detach().flatten() for p in m.parameters()])
                                        for m in (model, flat, per_layer))
    assert ((layer_update - flat_update).norm() / (flat_update - start).norm()) > 0.1

    module = make_module(small_config())
    strategy = fit(module, CLIP, steps=1, micro_batch_size=BATCH)
    torch.testing.assert_close(strategy.dp_engine.last_per_sample_norms, layer_norms.square().sum(1).sqrt(),
                               rtol=1e-5, atol=1e-9)


# ------------------------------------------------------------------------------------------- bounds and errors


def test_threshold_rules():
    model = Llama(small_config(tie_embeddings=True))
    params = trainable(model)
    equal = per_layer_thresholds(params, 2.0, "equal")
    proportional = per_layer_thresholds(params, 2.0, "proportional")
    assert list(equal) == list(params) and "output.weight" not in equal  # tied: one entry, the first name
    assert set(equal.values()) == {2.0 / math.sqrt(len(params))}
    total = sum(p.numel() for p in params.values())
    assert proportional["tok_embeddings.weight"] == pytest.approx(2.0 * math.sqrt(64 * 32 / total))
    for bounds in (equal, proportional):
        assert sum(c * c for c in bounds.values()) == pytest.approx(4.0, rel=1e-12)
    explicit = {name: 2.0 / math.sqrt(len(params)) for name in params}
    assert per_layer_thresholds(params, 2.0, explicit) == explicit


def test_explicit_thresholds_are_validated():
    params = trainable(Llama(small_config(n_layers=1, tie_embeddings=True)))
    names = list(params)
    bound = 1.0 / math.sqrt(len(names))
    with pytest.raises(ValueError, match=r"Missing: \['norm.weight'\]"):
        per_layer_thresholds(params, 1.0, {name: bound for name in names if name != "norm.weight"})
    with pytest.raises(ValueError, match=r"not trainable parameters: \['output.weight'\]"):
        per_layer_thresholds(params, 1.0, {**{name: bound for name in names}, "output.weight": bound})
    with pytest.raises(ValueError, match="sum of squares .* Scale the thresholds down or raise max_grad_norm"):
        per_layer_thresholds(params, 1.0, {name: bound * 1.001 for name in names})
    per_layer_thresholds(params, 1.0, {name: bound * (1 + 1e-12) for name in names})  # decimal rounding is fine
    with pytest.raises(ValueError, match="finite numbers > 0"):
        per_layer_thresholds(params, 1.0, {**{name: bound for name in names}, names[0]: 0.0})


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(clipping="layerwise"), ValueError, "choose one of"),
    (dict(clipping="per_layer", norms="ghost"), ValueError, "use norms='materialize'"),
    (dict(clipping="per_layer", norms="mixed"), ValueError, "use norms='materialize'"),
    (dict(clipping="per_layer", norms="hutchinson"), ValueError, "use norms='materialize'"),
])
def test_bad_clipping_arguments_name_the_fix(kwargs, error, message):
    with pytest.raises(error, match=message):
        LongShieldStrategy(noise_multiplier=1.0, **kwargs)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(thresholds="uniform"), ValueError, "choose one of"),
    (dict(thresholds=[0.1]), TypeError, "mapping"),
    (dict(kernel="cuda"), ValueError, "choose one of"),
])
def test_bad_per_layer_settings_name_the_fix(kwargs, error, message):
    with pytest.raises(error, match=message):
        PerLayerClipping(**kwargs)


def test_missing_threshold_stops_fit_before_any_step():
    module = make_module(small_config(n_layers=1))
    initial = copy.deepcopy(module.model.state_dict())
    with pytest.raises(ValueError, match="Missing: .*model.norm.weight"):
        fit(module, 1.0, steps=1, clipping=PerLayerClipping(thresholds={"model.tok_embeddings.weight": 0.5}))
    assert all(torch.equal(value, initial[name]) for name, value in full_state(module.model).items())


# ------------------------------------------------------------------------------------------- sensitivity


def contribution_norms(grad_samples: dict[str, torch.Tensor], bounds: dict[str, float]) -> torch.Tensor:
    """The fp64 norm of each sample's clipped contribution over all layers, as the accumulator adds it (through the
    factors' host or tensor path, whichever `_factors_on_host` picks)."""
    params = {name: nn.Parameter(g[0].float()) for name, g in grad_samples.items()}
    norms = []
    for i in range(next(iter(grad_samples.values())).shape[0]):
        single = ClippedGradientSum(params)
        clipper = PerLayerClipper(bounds, single, LocalExchange())
        clipper.start_microbatch(1, torch.device("cpu"))
        clipper.clip({name: g[i : i + 1] for name, g in grad_samples.items()})
        norms.append(math.sqrt(sum(s.double().square().sum().item() for s in single.sums.values())))
    return torch.tensor(norms, dtype=torch.float64)


@pytest.mark.parametrize("factors", ["host", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule", ["equal", "proportional", "explicit"])
def test_every_contribution_is_at_most_c_after_rounding(dtype, rule, factors, monkeypatch):
    """Random per-sample gradients (values spanning many binades): in the first half of the samples every layer's
    norm is from 1 + 1e-7 to 1e3 times its bound, in the second half from 1e-3 to 1e3 times, independently per
    layer. Every sample's clipped contribution over all layers has norm <= C, and is C (to within the rounding of the
    gradients) where every layer was clipped: with the factors on the host (CPU) and as tensor ops with the
    sync-free sums (every other device)."""
    if factors == "tensor":
        from lightning_longshield.privacy import per_layer

        monkeypatch.setattr(per_layer, "_factors_on_host", lambda squared: False)
    generator = torch.Generator().manual_seed(0)
    shapes = {"a": (257,), "b": (31, 17), "c": (4096,), "d": (3,)}
    batch, max_grad_norm = 64, 0.3
    params = {name: nn.Parameter(torch.zeros(shape)) for name, shape in shapes.items()}
    spec = {"a": 0.1, "b": 0.2, "c": 0.05, "d": math.sqrt(0.09 - 0.01 - 0.04 - 0.0025)} if rule == "explicit" else rule
    bounds = per_layer_thresholds(params, max_grad_norm, spec)
    half = batch // 2
    grad_samples = {}
    for name, shape in shapes.items():
        values = torch.randn((batch, *shape), generator=generator, dtype=torch.float64)
        values *= torch.exp(3 * torch.rand((batch, *shape), generator=generator, dtype=torch.float64))
        above = 1 + torch.logspace(-7, 3, half, dtype=torch.float64)
        mixed = torch.logspace(-3, 3, batch - half, dtype=torch.float64)[torch.randperm(batch - half,
                                                                                        generator=generator)]
        scale = bounds[name] * torch.cat([above, mixed]) / values.flatten(1).norm(dim=1)
        grad_samples[name] = (values * scale.view(-1, *[1] * len(shape))).to(dtype)
    norms = contribution_norms(grad_samples, bounds)
    assert (norms <= max_grad_norm).all(), (norms.max() - max_grad_norm).item()
    slack = 1e-4 if dtype == torch.float32 else 1e-2  # a 3-element bf16 gradient's norm moves by up to ~2^-9
    assert (norms[:half] >= max_grad_norm * (1 - slack)).all()


def test_the_cpu_clipper_adds_what_the_tensor_factors_add():
    """On CPU the clipper computes its factors (and running norms) on the host: the clipped sums and norms equal
    those of `clip_factors` and tensor sums (every other device's path) bit for bit, a non-finite sample included,
    and whether a sample's factor is 0 (its inf and NaN zeroed) is read off the host factors, not by tensor ops."""
    generator = torch.Generator().manual_seed(0)
    shapes, bounds, batch = {"a": (257,), "b": (31, 17), "c": (4096,)}, {"a": 0.1, "b": 0.2, "c": 0.05}, 8
    params = {name: nn.Parameter(torch.zeros(shape)) for name, shape in shapes.items()}
    grads = {}
    for name, shape in shapes.items():
        scale = bounds[name] * torch.logspace(-2, 2, batch) / math.sqrt(math.prod(shape))
        grads[name] = torch.randn((batch, *shape), generator=generator) * scale.view(-1, *[1] * len(shape))
    grads["b"][3, 0, 0] = math.inf
    clipped, reference = ClippedGradientSum(params), ClippedGradientSum(params)
    clipper = PerLayerClipper(bounds, clipped, LocalExchange())
    clipper.start_microbatch(batch, torch.device("cpu"))
    expected_norms = torch.zeros(batch, dtype=torch.float64)
    factors = {}
    for name, grad in grads.items():  # a layer at a time, as backward delivers them
        squared = per_parameter_squared_norms([grad], batch)
        expected_norms += squared.sum(0)
        factors[name] = clip_factors(squared, torch.tensor([[bounds[name]]], dtype=torch.float64))
        reference.add({name: grad.clone()}, factors[name])
        with AtenOpCounts() as ops:
            clipper.clip({name: grad.clone()})
        assert ops.counts["eq"] + ops.counts["any"] == 0
        assert ops.counts["nan_to_num_"] == (1 if name == "b" else 0)
    assert all(torch.equal(clipped.sums[name], reference.sums[name]) for name in shapes)
    assert torch.equal(clipper.squared_norms, expected_norms)
    every = torch.cat(list(factors.values()), dim=1)
    assert (every == 1).any() and ((every > 0) & (every < 1)).any() and factors["b"][0, 3] == 0


def test_the_tensor_path_keeps_each_groups_bounds_on_the_device(monkeypatch):
    """Where factors are tensor ops (a GPU), each group's bounds are made once, not copied to the device at every
    layer and micro-batch (a host sync each in backward), and no value is read on the host (before, one per layer:
    whether a factor was 0); the sums equal those of `clip_factors`' factors over two micro-batches."""
    from lightning_longshield.privacy import per_layer

    monkeypatch.setattr(per_layer, "_factors_on_host", lambda squared: False)
    generator = torch.Generator().manual_seed(1)
    shapes, bounds, batch = {"a": (257,), "b": (31, 17)}, {"a": 0.1, "b": 0.2}, 4
    params = {name: nn.Parameter(torch.zeros(shape)) for name, shape in shapes.items()}
    clipped, reference = ClippedGradientSum(params), ClippedGradientSum(params)
    clipper = PerLayerClipper(bounds, clipped, LocalExchange())
    columns = []
    for _ in range(2):
        clipper.start_microbatch(batch, torch.device("cpu"))
        for name, shape in shapes.items():
            scale = bounds[name] * torch.logspace(-1, 1, batch) / math.sqrt(math.prod(shape))  # some clipped
            grad = torch.randn((batch, *shape), generator=generator) * scale.view(-1, *[1] * len(shape))
            factors = clip_factors(per_parameter_squared_norms([grad], batch),
                                   torch.tensor([[bounds[name]]], dtype=torch.float64))
            reference.add({name: grad.clone()}, factors, sync_free=True)
            with AtenOpCounts() as ops:
                clipper.clip({name: grad.clone()})
            assert ops.counts["_local_scalar_dense"] + ops.counts["item"] == 0  # no value read on the host
        columns.append(dict(clipper._threshold_columns))
    assert set(columns[0]) == {("a",), ("b",)}
    assert all(columns[1][key] is column for key, column in columns[0].items())  # made once
    assert all(torch.equal(clipped.sums[name], reference.sums[name]) for name in shapes)


def test_a_backward_with_per_layer_clipping_reads_nothing_on_the_host(monkeypatch):
    """Where the factors are tensor ops (a GPU), a whole micro-batch's backward, in which every layer is clipped,
    reads no tensor value on the host: each such read would be a sync that leaves the GPU idle until the next launch
    (584 of them a step made per-layer clipping 1.290x non-DP's step on an H100, against V2's 1.040x)."""
    from lightning_longshield.privacy import per_layer

    monkeypatch.setattr(per_layer, "_factors_on_host", lambda squared: False)
    torch.manual_seed(0)
    model = Llama(small_config())
    engine = DPSGDEngine(model, CLIP, GaussianNoise(torch.device("cpu")), PrivacyAccountant("rdp"),
                         config=StrategyConfig(clipping=PerLayerClipping()))
    ids = torch.randint(0, 64, (BATCH, 16), generator=torch.Generator().manual_seed(0))
    engine.begin_logical_batch()
    engine.prepare_microbatch(BATCH)
    loss = per_sample_token_loss(model(ids), ids).mean() * BATCH
    with AtenOpCounts() as ops:
        loss.backward()
    assert ops.counts["bmm"] > 0 and ops.counts["linalg_vector_norm"] > 0  # every layer was clipped in backward
    assert ops.counts["_local_scalar_dense"] + ops.counts["item"] == 0


def test_a_one_sample_micro_batch_is_clipped_after_backward_with_one_check(monkeypatch):
    """At micro-batch 1 every layer's ``.grad`` is clipped after backward, all at once: there one host check (is some
    factor 0?) costs less than zeroing inf and NaN in every gradient, which clipping in backward does instead."""
    from lightning_longshield.privacy import per_layer

    monkeypatch.setattr(per_layer, "_factors_on_host", lambda squared: False)
    torch.manual_seed(0)
    model = Llama(small_config())
    engine = DPSGDEngine(model, CLIP, GaussianNoise(torch.device("cpu")), PrivacyAccountant("rdp"),
                         config=StrategyConfig(clipping=PerLayerClipping()))
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    engine.begin_logical_batch()
    engine.prepare_microbatch(1)
    per_sample_token_loss(model(ids), ids).sum().backward()
    with AtenOpCounts() as ops:
        engine.accumulate_microbatch(1)
    assert ops.counts["_local_scalar_dense"] == 1
    assert ops.counts["nan_to_num_"] == 1  # the quotients' in `clip_factors`; no pass over the gradients


# ------------------------------------------------------------------------------------------- memory


def run_microbatch(engine: DPSGDEngine, model: nn.Module, size: int) -> None:
    ids = torch.randint(0, 64, (size, 16), generator=torch.Generator().manual_seed(0))
    engine.begin_logical_batch()
    engine.prepare_microbatch(size)
    (per_sample_token_loss(model(ids), ids).mean() * size).backward()
    engine.accumulate_microbatch(size)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_per_sample_gradients_are_freed_layer_by_layer(checkpointing):
    """Flat clipping holds every layer's per-sample gradients at once; per-layer clipping the largest layer's."""
    from lightning_longshield.activation_checkpointing import apply_activation_checkpointing

    held = {}
    for clipping in ("flat", "per_layer"):
        torch.manual_seed(0)
        model = Llama(small_config())
        if checkpointing:
            apply_activation_checkpointing(model)
        engine = DPSGDEngine(model, CLIP, GaussianNoise(torch.device("cpu")), PrivacyAccountant("rdp"),
                             config=StrategyConfig(clipping=clipping))
        run_microbatch(engine, model, BATCH)
        held[clipping] = engine.last_held_bytes
        assert engine.exchange.held_bytes == 0 and not engine.exchange.grad_samples
    sizes = [p.numel() * 4 * BATCH for p in model.parameters()]
    assert held == {"flat": sum(sizes), "per_layer": max(sizes)}


def test_the_fused_kernels_margin_grows_with_the_sequence_and_is_refused_where_it_would_eat_the_bound():
    """The fused kernels' two fp32 reductions over T tokens are each off by up to T 2^-24: their margin 2 T 2^-24
    reached the whole bound at 2^23 tokens a sample (every factor 0, the layer's update noise alone) and passed it
    beyond (negative factors). From 2^21 tokens (a quarter off every clipped gradient) the sequence is refused."""
    assert fused_kernel_margin(16) == 2.0**-18  # short sequences: the usual margin
    assert fused_kernel_margin(2**17) == pytest.approx(2**-6)  # 1.6%
    assert fused_kernel_margin(FUSED_KERNEL_TOKEN_LIMIT - 1) < 0.25
    for tokens in (FUSED_KERNEL_TOKEN_LIMIT, 2**23, 2**25):
        with pytest.raises(ValueError, match=r"kernel='torch'"):
            fused_kernel_margin(tokens)
    for margin in (1.0, 1.5, -0.1):  # a bound of 0 or below, or above C
        with pytest.raises(ValueError, match=r"margin is in \[0, 1\)"):
            clip_factors(torch.tensor([4.0], dtype=torch.float64), 1.0, margin)
