"""A sample whose gradient holds inf or NaN contributes exactly zero (clip factor 0) on every clipping path, so the
released sum stays finite: a NaN update would reveal that one sample's event, which the noise does not cover."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_longshield import LongShieldStrategy, ProjectedNorms
from lightning_longshield.privacy.accumulator import ClippedGradientSum
from lightning_longshield.privacy.clipping import clip_factors, per_sample_squared_norms
from lightning_longshield.privacy.grad_sample.bookkeeping import Use
from tests.support.helpers import (
    RandomTokens,
    cpu_matmul_precision,
    full_state,
    loader,
    make_module,
    make_trainer,
    small_config,
)


def poisoned(values: torch.Tensor, sample: int) -> torch.Tensor:
    """``values`` with inf, -inf and NaN written into ``sample``'s entries."""
    flat = values[sample].view(-1)
    flat[0], flat[1], flat[-1] = math.inf, -math.inf, math.nan
    return values


def test_a_non_finite_norm_gets_factor_zero():
    squared = torch.tensor([math.nan, math.inf, 4.0, 0.25], dtype=torch.float64)
    factors = clip_factors(squared, 1.0)
    assert factors[:2].tolist() == [0.0, 0.0] and factors[3] == 1.0
    assert factors[2] == pytest.approx(0.5, rel=1e-5)
    per_layer = clip_factors(squared.expand(2, 4), torch.tensor([[1.0], [2.0]], dtype=torch.float64))
    assert per_layer[:, :2].eq(0).all() and per_layer[1, 3] == 1.0


@pytest.mark.parametrize(("precision", "sync_free"), [("ieee", False), ("tf32", False), ("ieee", True)],
                         ids=["cpu_matrix_vector", "batched_forms", "sync_free"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["many samples, one tensor", "few samples, many tensors"])
def test_the_accumulator_adds_nothing_for_a_non_finite_sample(layout, dtype, precision, sync_free):
    """Every form of `ClippedGradientSum.add` (on CPU at full fp32 precision, fp32 sums by matrix-vector products;
    else the two batched forms; the sync-free form of clipping in backward on a GPU): the sum equals the other
    samples' clipped sum, and is finite."""
    batch, count = (8, 1) if layout.startswith("many") else (2, 4)
    generator = torch.Generator().manual_seed(0)
    grads = {f"p{k}": torch.randn(batch, 3, 5, generator=generator).to(dtype) for k in range(count)}
    for grad in grads.values():
        poisoned(grad, sample=1)
    factors = clip_factors(per_sample_squared_norms(grads.values(), batch), 1.0)
    assert factors[1] == 0 and (factors[[0, *range(2, batch)]] > 0).all()
    expected = {name: sum(factors[i] * grad[i].float() for i in range(batch) if i != 1) for name, grad in grads.items()}
    accumulator = ClippedGradientSum({})
    with cpu_matmul_precision(precision):
        accumulator.add({name: grad.clone() for name, grad in grads.items()}, factors, sync_free=sync_free)
    for name, total in accumulator.sums.items():
        assert total.isfinite().all()
        torch.testing.assert_close(total, expected[name], rtol=1e-5, atol=1e-6)


def test_book_kept_sums_add_nothing_for_a_non_finite_sample():
    """A linear use with inf in one sample's output gradients and NaN in another's inputs, and an embedding use with
    inf in one sample's output gradients: factors 0 for those samples give exactly the other samples' sums."""
    generator = torch.Generator().manual_seed(1)
    left, right = torch.randn(4, 6, 3, generator=generator), torch.randn(4, 6, 5, generator=generator)
    poisoned(left, sample=1)
    poisoned(right, sample=2)
    factors = torch.tensor([0.5, 0.0, 0.0, 1.0])
    linear = Use(left, right, rows=3).clipped_sum(factors)
    expected = 0.5 * left[0].T @ right[0] + left[3].T @ right[3]
    torch.testing.assert_close(linear, expected, rtol=1e-5, atol=1e-6)

    ids = torch.randint(0, 7, (3, 6), generator=generator)
    grads = poisoned(torch.randn(3, 6, 5, generator=generator), sample=0)
    table = Use(ids, grads, rows=7).clipped_sum(torch.tensor([0.0, 1.0, 0.25]))
    expected = torch.zeros(7, 5)
    for sample, factor in ((1, 1.0), (2, 0.25)):
        expected.index_add_(0, ids[sample], factor * grads[sample])
    torch.testing.assert_close(table, expected, rtol=1e-5, atol=1e-6)


def train_with_first_sample(effect: str, **strategy_kwargs) -> dict[str, torch.Tensor]:
    """One DP step (no noise) in which every micro-batch's first sample has inf (``"inf"``) or zero (``"zero"``) as
    the gradient of the model's logits (the model's own output, past every per-sample capture)."""
    module = make_module(small_config(n_layers=1))

    def set_first_sample(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[0] = math.inf if effect == "inf" else 0.0
        return grad

    def on_output(layer: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(set_first_sample)

    module.model.register_forward_hook(on_output)
    strategy = LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=1e-2, micro_batch_size=2,
                                  poisson_sampling=False, **strategy_kwargs)
    make_trainer(strategy, max_steps=1).fit(module, loader(RandomTokens(size=4, seq_len=8), 4))
    return full_state(module.model)


@pytest.mark.parametrize("settings", [{}, {"norms": "mixed"}, {"clipping": "per_layer"},
                                      {"norms": ProjectedNorms("hutchinson", projection_dim=4), "noise_seed": 7}],
                         ids=["materialised", "book-kept", "per-layer", "randomized"])
def test_a_step_with_a_non_finite_sample_releases_the_others(settings):
    """End to end: samples whose backward is all inf or NaN change nothing beside samples whose gradient is zero."""
    poisoned_step = train_with_first_sample("inf", **settings)
    reference = train_with_first_sample("zero", **settings)
    initial = full_state(make_module(small_config(n_layers=1)).model)
    assert all(value.isfinite().all() for value in poisoned_step.values())
    assert any(not torch.equal(reference[name], initial[name]) for name in reference)  # the others did train
    for name, value in reference.items():
        torch.testing.assert_close(poisoned_step[name], value, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
