"""Context parallelism: head-tail sharding (single process) and CP attention / a whole Llama on 2 and 4 gloo ranks."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_longshield.batching import split_into_microbatches
from lightning_longshield.context_parallel import (
    ContextParallelAttention,
    apply_context_parallel_attention,
    head_tail_chunks,
    prefix_causal_attention,
    shard_batch,
    shard_sequence,
    sharded_position_ids,
    unshard_sequence,
)
from lightning_longshield.loss import per_sample_token_loss
from lightning_longshield.models import Llama
from tests.support import cp_workers
from tests.support.helpers import small_config
from tests.support.process_runner import run_processes


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("dim", [1, 2, -1])
def test_shard_unshard_round_trip(cp_size: int, dim: int) -> None:
    full = torch.randn(2, 8 * cp_size, 16, 8 * cp_size)
    shards = [shard_sequence(full, r, cp_size, dim=dim) for r in range(cp_size)]
    assert all(s.shape[dim] == full.shape[dim] // cp_size for s in shards)
    torch.testing.assert_close(unshard_sequence(shards, cp_size, dim=dim), full, rtol=0, atol=0)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_position_ids_follow_head_tail_chunks(cp_size: int) -> None:
    seq = 8 * cp_size
    chunk = seq // (2 * cp_size)
    seen = []
    for rank in range(cp_size):
        positions = sharded_position_ids(3, seq, rank, cp_size, device="cpu")
        head, tail = head_tail_chunks(rank, cp_size)
        assert (head, tail) == (rank, 2 * cp_size - 1 - rank)
        expected = torch.cat(
            (torch.arange(head * chunk, (head + 1) * chunk), torch.arange(tail * chunk, (tail + 1) * chunk))
        )
        assert positions.dtype == torch.long and positions.shape == (3, seq // cp_size)
        assert torch.equal(positions, expected.expand(3, -1))
        # the positions are those of the tokens the rank keeps
        tokens = torch.arange(seq).expand(3, -1) * 10
        assert torch.equal(shard_sequence(tokens, rank, cp_size), positions * 10)
        seen.append(positions[0])
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(seq))


def test_head_tail_layout_for_two_ranks() -> None:
    # T = 8, N = 2: chunks [0,1] [2,3] [4,5] [6,7]; rank 0 keeps chunks 0 and 3, rank 1 keeps chunks 1 and 2.
    assert sharded_position_ids(1, 8, 0, 2).tolist() == [[0, 1, 6, 7]]
    assert sharded_position_ids(1, 8, 1, 2).tolist() == [[2, 3, 4, 5]]


def test_shard_batch_counts_tokens_over_the_whole_sequence() -> None:
    labels = torch.arange(16).repeat(3, 1)
    labels[0, :6] = -100  # all of rank 0's head chunk (and more) ignored
    labels[1, 12:] = -100
    labels[2] = -100
    batch = {"input_ids": torch.arange(16).repeat(3, 1), "labels": labels, "weights": torch.ones(3), "name": "x"}
    for rank in range(2):
        local = shard_batch(batch, rank, 2)
        assert torch.equal(local["token_counts"], torch.tensor([10, 12, 0]))
        assert torch.equal(local["input_ids"], local["position_ids"])  # input_ids are positions here
        assert torch.equal(local["labels"], shard_sequence(labels, rank, 2))
        assert local["weights"] is batch["weights"] and local["name"] == "x"
    assert set(batch) == {"input_ids", "labels", "weights", "name"}  # the input is not modified


def test_shard_batch_expands_positions_shared_by_the_samples() -> None:
    """``position_ids`` of shape (T,) or (1, T), broadcast over the batch at CP 1, are sharded like a (B, T) one."""
    batch = {"input_ids": torch.zeros(3, 8, dtype=torch.long), "labels": torch.zeros(3, 8, dtype=torch.long)}
    offset = torch.arange(8) + 100
    for rank in range(2):
        expected = shard_batch({**batch, "position_ids": offset.expand(3, -1)}, rank, 2)["position_ids"]
        for shared in (offset, offset[None]):
            assert torch.equal(shard_batch({**batch, "position_ids": shared}, rank, 2)["position_ids"], expected)
    with pytest.raises(ValueError, match=r"position_ids'\] must be \(B, T\)"):
        shard_batch({**batch, "position_ids": offset.expand(2, -1)}, 0, 2)


def test_shard_batch_with_one_rank_is_the_identity_plus_positions() -> None:
    batch = {"input_ids": torch.zeros(2, 7, dtype=torch.long), "labels": torch.zeros(2, 7, dtype=torch.long)}
    local = shard_batch(batch, 0, 1)
    assert local["input_ids"] is batch["input_ids"]
    assert torch.equal(local["position_ids"], torch.arange(7).expand(2, -1))
    assert torch.equal(local["token_counts"], torch.tensor([7, 7]))


def test_sharded_loss_pieces_sum_to_the_sample_loss() -> None:
    logits, labels = torch.randn(2, 16, 5, dtype=torch.float64), torch.randint(0, 5, (2, 16))
    labels[0, 3:9] = -100
    local = [shard_batch({"labels": labels, "logits": logits}, r, 4) for r in range(4)]
    total = sum(per_sample_token_loss(p["logits"], p["labels"], p["token_counts"]) for p in local)
    torch.testing.assert_close(total, per_sample_token_loss(logits, labels))


@pytest.mark.parametrize("seq_len, cp_size", [(6, 2), (12, 4), (10, 4)])
def test_sequence_length_must_divide_into_2n_chunks(seq_len: int, cp_size: int) -> None:
    with pytest.raises(
        ValueError, match=rf"length T is not divisible by 2 x context_parallel_size = {2 * cp_size}.*Pad"
    ) as error:
        shard_batch({"input_ids": torch.zeros(1, seq_len, dtype=torch.long)}, 0, cp_size)
    assert not re.search(rf"\b{seq_len}\b", str(error.value))  # the batch's length is not quoted
    with pytest.raises(ValueError, match="not divisible"):
        shard_sequence(torch.zeros(1, seq_len), 0, cp_size)


def test_invalid_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="Invalid context-parallel rank 2"):
        shard_sequence(torch.zeros(1, 8), 2, 2)


def test_apply_cp_attention_replaces_every_attention_fn(small_llama: Llama) -> None:
    group = object()  # no communication happens until the model runs
    assert apply_context_parallel_attention(small_llama, group) == small_llama.config.n_layers  # type: ignore[arg-type]
    for block in small_llama.layers:
        assert isinstance(block.attention.attention_fn, ContextParallelAttention)
        assert block.attention.attention_fn.group is group


def test_apply_cp_attention_refuses_models_without_attention_fn() -> None:
    model = nn.Sequential(nn.Embedding(8, 4), nn.MultiheadAttention(4, 2, batch_first=True))
    with pytest.raises(TypeError, match="no module with an `attention_fn`.*lightning_longshield.models.Llama"):
        apply_context_parallel_attention(model, object())  # type: ignore[arg-type]


def test_position_ids_place_the_rotary_embeddings_and_default_to_0_to_t() -> None:
    """Positions 0..T-1, given as (B, T), (1, T) or (T,), are what ``None`` means; positions with other distances
    rotate q and k otherwise and change the output (causal_attention itself ignores them: see the packed-documents
    test below)."""
    torch.manual_seed(0)
    model = Llama(small_config()).double()
    tokens = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        default = model(tokens)
        for positions in (torch.arange(8).expand(2, -1), torch.arange(8)[None], torch.arange(8)):
            torch.testing.assert_close(model(tokens, positions), default, rtol=0, atol=0)
        spread = model(tokens, torch.arange(8) * 3)  # a uniform shift would not do: RoPE sees distances only
    torch.testing.assert_close(spread[:, 0], default[:, 0])  # the first token attends to itself alone
    assert not torch.allclose(spread[:, 1:], default[:, 1:])


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_shared_positions_split_and_shard_as_expanded_ones(cp_size: int) -> None:
    """``position_ids`` (T,) or (1, T) give every micro-batch and CP rank what the (B, T) ones give, also where B
    equals T (a (T,) one is never split as if it were samples)."""
    seq = 8 * cp_size
    tokens = torch.randint(0, 64, (seq, seq))
    positions = torch.arange(seq) * 2 + 5
    batch = {"input_ids": tokens, "labels": tokens}
    expected = split_into_microbatches({**batch, "position_ids": positions.expand(seq, -1)}, 3)
    for shared in (positions, positions[None]):
        microbatches = split_into_microbatches({**batch, "position_ids": shared}, 3)
        assert len(microbatches) == len(expected)
        for got, want in zip(microbatches, expected):
            for rank in range(cp_size):
                local, reference = shard_batch(got, rank, cp_size), shard_batch(want, rank, cp_size)
                assert local.keys() == reference.keys()
                assert all(torch.equal(local[key], reference[key]) for key in local)


@pytest.mark.parametrize("batch", [(torch.zeros(2, 8), torch.zeros(2, 8)), [torch.zeros(2, 8)]], ids=["tuple", "list"])
def test_shard_batch_refuses_a_batch_that_is_not_a_dict_with_the_fix(batch) -> None:
    with pytest.raises(TypeError, match=r"dict \(a Mapping\) with 'input_ids'.*got a (tuple|list)\. Return a dict"):
        shard_batch(batch, 0, 2)


@pytest.fixture
def small_llama() -> Llama:
    return Llama(small_config())


@pytest.mark.slow
def test_context_parallel_two_processes(tmp_path) -> None:
    """CP=2: all_gather_sequence/reduce-scatter, CP attention fwd/bwd, and a whole Llama (logits, loss, grads)."""
    run_processes(2, tmp_path, cp_workers.run, [(1, 2)])


@pytest.mark.slow
def test_context_parallel_four_processes(tmp_path) -> None:
    """CP=4 on one group, then a 2 x 2 (data_parallel, context_parallel) mesh: two CP groups with different data."""
    run_processes(4, tmp_path, cp_workers.run, [(1, 4), (2, 2)])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("length", "end"), [(8, 8), (8, 32), (5, 13)])
def test_prefix_causal_attention_matches_masked_attention(dtype: torch.dtype, length: int, end: int) -> None:
    """The mask-free blockwise kernel against SDPA with the materialised lower-right mask, forward and backward."""
    q = torch.randn(2, 3, length, 16, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 3, end, 16, dtype=dtype, requires_grad=True) for _ in range(2))
    out = prefix_causal_attention(q, k, v)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)

    reference_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    mask = torch.arange(length)[:, None] + (end - length) >= torch.arange(end)[None, :]
    reference = F.scaled_dot_product_attention(*reference_inputs, attn_mask=mask)
    reference_grads = torch.autograd.grad(reference, reference_inputs, grad_out.double())
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    for got, expected in zip((out, *grads), (reference, *reference_grads)):
        torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


def test_a_tied_model_built_on_the_meta_device_stays_tied_when_materialised():
    """Without sharding (one rank) the parameters are plain tensors, which ``to_empty`` copies once per owner."""
    from lightning_longshield.parallelize import materialize_meta_parameters

    with torch.device("meta"):
        model = Llama(small_config(tie_embeddings=True))
    assert materialize_meta_parameters(model, torch.device("cpu"), rank=0)
    assert model.output.weight is model.tok_embeddings.weight and not model.output.weight.is_meta
    assert len(list(model.parameters())) == len(list(Llama(small_config(tie_embeddings=True)).parameters()))


def test_materialising_a_meta_model_leaves_the_real_tensors_beside_it_alone():
    """A LightningModule's model is built on the meta device under context parallelism, its metrics are not: their
    states (and any real buffer) must keep their values. ``to_empty`` emptied them all, so validation perplexity under
    CP came out as inf or 1 from uninitialised token counts."""
    from lightning_longshield.parallelize import materialize_meta_parameters
    from lightning_longshield.token_perplexity import TokenPerplexity

    holder = nn.Module()
    with torch.device("meta"):
        holder.model = Llama(small_config())
    holder.perplexity = TokenPerplexity()
    holder.perplexity.update(torch.tensor(12.5), torch.tensor(5))
    holder.register_buffer("kept", torch.full((1024,), 7.0))
    assert materialize_meta_parameters(holder, torch.device("cpu"), rank=0)
    assert not any(t.is_meta for t in [*holder.parameters(), *holder.buffers()])
    assert holder.perplexity.loss_sum.item() == 12.5 and holder.perplexity.tokens.item() == 5
    holder.perplexity.reset()
    assert holder.perplexity.loss_sum.item() == 0.0 and holder.perplexity.tokens.item() == 0
    assert torch.equal(holder.kept, torch.full((1024,), 7.0))


class _BufferInInit(nn.Module):
    """A rotary ``inv_freq`` computed in ``__init__``, as Hugging Face models do; ``init_weights`` sets the rest."""

    def __init__(self, set_buffer: bool) -> None:
        super().__init__()
        self.linear, self.set_buffer = nn.Linear(4, 4), set_buffer
        self.register_buffer("inv_freq", self.frequencies(), persistent=False)

    @staticmethod
    def frequencies() -> torch.Tensor:
        return 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)

    def init_weights(self) -> None:
        nn.init.normal_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        if self.set_buffer:
            self.inv_freq.copy_(self.frequencies())


def test_a_buffer_init_weights_leaves_unset_on_a_meta_model_is_refused_by_name():
    """On the meta device ``__init__`` computes the buffer into nothing; materialised, it held whatever the memory
    did, silently. Refused, naming it; an ``init_weights`` that sets it materialises."""
    from lightning_longshield.parallelize import materialize_meta_parameters

    with torch.device("meta"):
        unset = _BufferInInit(set_buffer=False)
    with pytest.raises(RuntimeError, match=r"left inv_freq unset.*init_weights\(\)"):
        materialize_meta_parameters(unset, torch.device("cpu"), rank=0)
    with torch.device("meta"):
        model = _BufferInInit(set_buffer=True)
    assert materialize_meta_parameters(model, torch.device("cpu"), rank=0)
    assert torch.equal(model.inv_freq, _BufferInInit.frequencies())


def test_position_ids_place_rotary_embeddings_and_never_let_a_token_see_later_ones():
    """Packed documents whose positions restart: a token's output depends on no later token (a mask comparing
    positions let it see later tokens of smaller position), as under context parallelism."""
    torch.manual_seed(0)
    model = Llama(small_config()).double()
    tokens = torch.randint(0, 64, (1, 12))
    positions = torch.cat([torch.arange(8), torch.arange(4)])[None]  # a document of 8 tokens, then one of 4
    changed = tokens.clone()
    changed[0, 9:] = (changed[0, 9:] + 1) % 64  # only tokens after index 8
    with torch.no_grad():
        before, after = model(tokens, positions), model(changed, positions)
    torch.testing.assert_close(before[0, :9], after[0, :9], rtol=0, atol=0)


def test_output_stationary_shards_input_features_only_where_they_split_evenly():
    """FSDP2 shards dimension 1 only evenly: a wide layer whose input features do not split over the group (an FFN
    of 14336 at CP 3) failed at setup; it is sharded along its output features instead, which the exchange handles.
    This checks the choice; a CP 2 run against CP 1 is in tests/parallel/test_context_parallel_training.py."""
    from lightning_longshield.parallelize import input_sharded_weights

    wide, odd, narrow = nn.Linear(52, 36), nn.Linear(51, 36), nn.Linear(36, 52)
    model = nn.Sequential(wide, odd, narrow)
    assert input_sharded_weights(model, 2) == [wide.weight]
    assert input_sharded_weights(model, 3) == [odd.weight]
    assert input_sharded_weights(model, 1) == [wide.weight, odd.weight]


def test_blocks_holding_lists_of_their_own_are_sharded(tmp_path):
    """A mixture's experts in a list inside each block (which activation checkpointing treats as part of the block):
    the blocks were sharded before their experts, and FSDP2 failed at CP > 1 or with shard_over="all"."""
    from tests.support import sharding_workers

    run_processes(1, tmp_path, sharding_workers.shard_blocks_with_lists)
