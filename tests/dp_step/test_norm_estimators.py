"""Randomized per-sample squared norms (Hutchinson, Hutch++) against per-sample gradients formed by a plain loop.

References are independent of the estimator's code: dense per-sample gradients summed token by token in fp64,
their singular values for the theoretical spread, and a dense fp64 Hutch++ for the same draws.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_longshield.privacy.grad_sample.bookkeeping import Use
from lightning_longshield.privacy.randomized import estimator as est
from lightning_longshield.privacy.randomized.estimator import (
    ESTIMATORS,
    accountant_envelope,
    check_estimator,
    estimate_squared_norms,
    gaussian_projection,
    hutchinson_squared_norms,
    hutchpp_split,
    hutchpp_squared_norms,
    residual_projections,
    sketch,
)


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of tiny estimates: thread start-up would dominate (and 2 cores are shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_gradients(uses: list[Use]) -> torch.Tensor:
    """``(B, rows, d)`` fp64 per-sample gradients, summed over uses and tokens one outer product at a time."""
    batch, width = uses[0].right.shape[0], uses[0].right.shape[-1]
    grads = torch.zeros(batch, uses[0].rows, width, dtype=torch.float64)
    for use in uses:
        for i in range(batch):
            for t in range(use.tokens):
                right = use.right[i, t].double()
                if use.is_lookup:
                    grads[i, use.left[i, t]] += right
                else:
                    grads[i] += torch.outer(use.left[i, t].double(), right)
    return grads


def linear_use(gen: torch.Generator, batch: int, tokens: int, p: int, d: int) -> Use:
    return Use(torch.randn(batch, tokens, p, generator=gen), torch.randn(batch, tokens, d, generator=gen), p)


def lookup_use(gen: torch.Generator, batch: int, tokens: int, rows: int, d: int, distinct: int) -> Use:
    """Token ids from ``distinct`` values only, so that tokens repeat within a sample."""
    ids = torch.randint(0, distinct, (batch, tokens), generator=gen)
    return Use(ids, torch.randn(batch, tokens, d, generator=gen), rows)


def tied_pair(gen: torch.Generator, batch: int = 2, rows: int = 48, d: int = 40) -> list[Use]:
    """An embedding and an output head sharing one ``rows x d`` weight."""
    return [lookup_use(gen, batch, 40, rows, d, distinct=12), linear_use(gen, batch, 64, rows, d)]


def spectrum_use(gen: torch.Generator, squared_singular: torch.Tensor, p: int, d: int, batch: int = 2) -> Use:
    """A linear use with ``W_i = U diag(sigma) V^T`` (random orthonormal ``U``, ``V``): ``T`` = the rank."""
    rank = squared_singular.numel()
    u = torch.linalg.qr(torch.randn(batch, p, rank, generator=gen, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(batch, d, rank, generator=gen, dtype=torch.float64)).Q
    left = (u * squared_singular.double().sqrt()).transpose(1, 2)  # (B, rank, p): W = left^T right
    return Use(left.float().contiguous(), v.transpose(1, 2).float().contiguous(), p)


def draws(estimator: str, uses: list[Use], k: int, n: int, seed: int) -> torch.Tensor:
    """``(n, B)`` estimates from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([estimate_squared_norms(estimator, uses, gen, k) for _ in range(n)])


def check_sketch(use: Use, k: int = 5, seed: int = 0) -> None:
    projection = gaussian_projection(use.rows, k, torch.Generator().manual_seed(seed))
    expected = torch.einsum("pk,bpd->bkd", projection.double(), reference_gradients([use]))
    got = sketch(use, projection)
    assert got.dtype == torch.float64 and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


# --- exact products ---------------------------------------------------------------------------------------------


def test_sketch_of_linear_use_is_projected_gradient():
    check_sketch(linear_use(torch.Generator().manual_seed(1), 3, 10, 16, 12))


def test_sketch_of_lookup_use_sums_repeated_tokens():
    use = lookup_use(torch.Generator().manual_seed(2), 3, 20, 16, 12, distinct=5)
    assert any(len(row.unique()) < use.tokens for row in use.left)
    check_sketch(use)


def test_sketch_casts_bf16_inputs_block_by_block(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    monkeypatch.setattr(est, "BLOCK_ELEMENTS", 3 * (16 + 12))  # one token per block: 10 blocks
    use = linear_use(gen, 3, 10, 16, 12)
    check_sketch(Use(use.left.bfloat16(), use.right.bfloat16(), use.rows))
    lookup = lookup_use(gen, 3, 10, 16, 12, distinct=4)
    check_sketch(Use(lookup.left, lookup.right.bfloat16(), lookup.rows))


def test_sketch_rejects_projection_of_wrong_width():
    use = linear_use(torch.Generator().manual_seed(4), 2, 5, 16, 12)
    with pytest.raises(ValueError, match=r"\(16, k\)"):
        sketch(use, torch.zeros(12, 4))


def test_exact_estimator_matches_reference():
    gen = torch.Generator().manual_seed(5)
    for uses in ([linear_use(gen, 3, 10, 16, 12)], [lookup_use(gen, 3, 20, 16, 12, distinct=5)], tied_pair(gen)):
        expected = reference_gradients(uses).square().sum((1, 2))
        torch.testing.assert_close(estimate_squared_norms("exact", uses, gen, 1), expected, rtol=1e-5, atol=0)


def test_same_draws_as_dense_reference():
    """Hutchinson and Hutch++ equal a dense fp64 computation with the documented draws (S then P for Hutch++)."""
    uses, k, seed = tied_pair(torch.Generator().manual_seed(6)), 9, 7
    grads = reference_gradients(uses)
    rows = uses[0].rows

    replay = torch.Generator().manual_seed(seed)
    projection = torch.randn(rows, k, generator=replay).double() / math.sqrt(k)
    expected = torch.einsum("pk,bpd->bkd", projection, grads).square().sum((1, 2))
    got = estimate_squared_norms("hutchinson", uses, torch.Generator().manual_seed(seed), k)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)

    head, tail = hutchpp_split(k)
    replay = torch.Generator().manual_seed(seed)
    s = torch.randn(rows, head, generator=replay).double() / math.sqrt(head)
    p = torch.randn(rows, tail, generator=replay).double() / math.sqrt(tail)
    q = torch.linalg.qr(grads @ (grads.transpose(1, 2) @ s)).Q
    residual = grads - q @ (q.transpose(1, 2) @ grads)
    expected = (q.transpose(1, 2) @ grads).square().sum((1, 2)) + (p.T @ residual).square().sum((1, 2))
    got = estimate_squared_norms("hutchpp", uses, torch.Generator().manual_seed(seed), k)
    assert got.dtype == torch.float64 and got.shape == (2,)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=0)
    assert not torch.allclose(got, grads.square().sum((1, 2)), rtol=1e-3)  # an estimate, not the exact norm


# --- statistics -------------------------------------------------------------------------------------------------

FLAT = 0.5 + torch.rand(64, generator=torch.Generator().manual_seed(8))  # squared singular values in [0.5, 1.5]


@pytest.mark.parametrize("estimator", ["hutchinson", "hutchpp"])
@pytest.mark.parametrize("k", [8, 32])
@pytest.mark.parametrize("case", ["flat_spectrum", "tied_pair"])
def test_unbiased(estimator, k, case):
    gen = torch.Generator().manual_seed(9)
    uses = [spectrum_use(gen, FLAT, p=96, d=80)] if case == "flat_spectrum" else tied_pair(gen)
    exact = reference_gradients(uses).square().sum((1, 2))
    n = 6000  # the tied pair at k = 8: SE = 0.15% of the norm
    samples = draws(estimator, uses, k, n, seed=10 + k)
    mean, standard_error = samples.mean(0), samples.std(0) / math.sqrt(n)
    assert (0.01 * exact > 5 * standard_error).all(), f"test too weak: SE/exact = {standard_error / exact}"
    relative = mean / exact - 1
    assert (relative.abs() < 0.01).all(), f"{estimator} k={k}: relative bias {relative}, SE {standard_error / exact}"


@pytest.mark.parametrize("k", [8, 32, 128])
def test_hutchinson_spread_matches_theory(k):
    """``Var = (2/k) sum_j lambda_j^2`` for the eigenvalues ``lambda`` of ``W W^T``."""
    gen = torch.Generator().manual_seed(11)
    uses = [spectrum_use(gen, 0.9 ** torch.arange(48.0), p=64, d=56)]
    grads = reference_gradients(uses)
    eigen = torch.linalg.svdvals(grads).square()
    theory = (2 / k * eigen.square().sum(1)).sqrt() / eigen.sum(1)
    n = 4000
    samples = draws("hutchinson", uses, k, n, seed=12 + k)
    spread = samples.std(0) / grads.square().sum((1, 2))
    centred = samples - samples.mean(0)
    kurtosis = centred.pow(4).mean(0) / centred.square().mean(0).square()
    assert (0.1 > 5 * ((kurtosis - 1) / (4 * n)).sqrt()).all(), "test too weak"
    assert ((spread / theory - 1).abs() < 0.1).all(), f"k={k}: relative spread {spread} vs theory {theory}"


@pytest.mark.parametrize("k", [12, 32])
def test_hutchpp_spreads_less_on_decaying_spectrum(k):
    gen = torch.Generator().manual_seed(13)
    uses = [spectrum_use(gen, 0.6 ** torch.arange(32.0), p=64, d=48)]
    hutchinson = draws("hutchinson", uses, k, 1000, seed=14).std(0)
    hutchpp = draws("hutchpp", uses, k, 1000, seed=15).std(0)
    assert (hutchpp < 0.5 * hutchinson).all(), f"k={k}: Hutch++ spread {hutchpp} vs Hutchinson {hutchinson}"


def test_gaussian_projection_is_gaussian_with_variance_one_over_k():
    k = 50
    projection = gaussian_projection(4000, k, torch.Generator().manual_seed(16))
    assert projection.shape == (4000, k) and projection.dtype == torch.float32
    values = projection.double().flatten()
    assert abs(values.mean()) < 5 * math.sqrt(1 / k / values.numel())
    assert abs(values.var() * k - 1) < 0.02
    kurtosis = (values - values.mean()).pow(4).mean() / values.var() ** 2  # Gaussian 3, Rademacher 1
    assert abs(kurtosis - 3) < 0.1


# --- context parallelism ----------------------------------------------------------------------------------------


def token_half(uses: list[Use], half: int) -> list[Use]:
    def cut(x: torch.Tensor) -> torch.Tensor:
        middle = x.shape[1] // 2
        return x[:, :middle] if half == 0 else x[:, middle:]

    return [Use(cut(use.left), cut(use.right), use.rows) for use in uses]


class TwoRanks:
    """Two threads standing in for a CP group of 2: ``reduce`` is an all-reduce (sum, rank 0's first)."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=60)
        self.slots: list[torch.Tensor] = [torch.empty(0), torch.empty(0)]
        self.calls = [0, 0]

    def reduce_for(self, rank: int):
        def reduce(partial: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = partial
            self.barrier.wait()
            total = self.slots[0] + self.slots[1]
            self.barrier.wait()
            self.calls[rank] += 1
            return total

        return reduce

    def run(self, estimator: str, uses: list[Use], k: int, seed: int) -> list[torch.Tensor]:
        def rank(r: int) -> torch.Tensor:
            gen = torch.Generator().manual_seed(seed)  # the same secret seed on every rank of the group
            return estimate_squared_norms(estimator, token_half(uses, r), gen, k, reduce=self.reduce_for(r))

        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(rank, (0, 1)))


def test_token_halves_sum_to_full_sketch():
    uses = tied_pair(torch.Generator().manual_seed(17))
    projection = gaussian_projection(uses[0].rows, 6, torch.Generator().manual_seed(18))
    for use in uses:
        halves = [sketch(part, projection) for part in token_half([use], 0) + token_half([use], 1)]
        torch.testing.assert_close(halves[0] + halves[1], sketch(use, projection), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("estimator, reduces", [("hutchinson", 1), ("hutchpp", 4)])
def test_context_parallel_reduce_gives_full_sequence_estimate(estimator, reduces):
    uses = tied_pair(torch.Generator().manual_seed(19))
    ranks = TwoRanks()
    first, second = ranks.run(estimator, uses, 9, seed=20)
    assert ranks.calls == [reduces, reduces]
    assert torch.equal(first, second)  # every rank holds the same estimate
    full = estimate_squared_norms(estimator, uses, torch.Generator().manual_seed(20), 9)
    torch.testing.assert_close(first, full, rtol=1e-4, atol=0)
    without_reduce = estimate_squared_norms(estimator, token_half(uses, 0), torch.Generator().manual_seed(20), 9)
    assert not torch.allclose(without_reduce, full, rtol=1e-2)


# --- memory -----------------------------------------------------------------------------------------------------


class LargestOutput(TorchDispatchMode):
    """The most elements of any tensor an op allocates (views of the inputs are not allocations)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if any(returned.alias_info is not None for returned in func._schema.returns):
            return out  # a view or an in-place result
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.numel = max(self.numel, tensor.numel())
        return out


BIG = {"batch": 4, "tokens": 4096, "p": 8192, "d": 2048, "k": 32}  # Llama-3.2-1B's largest linear layer, T 4096


def test_sketch_forms_no_per_sample_gradient():
    batch, tokens, p, d, k = BIG.values()
    with FakeTensorMode():
        use = Use(torch.empty(batch, tokens, p), torch.empty(batch, tokens, d), p)
        projection = torch.empty(p, k)
        with LargestOutput() as largest:
            out = sketch(use, projection)
    assert out.shape == (batch, k, d)
    assert largest.numel <= batch * k * (tokens + d + p), largest.numel
    assert largest.numel * 100 < batch * p * d  # 524,288 (left_i P) against 67,108,864


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("estimator", ["hutchinson", "hutchpp"])
def test_norm_computation_peak_memory(estimator, dtype):
    """Traced peak of the whole estimate (projections, sketches, norms; Hutch++'s Y, Q, residual projections), beyond
    the inputs, against the materialised fp32 per-sample gradient ``B p d 4`` = 256 MiB. Measured: Hutchinson 6.0 MiB
    (fp32 inputs) / 8.4 MiB (bf16, cast in token blocks), Hutch++ 7.8 / 11.4 MiB: 0.023x to 0.045x."""
    batch, tokens, p, d, k = BIG.values()
    materialised = batch * p * d * 4
    with FakeTensorMode():
        use = Use(torch.empty(batch, tokens, p, dtype=dtype), torch.empty(batch, tokens, d, dtype=dtype), p)
        tracker = MemTracker()
        tracker.track_external(use.left, use.right)
        at_start = next(iter(tracker.get_tracker_snapshot("current").values()))["Total"]
        with tracker:
            out = estimate_squared_norms(estimator, [use], torch.Generator().manual_seed(0), k)
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"] - at_start
    assert out.shape == (batch,) and out.dtype == torch.float64
    assert peak <= 0.1 * materialised, (
        f"{estimator} {dtype}: peak {peak / 2**20:.1f} MiB = {peak / materialised:.3f}x the per-sample gradient")


# --- generators and inputs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["hutchinson", "hutchpp"])
def test_draws_come_only_from_the_generator(estimator):
    uses = tied_pair(torch.Generator().manual_seed(21))
    global_state = torch.get_rng_state()
    first = estimate_squared_norms(estimator, uses, torch.Generator().manual_seed(22), 6)
    assert torch.equal(torch.get_rng_state(), global_state)
    torch.manual_seed(1234)  # a different global state changes nothing
    assert torch.equal(estimate_squared_norms(estimator, uses, torch.Generator().manual_seed(22), 6), first)
    gen = torch.Generator().manual_seed(22)
    estimate_squared_norms(estimator, uses, gen, 6)
    assert not torch.equal(estimate_squared_norms(estimator, uses, gen, 6), first)  # fresh draws at every call


def test_hutchpp_entry_points_agree():
    uses = tied_pair(torch.Generator().manual_seed(23))
    direct = hutchpp_squared_norms(uses, torch.Generator().manual_seed(24), 7)
    assert torch.equal(direct, estimate_squared_norms("hutchpp", uses, torch.Generator().manual_seed(24), 7))
    sketches = sum(sketch(use, gaussian_projection(48, 7, torch.Generator().manual_seed(24))) for use in uses)
    hutchinson = estimate_squared_norms("hutchinson", uses, torch.Generator().manual_seed(24), 7)
    torch.testing.assert_close(hutchinson_squared_norms(sketches), hutchinson, rtol=1e-6, atol=0)


def test_split_and_accountant_projections():
    assert ESTIMATORS == ("exact", "hutchinson", "hutchpp")
    assert hutchpp_split(3) == (1, 2) and hutchpp_split(32) == (10, 22)
    assert residual_projections("hutchinson", 32) == 32
    assert residual_projections("hutchpp", 32) == 22
    assert residual_projections("exact", 0) is None
    assert accountant_envelope("hutchpp", 32).estimator == "hutch++"
    assert accountant_envelope("hutchpp", 32).projections == 22
    assert accountant_envelope("exact", 32).exact


@pytest.mark.parametrize(
    "estimator, k, match",
    [("jl", 8, "not supported"), ("hutchinson", 0, "positive integer"), ("hutchpp", -1, "positive integer"),
     ("hutchinson", 2.5, "positive integer"), ("hutchpp", 2, ">= 3")],
)
def test_bad_inputs(estimator, k, match):
    with pytest.raises(ValueError, match=match):
        check_estimator(estimator, k)
    with pytest.raises(ValueError, match=match):
        estimate_squared_norms(estimator, [linear_use(torch.Generator(), 2, 3, 4, 5)], torch.Generator(), k)
    with pytest.raises(ValueError, match=match):
        residual_projections(estimator, k)


def test_exact_refuses_reduce_and_uses_must_match():
    gen = torch.Generator()
    use = linear_use(gen, 2, 3, 4, 5)
    with pytest.raises(ValueError, match="gathered"):
        estimate_squared_norms("exact", [use], gen, 1, reduce=lambda t: t)
    with pytest.raises(ValueError, match="share"):
        estimate_squared_norms("hutchinson", [use, linear_use(gen, 2, 3, 4, 6)], gen, 4)


# --- rounding ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["hutchinson", "hutchpp"])
def test_a_clipped_contribution_stays_within_the_accounted_bound_when_tokens_cancel(estimator):
    """The accountant covers clipping by the estimate as exact arithmetic forms it, a contribution of at most
    ``C Z``, ``Z = ||g|| / ||P^T g||`` (Hutch++: at most ``C`` for a rank-1 gradient, which its head spans). Token
    gradients that cancel (``+u``, 254 tiny ones, ``-u``) put fp32 sketches 6% (Hutch++: 9%) above that; fp64 sketches
    keep every step within it (the allowance ``rho S_i``, checked below, bounds what fp64 rounding can still add)."""
    from torch import nn

    from lightning_longshield.privacy.clipping import clip_factors
    from lightning_longshield.privacy.grad_sample.bookkeeping import BookKeeper
    from lightning_longshield.privacy.randomized.estimator import RandomizedNorms
    from lightning_longshield.privacy.randomness import SecretKey

    torch.manual_seed(1)
    p, d, k, tokens = 8, 8, 32, 256
    layer, key = nn.Linear(d, p, bias=False), SecretKey.from_seed(0)
    direction, inputs = torch.randn(p), torch.ones(d)
    weights = torch.full((tokens,), 2.3 * 2**-23)
    weights[0], weights[-1] = 1.0, -1.0
    exact = torch.einsum("t,p,d->pd", weights.double(), direction.double(), inputs.double())
    scale = 100.0 / exact.norm().item()  # ||g|| = 100 C
    grad_output = (weights[:, None] * (direction * scale)[None]).unsqueeze(0)
    activation = inputs.expand(tokens, d).unsqueeze(0).contiguous()
    gradient = torch.einsum("tp,td->pd", grad_output[0].double(), activation[0].double())
    worst = 0.0
    for step in range(40):
        norms = RandomizedNorms(estimator, k)
        norms.start_step(key, step)
        keeper = BookKeeper("ghost", set(), estimate=norms)
        keeper.receive(layer, activation, grad_output, lambda module, param: "w")
        bounds = keeper.squared_norms(1, torch.device("cpu"))
        factors = clip_factors(bounds.squared, 1.0, rounding=bounds.rounding, dtype=torch.float64)
        contribution = next(keeper.clipped_sums(factors))[1].double().norm().item()
        if estimator == "hutchinson":
            projection = gaussian_projection(p, k, key.generators(torch.device("cpu"), "projection", step, "w"))
            bound = gradient.norm().item() / (projection.double().T @ gradient).norm().item()
        else:
            bound = 1.0
        worst = max(worst, contribution / bound)
    assert worst <= 1.0, worst


def test_the_rounding_allowance_counts_every_use_of_a_weight():
    """``rho S_i`` (`sketch_rounding`) covers every token a sketch sums over: both uses of a weight (a tied head, or
    one use per loss chunk), not the first use's alone."""
    from torch import nn

    from lightning_longshield.privacy.grad_sample.bookkeeping import BookKeeper, sketch_rounding, sum_rounding
    from lightning_longshield.privacy.randomized.estimator import RandomizedNorms
    from lightning_longshield.privacy.randomness import SecretKey

    torch.manual_seed(2)
    layer, key, k = nn.Linear(6, 5, bias=False), SecretKey.from_seed(1), 4
    norms = RandomizedNorms("hutchinson", k)
    norms.start_step(key, 0)
    keeper = BookKeeper("ghost", {"w"}, estimate=norms)
    parts = [(torch.randn(3, 7, 6), torch.randn(3, 7, 5)), (torch.randn(3, 2, 6), torch.randn(3, 2, 5))]
    for activation, grad_output in parts:
        keeper.receive(layer, activation, grad_output, lambda module, param: "w")
    bounds = keeper.squared_norms(3, torch.device("cpu"))
    products = sum((g.norm(dim=-1) * a.norm(dim=-1)).double().sum(1) for a, g in parts)
    projection = gaussian_projection(5, k, key.generators(torch.device("cpu"), "projection", 0, "w")).double()
    rho = sketch_rounding(5, 7 + 2, 1, projection.norm() * (1 + 2**-20))
    expected = sum_rounding(1, uses=2) * products + rho * products
    torch.testing.assert_close(bounds.rounding, expected, rtol=1e-5, atol=0.0)  # S_i is an upper bound
    assert rho > sketch_rounding(5, 7, 1, projection.norm())  # more than the first use's tokens would give
