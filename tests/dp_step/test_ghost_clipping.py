"""Ghost and mixed per-sample norms with book-keeping equal torch.func per-sample gradients of an unsharded copy:
norms and clipped sums for every layer kind (linear with and without bias, embedding with padding, RMSNorm,
LayerNorm, tied and untied embeddings, frozen layers), micro-batches of 1/2/4, with and without checkpointing."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from lightning_longshield import LongShieldStrategy, StrategyConfig
from lightning_longshield.activation_checkpointing import apply_activation_checkpointing
from lightning_longshield.loss import per_sample_token_loss
from lightning_longshield.models import Llama
from lightning_longshield.privacy import DPSGDEngine, GaussianNoise, PrivacyAccountant
from lightning_longshield.privacy.grad_sample.bookkeeping import ghost_norm_is_cheaper
from lightning_longshield.privacy.randomness import SecretKey
from tests.support.helpers import (
    RandomTokens,
    assert_models_close,
    loader,
    make_module,
    make_trainer,
    reference_dp_sgd,
    samples,
    small_config,
)

CLIP = 0.05


class MixedLayers(nn.Module):
    """Every supported layer kind: an embedding with a padding row, linear layers with and without bias, LayerNorm,
    RMSNorm, a wide and a narrow linear (the mixed rule picks differently for them at T=12)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16, padding_idx=0)
        self.layers = nn.ModuleList([nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 160), nn.GELU(),
                                                   nn.Linear(160, 16, bias=False))])
        self.norm = nn.RMSNorm(16)
        self.narrow = nn.Linear(16, 4)
        self.head = nn.Linear(4, 40, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.layers:
            h = h + block(h)
        return self.head(torch.tanh(self.narrow(self.norm(h))))


def reference_per_sample_grads(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}

    def sample_loss(params, ids, lab):
        logits = functional_call(model, {**params, **frozen}, (ids[None],))
        return per_sample_token_loss(logits, lab[None])[0]

    return vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, ids, labels)


def run_engine(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, per_sample: str, micro_batch_size: int):
    engine = DPSGDEngine(model, CLIP, GaussianNoise(torch.device("cpu")), PrivacyAccountant("rdp"),
                         config=StrategyConfig(norms=per_sample), projection_key=SecretKey(b"p" * 32))
    engine.begin_logical_batch()
    norms = []
    for start in range(0, ids.shape[0], micro_batch_size):
        size = min(micro_batch_size, ids.shape[0] - start)
        engine.prepare_microbatch(size)
        logits = model(ids[start:start + size])
        (per_sample_token_loss(logits, labels[start:start + size]).mean() * size).backward()
        engine.accumulate_microbatch(size)
        norms.append(engine.last_per_sample_norms)
    return engine, torch.cat(norms)


def expected_norms_and_sum(reference: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    squared = sum(g.flatten(1).double().square().sum(1) for g in reference.values())
    norms = squared.sqrt()
    factors = torch.clamp(CLIP / norms, max=1.0)
    return norms, {n: torch.einsum("b,b...->...", factors, g.double()) for n, g in reference.items()}


def check(model, ids, labels, per_sample, micro_batch_size, unchanged_copy=None):
    reference = reference_per_sample_grads(unchanged_copy or copy.deepcopy(model), ids, labels)
    engine, norms = run_engine(model, ids, labels, per_sample, micro_batch_size)
    expected_norms, expected_sums = expected_norms_and_sum(reference)
    torch.testing.assert_close(norms, expected_norms, rtol=1e-5, atol=1e-8)
    assert (expected_norms > CLIP).all(), "clipping must be active for the sums to test the factors"
    assert set(engine.accumulator.sums) == set(expected_sums)
    for name, value in expected_sums.items():
        torch.testing.assert_close(engine.accumulator.sums[name].double(), value, rtol=1e-5, atol=1e-8,
                                   msg=lambda m, name=name: f"{name}: {m}")
    return engine


def token_batch(batch: int, vocab: int, seq: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    ids[0, :3] = 0  # padding rows, and repeated tokens within a sample
    ids[1, 4:8] = 5
    labels = torch.randint(0, vocab, (batch, seq), generator=generator)
    labels[1, :4] = -100
    return ids, labels


@pytest.mark.parametrize("per_sample", ["materialize", "ghost", "mixed"])
@pytest.mark.parametrize("micro_batch_size", [1, 2, 4])
def test_every_layer_kind_matches_torch_func(per_sample, micro_batch_size):
    """Also the materialised path: the embedding's padding row gets no per-sample gradient, as from autograd."""
    torch.manual_seed(0)
    model = MixedLayers()
    ids, labels = token_batch(4, 40)
    engine = check(model, ids, labels, per_sample, micro_batch_size)
    if micro_batch_size > 1 and per_sample != "materialize":
        chosen = engine.per_sample_methods()
        assert chosen["embed.weight"] == "ghost" and chosen["norm.weight"] == "materialize"
        assert chosen["narrow.bias"] == "materialize"


@pytest.mark.parametrize("per_sample", ["ghost", "mixed"])
@pytest.mark.parametrize("tie_embeddings", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_llama_matches_torch_func(per_sample, tie_embeddings, checkpointing):
    torch.manual_seed(0)
    model = Llama(small_config(tie_embeddings=tie_embeddings))
    unchanged = copy.deepcopy(model)
    if checkpointing:
        apply_activation_checkpointing(model, True)
    ids, labels = token_batch(4, 64)
    engine = check(model, ids, labels, per_sample, micro_batch_size=2, unchanged_copy=unchanged)
    if tie_embeddings:
        assert engine.per_sample_methods()["tok_embeddings.weight"] == "ghost"


@pytest.mark.parametrize("norms", ["ghost", "mixed", "hutchinson", "hutchpp"])
@pytest.mark.parametrize("tie_embeddings", [False, True], ids=["untied", "tied"])
def test_int32_token_ids_give_the_norms_and_sums_of_int64_ids(norms: str, tie_embeddings: bool):
    """`CausalLMModule` takes token ids of any integer dtype: int32 ids failed in backward where the book-keeper
    deduplicates an embedding's tokens (int32 and int64 indices in one scatter)."""
    torch.manual_seed(0)
    model = Llama(small_config(n_layers=1, tie_embeddings=tie_embeddings))
    ids, labels = token_batch(4, 64)
    engine64, norms64 = run_engine(copy.deepcopy(model), ids, labels, norms, micro_batch_size=2)
    engine32, norms32 = run_engine(model, ids.int(), labels, norms, micro_batch_size=2)
    assert torch.equal(norms32, norms64)
    assert set(engine32.accumulator.sums) == set(engine64.accumulator.sums)
    for name, total in engine64.accumulator.sums.items():
        assert torch.equal(engine32.accumulator.sums[name], total), name


def test_tied_weight_takes_one_method_for_both_uses():
    """At T=32 the tied 64 x 32 weight is materialised under "mixed" (the head's (G, A) would hold 32 x 96 > 2048
    elements per sample), although its embedding use alone would be book-kept: both uses follow the first one."""
    torch.manual_seed(0)
    model = Llama(small_config(tie_embeddings=True))
    ids, labels = token_batch(4, 64, seq=32)
    engine = check(model, ids, labels, "mixed", micro_batch_size=2)
    assert engine.per_sample_methods()["tok_embeddings.weight"] == "materialize"


def test_frozen_layers_are_skipped():
    torch.manual_seed(0)
    model = Llama(small_config())
    model.tok_embeddings.requires_grad_(False)
    model.layers[0].attention.requires_grad_(False)
    model.layers[1].feed_forward.w2.requires_grad_(False)
    ids, labels = token_batch(4, 64)
    engine = check(model, ids, labels, "mixed", micro_batch_size=4)
    assert "tok_embeddings.weight" not in engine.per_sample_methods()


def test_mixed_rule_picks_ghost_for_short_sequences_and_materialises_for_long_ones():
    """A 16 x 160 layer: ghost when T (16 + 160) < 2560 (T=12), materialised when larger (T=48); so is the 40 x 16
    embedding (T (1 + 16) against 640); the 16 x 4 and 4 x 40 layers are always materialised; "ghost" takes Gram
    matrices (token ids) everywhere."""
    assert ghost_norm_is_cheaper(12, 16 + 160, 2560) and not ghost_norm_is_cheaper(48, 16 + 160, 2560)
    for seq, wide in ((12, "ghost"), (48, "materialize")):
        torch.manual_seed(0)
        model = MixedLayers()
        ids, labels = token_batch(2, 40, seq)
        chosen = check(model, ids, labels, "mixed", micro_batch_size=2).per_sample_methods()
        assert chosen["layers.0.1.weight"] == wide and chosen["layers.0.3.weight"] == wide
        assert chosen["narrow.weight"] == "materialize" and chosen["embed.weight"] == wide
        assert chosen["head.weight"] == "materialize"  # 4 x 40: T (4 + 40) > 160 already at T=12
    model = MixedLayers()
    ids, labels = token_batch(2, 40, 48)
    chosen = check(model, ids, labels, "ghost", micro_batch_size=2).per_sample_methods()
    assert chosen["layers.0.1.weight"] == "ghost" and chosen["narrow.weight"] == "ghost"
    assert chosen["embed.weight"] == "ghost"


def test_each_sample_contributes_at_most_the_clipping_bound():
    """The sensitivity as computed: a one-sample clipped sum from book-keeping has norm <= C, for samples whose
    gradients are far above the bound (norms from the Gram path, the sum from a separate matmul)."""
    torch.manual_seed(0)
    model = Llama(small_config())
    ids, labels = token_batch(4, 64, seq=64)
    for index in range(4):
        engine = DPSGDEngine(model, CLIP, GaussianNoise(torch.device("cpu")), PrivacyAccountant("rdp"),
                             config=StrategyConfig(norms="ghost"))
        engine.begin_logical_batch()
        # two copies of the sample: the capture path (B > 1) with both contributions equal
        batch_ids, batch_labels = ids[index].repeat(2, 1), labels[index].repeat(2, 1)
        engine.prepare_microbatch(2)
        (per_sample_token_loss(model(batch_ids), batch_labels).mean() * 2).backward()
        engine.accumulate_microbatch(2)
        assert engine.last_per_sample_norms.min() > 10 * CLIP
        contribution = torch.cat([s.flatten() for s in engine.accumulator.sums.values()]).double().norm() / 2
        assert contribution <= CLIP


def test_book_kept_contributions_with_subnormal_factors_stay_within_c():
    """4096 tokens whose inputs and output gradients have row norms ~1.8e19 (fp32's largest finite row norm) and
    C = 1e-3: the factor C / ||G^T A|| (~1e-45) is an fp32 subnormal. Rounded to fp32 and handed to the fp64
    book-kept sum, it gave contributions of up to 1.86 C; book-kept factors are fp64, rounded toward zero."""
    max_grad_norm, tokens, width = 1e-3, 4096, 2
    generator = torch.Generator().manual_seed(0)
    for scale in (1.0, 0.43, 0.31, 0.77):
        layer = nn.Linear(width, width, bias=False)
        engine = DPSGDEngine(layer, max_grad_norm, GaussianNoise(torch.device("cpu")), PrivacyAccountant("rdp"),
                             config=StrategyConfig(norms="ghost"))
        engine.begin_logical_batch()
        # Sample 0: every token alike (norms add up); sample 1: zeros, so the sums are sample 0's contribution.
        row = 1.8e19 / width**0.5 * torch.sign(torch.randn(width, generator=generator))
        inputs = torch.zeros(2, tokens, width)
        inputs[0] = row * scale
        grad_outputs = torch.zeros(2, tokens, width)
        grad_outputs[0] = row.flip(0)
        engine.prepare_microbatch(2)
        layer(inputs).backward(grad_outputs)
        engine.accumulate_microbatch(2)
        assert engine.last_per_sample_norms[0] > 1e41 * max_grad_norm  # an fp32-subnormal factor
        assert engine.per_sample_methods() == {"weight": "ghost"}
        contribution = torch.cat([t.flatten() for t in engine.accumulator.sums.values()]).double().norm()
        assert contribution <= max_grad_norm, (contribution / max_grad_norm).item()
        assert contribution >= max_grad_norm * (1 - 1e-4)


@pytest.mark.parametrize("per_sample", ["ghost", "mixed"])
@pytest.mark.parametrize("micro_batch_size", [1, 2])
def test_training_matches_per_sample_loop(per_sample, micro_batch_size):
    """The strategy at CP 1 with book-keeping: three DP steps equal the per-sample-loop reference."""
    dataset = RandomTokens(size=12, seq_len=16)
    module = make_module(small_config(tie_embeddings=True))
    initial = copy.deepcopy(module.model)
    strategy = LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=CLIP, micro_batch_size=micro_batch_size,
                                  poisson_sampling=False, seed=0, norms=per_sample)
    make_trainer(strategy, max_steps=3).fit(module, loader(dataset, 4))
    batches = [samples(dataset, range(k * 4, (k + 1) * 4)) for k in range(3)]
    assert_models_close(module.model, reference_dp_sgd(initial, batches, CLIP, 4))


def cancelling_use(kind: str, cancellation: float, seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """One sample whose token gradients nearly cancel: pairs of tokens with output gradients ``g`` and ``-g`` (a
    linear layer: inputs ``a`` and ``a + delta``; an embedding: one token id, gradients ``g`` and ``-g + delta``), so
    the per-sample gradient is ``cancellation`` times smaller than its terms."""
    generator = torch.Generator().manual_seed(seed)
    pairs, width = 32, 256
    grads = torch.randn(1, pairs, width, generator=generator)
    delta = torch.randn(1, pairs, width, generator=generator) / cancellation
    if kind == "linear":
        inputs = torch.randn(1, pairs, width, generator=generator)
        layer = nn.Linear(width, width, bias=False)
        return layer, torch.cat([inputs, inputs + delta], 1), torch.cat([grads, -grads], 1)
    ids = torch.full((1, 2 * pairs), 3)
    return nn.Embedding(8, width), ids, torch.cat([grads, delta - grads], 1)


@pytest.mark.parametrize("kind", ["linear", "embedding"])
@pytest.mark.parametrize("cancellation", [1.0, 1e3, 1e5])
def test_cancelling_token_gradients_stay_within_the_bound(kind, cancellation):
    """Book-kept norms and sums are separate computations whose rounding scales with the tokens' terms, not with
    the norm: with terms that cancel, fp32 Gram matrices put a sample's computed norm several times below its
    gradient's and let it contribute up to its whole unclipped gradient. The contribution as computed stays within
    C, and for tokens that do not cancel the bounds cost under 1e-4 of the norm."""
    from lightning_longshield.privacy.clipping import clip_factors
    from lightning_longshield.privacy.grad_sample.bookkeeping import BookKeeper

    for seed in range(5):
        layer, inputs, grads = cancelling_use(kind, cancellation, seed)
        keeper = BookKeeper("ghost", set())
        keeper.receive(layer, inputs, grads, lambda module, parameter: "weight")
        norms = keeper.squared_norms(1, torch.device("cpu"))
        if kind == "linear":
            exact = torch.einsum("btp,btd->pd", grads.double(), inputs.double()).norm()
        else:
            exact = grads.double().sum(1).norm()
        assert norms.squared.sqrt() >= exact
        bound = float(exact) / 3  # clipping active: the whole gradient would be 3 C
        factors = clip_factors(norms.squared, bound, rounding=norms.rounding)
        (_, clipped_sum), = keeper.clipped_sums(factors)
        assert clipped_sum.double().norm() <= bound
        if cancellation == 1.0:
            assert norms.squared.sqrt() / exact - 1 < 1e-6 and norms.rounding / exact < 1e-4


@pytest.mark.parametrize("per_sample", ["ghost", "mixed"])
def test_a_weight_used_many_times_stays_within_the_bound(per_sample):
    """Each use of a book-kept weight (a head applied chunk by chunk, a tied weight) adds its part of the clipped sum
    into the fp32 sum apart: 202 uses whose parts are -1, 200 x 2^-24 (1 + 2^-10), +1 lost the small ones to fp32's
    rounding at every addition, and with the allowance of one rounding the sample added 1.83 C."""

    class CalledPerPosition(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(512, 512, bias=False)  # wide: "mixed" book-keeps it too

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.stack([self.linear(x[:, position]) for position in range(x.shape[1])], 1)

    torch.manual_seed(0)
    model = CalledPerPosition()
    small = 2.0**-24 * (1 + 2.0**-10)
    inputs = torch.zeros(2, 202, 512)
    inputs[0, 0, 0], inputs[0, 1:-1, 0], inputs[0, -1, 0] = -1.0, small, 1.0
    bound = 1.3e-5  # above the sample's norm, 200 x small: its factor would be 1
    engine = DPSGDEngine(model, bound, GaussianNoise(torch.device("cpu")), PrivacyAccountant("rdp"),
                         config=StrategyConfig(norms=per_sample, micro_batch_size=2))
    engine.begin_logical_batch()
    engine.prepare_microbatch(2)
    model(inputs)[..., 0].sum().backward()  # the second sample's inputs are 0: it adds nothing
    engine.accumulate_microbatch(2)
    assert engine.per_sample_methods()["linear.weight"] == "ghost"
    assert engine.accumulator.sums["linear.weight"].double().norm() <= bound


def test_a_materialised_tied_weight_forms_no_extra_per_sample_gradient_under_mixed_norms():
    """A tied weight long sequences make "mixed" materialise: its embedding use formed another ``(B, V, d)`` tensor
    beside the head's, where "materialize" adds the embedding's rows into the head's. "mixed" now makes no more of
    them than "materialize", and the norms and clipped sums still match the reference."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class PerSampleShapes(TorchDispatchMode):
        """The storages of the ``shape`` tensors made under it (the per-sample gradients of a (V, d) weight)."""

        def __init__(self, shape: tuple[int, ...]) -> None:
            super().__init__()
            self.shape, self.storages = shape, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == self.shape:
                    self.storages.add(tensor.untyped_storage().data_ptr())
            return out

    config = small_config(tie_embeddings=True)
    ids, labels = token_batch(2, config.vocab_size, seq=48)
    made = {}
    for norms in ("materialize", "mixed"):
        torch.manual_seed(0)
        model = Llama(config)
        reference = reference_per_sample_grads(copy.deepcopy(model), ids, labels)
        engine = DPSGDEngine(model, CLIP, GaussianNoise(torch.device("cpu")), PrivacyAccountant("rdp"),
                             config=StrategyConfig(norms=norms, micro_batch_size=2))
        engine.begin_logical_batch()
        engine.prepare_microbatch(2)
        loss = per_sample_token_loss(model(ids), labels).sum()
        with PerSampleShapes((2, config.vocab_size, config.dim)) as counter:
            loss.backward()
            engine.accumulate_microbatch(2)
        made[norms] = len(counter.storages)
        assert engine.per_sample_methods()["tok_embeddings.weight"] == "materialize"
        expected_norms, expected_sums = expected_norms_and_sum(reference)
        torch.testing.assert_close(engine.last_per_sample_norms, expected_norms, rtol=1e-5, atol=1e-8)
        for name, value in expected_sums.items():
            torch.testing.assert_close(engine.accumulator.sums[name].double(), value, rtol=1e-5, atol=1e-8)
    assert made["mixed"] == made["materialize"], made


@pytest.mark.parametrize("seq, chunk", [(64, 8), (22, 21)])
def test_mixed_rule_judges_a_head_applied_chunk_by_chunk_by_all_its_tokens(seq, chunk):
    """A chunked loss calls the head once per chunk. Judged by one chunk's tokens (T 8 of 64) the 64 x 32 head was
    book-kept (8 x 96 < 2048 elements a sample), and every chunk's (G, A) held until clipping: the whole logits'
    gradient. Judged by the sequence's tokens (64; 22 = 21 + 1, whose short last chunk backward delivers first) it is
    materialised, as without chunks; norms and clipped sums still match the reference."""
    from lightning_longshield.loss import chunked_per_sample_token_loss

    torch.manual_seed(0)
    model = Llama(small_config())
    ids, labels = token_batch(2, 64, seq=seq)
    reference = reference_per_sample_grads(copy.deepcopy(model), ids, labels)
    engine = DPSGDEngine(model, CLIP, GaussianNoise(torch.device("cpu")), PrivacyAccountant("rdp"),
                         config=StrategyConfig(norms="mixed"))
    engine.begin_logical_batch()
    engine.prepare_microbatch(2)

    def head_loss(hidden: torch.Tensor, output: nn.Module) -> torch.Tensor:
        return chunked_per_sample_token_loss(hidden, output, labels, chunk_tokens=chunk)

    model(ids, head=head_loss).sum().backward()
    assert engine.capture.bookkeeper.tokens_of(model.output) == seq
    held = engine.capture.bookkeeper.uses.get("output.weight", [])
    engine.accumulate_microbatch(2)
    assert engine.per_sample_methods()["output.weight"] == "materialize" and not held
    expected_norms, expected_sums = expected_norms_and_sum(reference)
    torch.testing.assert_close(engine.last_per_sample_norms, expected_norms, rtol=1e-5, atol=1e-8)
    for name, value in expected_sums.items():
        torch.testing.assert_close(engine.accumulator.sums[name].double(), value, rtol=1e-5, atol=1e-8)
