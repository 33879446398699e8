"""Worker functions for the multi-process context-parallel tests (run by tests/parallel/test_context_parallel.py).

Every rank builds the same full-sequence reference (same seeds within a data-parallel group), runs the
context-parallel version on its head-tail shard, and compares. An assertion on any rank fails the test.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from lightning_longshield.context_parallel import (
    CONTEXT_PARALLEL,
    DATA_PARALLEL,
    ContextParallelAttention,
    all_gather_sequence,
    all_gather_unsharded,
    apply_context_parallel_attention,
    build_device_mesh,
    collectives,
    context_parallel_per_sample_loss,
    shard_batch,
    shard_sequence,
    sharded_position_ids,
    sum_over_shards,
)
from lightning_longshield.loss import per_sample_token_loss
from lightning_longshield.models import Llama
from lightning_longshield.models.llama import causal_attention
from tests.support.helpers import small_config

DOUBLE = dict(rtol=1e-9, atol=1e-11)
MODEL = dict(rtol=1e-5, atol=1e-7)  # RoPE rounds through fp32, so sharded and full runs may differ in the last bits


@dataclass
class CP:
    group: ProcessGroup
    rank: int
    size: int
    dp_rank: int

    def generator(self, salt: int) -> torch.Generator:
        """Same stream on all CP peers, different across data-parallel groups."""
        return torch.Generator().manual_seed(1000 * self.dp_rank + salt)


def run(rank: int, world_size: int, mesh_shapes: list[tuple[int, int]]) -> None:
    """Run every check on every (dp, cp) mesh (called by `process_runner.run_processes` in an initialised group)."""
    torch.set_num_threads(1)
    for dp_size, cp_size in mesh_shapes:
        mesh = build_device_mesh("cpu", dp_size, cp_size)
        cp_mesh = mesh[CONTEXT_PARALLEL]
        cp = CP(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size(), mesh[DATA_PARALLEL].get_local_rank())
        assert cp.size == cp_size and cp.rank == rank % cp_size and cp.dp_rank == rank // cp_size
        assert dist.get_rank(cp.group) == cp.rank
        for check in (check_collectives, check_attention, check_attention_gqa, check_llama):
            check(cp)
        dist.barrier()


def check_collectives(cp: CP) -> None:
    """all_gather_sequence on a non-contiguous dim; its backward is the reduce-scatter (sum) of the gradient."""
    pieces = [torch.randn(2, 3, 5, generator=cp.generator(s), dtype=torch.float64) for s in range(cp.size)]
    weights = [
        torch.randn(3, 2 * cp.size, 5, generator=cp.generator(100 + s), dtype=torch.float64) for s in range(cp.size)
    ]
    base = pieces[cp.rank].clone().requires_grad_()
    local = base.transpose(0, 1)  # (3, 2, 5), non-contiguous; gather along dim 1 (given as -2)
    gathered = all_gather_sequence(local, cp.group, dim=-2)
    torch.testing.assert_close(gathered, torch.cat([p.transpose(0, 1) for p in pieces], dim=1), **DOUBLE)
    (gathered * weights[cp.rank]).sum().backward()
    expected = sum(w.chunk(cp.size, dim=1)[cp.rank] for w in weights).transpose(0, 1)
    torch.testing.assert_close(base.grad, expected, **DOUBLE)

    full = torch.randn(2, 4 * cp.size, 3, generator=cp.generator(7), dtype=torch.float64)
    shard = shard_sequence(full, cp.rank, cp.size)
    torch.testing.assert_close(all_gather_unsharded(shard, cp.group), full, **DOUBLE)

    x = torch.full((2,), float(cp.rank + 1), dtype=torch.float64, requires_grad=True)
    total = sum_over_shards(x, cp.group)
    torch.testing.assert_close(total.detach(), torch.full((2,), cp.size * (cp.size + 1) / 2, dtype=torch.float64))
    (total * torch.tensor([2.0, 3.0], dtype=torch.float64)).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([2.0, 3.0], dtype=torch.float64))


def _qkv(cp: CP, batch: int = 2, heads: int = 3, seq: int = 16, head_dim: int = 8) -> list[torch.Tensor]:
    gen = cp.generator(11)
    return [torch.randn(batch, heads, seq, head_dim, generator=gen, dtype=torch.float64) for _ in range(3)]


def check_attention(cp: CP) -> None:
    """CP attention on head-tail shards == full causal attention; dq, dk, dv too (after unsharding)."""
    q, k, v = (t.requires_grad_() for t in _qkv(cp))
    out = causal_attention(q, k, v, None)
    upstream = torch.randn(out.shape, generator=cp.generator(12), dtype=torch.float64)
    full_grads = torch.autograd.grad(out, (q, k, v), upstream)

    local = [shard_sequence(t.detach(), cp.rank, cp.size, dim=2).requires_grad_() for t in (q, k, v)]
    positions = sharded_position_ids(q.shape[0], q.shape[2], cp.rank, cp.size, device=q.device)
    attention = ContextParallelAttention(cp.group)
    local_out = attention(*local, positions)
    torch.testing.assert_close(local_out, shard_sequence(out.detach(), cp.rank, cp.size, dim=2), **DOUBLE)
    torch.testing.assert_close(all_gather_unsharded(local_out.detach(), cp.group, dim=2), out.detach(), **DOUBLE)
    local_grads = torch.autograd.grad(local_out, local, shard_sequence(upstream, cp.rank, cp.size, dim=2))
    for name, local_grad, full_grad in zip("qkv", local_grads, full_grads):
        torch.testing.assert_close(
            all_gather_unsharded(local_grad, cp.group, dim=2), full_grad, **DOUBLE, msg=lambda m, n=name: f"d{n}: {m}"
        )

    try:
        attention(*local, None)
    except ValueError as err:
        assert "position_ids" in str(err)
    else:
        raise AssertionError("ContextParallelAttention accepted position_ids=None")


def check_attention_gqa(cp: CP) -> None:
    """Grouped-query attention (4 query heads, 2 K/V heads, gathered unrepeated) == full causal GQA attention."""
    gen = cp.generator(13)
    q = torch.randn(2, 4, 16, 8, generator=gen, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(2, 2, 16, 8, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
    out = causal_attention(q, k, v, None)
    reference = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(out, reference, **DOUBLE)
    upstream = torch.randn(out.shape, generator=cp.generator(14), dtype=torch.float64)
    full_grads = torch.autograd.grad(out, (q, k, v), upstream)
    local = [shard_sequence(t.detach(), cp.rank, cp.size, dim=2).requires_grad_() for t in (q, k, v)]
    positions = sharded_position_ids(q.shape[0], q.shape[2], cp.rank, cp.size, device=q.device)
    gathered = []
    original = collectives.all_gather_single

    def recording_gather(out, inp, group=None):
        gathered.append(out.numel())
        return original(out, inp, group=group)

    collectives.all_gather_single = recording_gather
    try:
        local_out = ContextParallelAttention(cp.group)(*local, positions)
    finally:
        collectives.all_gather_single = original
    assert gathered == [2 * k.numel()], gathered  # K and V with their 2 heads, not repeated to 4
    torch.testing.assert_close(local_out, shard_sequence(out.detach(), cp.rank, cp.size, dim=2), **DOUBLE)
    local_grads = torch.autograd.grad(local_out, local, shard_sequence(upstream, cp.rank, cp.size, dim=2))
    for name, local_grad, full_grad in zip("qkv", local_grads, full_grads):
        torch.testing.assert_close(
            all_gather_unsharded(local_grad, cp.group, dim=2), full_grad, **DOUBLE, msg=lambda m, n=name: f"d{n}: {m}"
        )


def _batch(cp: CP, vocab: int, batch: int = 3, seq: int = 16) -> dict[str, torch.Tensor]:
    gen = cp.generator(21)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[0, :5] = -100  # ignored tokens in the first chunks
    labels[1, seq // 2 : seq // 2 + 3] = -100  # ... in middle chunks
    labels[2] = -100  # a sample without labelled tokens: loss 0, gradient 0
    return {"input_ids": tokens[:, :-1].clone(), "labels": labels}


def check_llama(cp: CP) -> None:
    """A Llama on shards with CP attention: logits, per-sample losses and parameter gradients == full sequence."""
    config = small_config()
    torch.manual_seed(0)
    reference = Llama(config).double()
    model = copy.deepcopy(reference)
    assert apply_context_parallel_attention(model, cp.group) == config.n_layers
    copied = copy.deepcopy(model)  # models with CP attention can still be copied; the copy shares the group
    assert copied.layers[0].attention.attention_fn.group is cp.group

    batch = _batch(cp, config.vocab_size)
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)  # distinct per-sample weights
    logits = reference(batch["input_ids"])
    losses = per_sample_token_loss(logits, batch["labels"])
    names = [n for n, _ in reference.named_parameters()]
    full_grads = torch.autograd.grad((losses * weights).sum(), list(reference.parameters()))

    local = shard_batch(batch, cp.rank, cp.size)
    assert set(local) == {"input_ids", "labels", "position_ids", "token_counts"}
    local_logits = model(local["input_ids"], local["position_ids"])
    torch.testing.assert_close(all_gather_unsharded(local_logits.detach(), cp.group), logits.detach(), **MODEL)

    local_losses = per_sample_token_loss(local_logits, local["labels"], local["token_counts"])
    summed = local_losses.detach().clone()
    dist.all_reduce(summed, group=cp.group)
    torch.testing.assert_close(summed, losses.detach(), **MODEL)
    (local_losses * weights).sum().backward()
    _assert_cp_grads_match(model, names, full_grads, cp)

    # The CP-aware loss helper: the whole-sequence value on every rank, the same gradients.
    model.zero_grad(set_to_none=True)
    cp_losses = context_parallel_per_sample_loss(
        model(local["input_ids"], local["position_ids"]), local["labels"], local["token_counts"], cp.group
    )
    torch.testing.assert_close(cp_losses.detach(), losses.detach(), **MODEL)
    (cp_losses * weights).sum().backward()
    _assert_cp_grads_match(model, names, full_grads, cp)


def _assert_cp_grads_match(
    model: torch.nn.Module, names: list[str], expected: tuple[torch.Tensor, ...], cp: CP
) -> None:
    for name, param, grad in zip(names, model.parameters(), expected):
        assert param.grad is not None, name
        total = param.grad.clone()
        dist.all_reduce(total, group=cp.group)
        torch.testing.assert_close(total, grad, **MODEL, msg=lambda m, n=name: f"{n}: {m}")
