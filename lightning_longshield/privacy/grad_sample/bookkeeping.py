"""Per-sample norms without per-sample gradients (ghost clipping) and the clipped sum by book-keeping (BK).

A linear layer's per-sample weight gradient is ``G_i^T A_i`` (``G``: output gradients ``(T, p)``, ``A``: inputs
``(T, d)``); its squared norm is ``<G_i G_i^T, A_i A_i^T>``, two ``T x T`` Gram matrices instead of a ``p x d``
gradient (ghost clipping). ``"mixed"`` takes, parameter by parameter, the cheaper (`ghost_norm_is_cheaper`): the
Gram matrices and book-kept ``(G, A)`` when ``T (p + d) < p d``, else the per-sample gradient, which then also
gives the clipped sum (as without ghost clipping). An embedding's per-sample gradient scatters ``G_i`` into the rows
of its tokens: its squared norm adds, per distinct token of the sample, the squared norm of that token's summed
output gradients, with no ``vocab x dim`` tensor. Book-keeping keeps ``(G, A)`` until
the clipping factors ``c`` are known, then forms each layer's clipped sum ``sum_i c_i G_i^T A_i`` as one matmul: one
backward suffices.

A tied parameter (embedding and output head) has the sum of its uses as per-sample gradient, so its squared norm
adds the cross terms ``<G_a^T A_a, G_b^T A_b> = <G_a G_b^T, A_a A_b^T>`` of every pair of uses (for an embedding
use, ``G`` is the one-hot matrix of its tokens): exact, not the sum of the two norms.

Under context parallelism each rank holds a shard of every sequence. A Gram-matrix norm is computed per rank as one
row block (its tokens against the group's gathered tokens); the blocks of all ranks sum to the whole, so the ranks'
contributions are summed over the group, and each rank's clipped sum over its own tokens is reduce-scattered to the
owners of the parameter's shards. Materialised per-sample gradients take the exchange's path (V1 / V2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_longshield.privacy.clipping import CLIP_MARGIN
from lightning_longshield.privacy.grad_sample.layers import without_padding
from lightning_longshield.privacy.shards import ParamShard, reduce_scatter_to_shard

PerSampleMethod = Literal["materialize", "ghost", "mixed"]
PER_SAMPLE_METHODS: tuple[str, ...] = ("materialize", "ghost", "mixed")
NormMethod = Literal["ghost", "materialize"]
# (uses of one parameter, reduce over the context-parallel group) -> complete estimated squared norms (B,) fp64.
NormEstimate = Callable[[list["Use"], Callable[[torch.Tensor], torch.Tensor]], torch.Tensor]

#: Elements of one block of a Gram matrix product: longer sequences are processed in row blocks of this size.
GRAM_BLOCK_ELEMENTS = 2**24


def ghost_norm_is_cheaper(tokens: int, kept_width: int, numel: int) -> bool:
    """The mixed rule: ghost norm and book-keeping beat a materialised per-sample gradient, in memory and in FLOPs.

    Per sample, book-keeping holds ``tokens x kept_width`` elements (a linear layer's ``(G, A)``: ``p + d`` wide; an
    embedding's ``(ids, G)``: ``1 + d``) against the gradient's ``numel``. For a linear layer the Gram matrices also
    cost ``T^2 (p + d)`` multiply-adds against the gradient's ``T p d``: both comparisons are ``T (p + d) < p d``,
    which implies ``2 T^2 < p d`` (Bu et al.'s rule, which counts only the Gram matrices and so book-keeps layers
    whose ``(G, A)`` outweigh their gradient).
    """
    return tokens * kept_width < numel


@dataclass
class Use:
    """One use of a parameter in a micro-batch: the per-sample gradient is ``left_i^T right_i``.

    ``left`` is ``(B, T, p)`` output gradients of a linear layer, or ``(B, T)`` token ids of an embedding (the
    one-hot rows of a ``rows x d`` table); ``right`` is ``(B, T, d)``: the linear layer's inputs or the embedding's
    output gradients.
    """

    left: torch.Tensor
    right: torch.Tensor
    rows: int

    @property
    def is_lookup(self) -> bool:
        return not self.left.is_floating_point()

    @property
    def tokens(self) -> int:
        return self.left.shape[1]

    @property
    def weight_numel(self) -> int:
        """Elements of the weight (``rows x d``): of one sample's gradient."""
        return self.rows * self.right.shape[-1]

    @property
    def kept_width(self) -> int:
        """Elements kept per token (token ids count one)."""
        return (1 if self.is_lookup else self.left.shape[-1]) + self.right.shape[-1]

    def gathered(self, group: Optional[dist.ProcessGroup]) -> Use:
        """This use with the tokens of every rank of ``group`` (itself without a group)."""
        if group is None:
            return self
        return Use(gather_tokens(self.left, group), gather_tokens(self.right, group), self.rows)

    def per_sample_gradient(self) -> torch.Tensor:
        """``(B, p, d)`` per-sample gradients of a linear use, or ``(B, rows, d)`` of an embedding use, in the output
        gradients' dtype (as Opacus's samplers form them)."""
        if self.is_lookup:
            batch, _, width = self.right.shape
            out = torch.zeros(batch, self.rows, width, dtype=self.right.dtype, device=self.right.device)
            return out.scatter_add_(1, self.left[..., None].expand(-1, -1, width), self.right)
        return torch.einsum("btp,btd->bpd", self.left, self.right.to(self.left.dtype))

    def clipped_sum(self, factors: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``sum_i factors[i] * left_i^T right_i`` as one fp32 matmul (or one scatter for an embedding), added into
        ``out`` (fp32, the weight's shape) when given."""
        right = self.right.float()
        if self.is_lookup:
            scaled = (right * factors[:, None, None]).flatten(0, 1)
            if out is None:
                out = torch.zeros(self.rows, right.shape[-1], dtype=torch.float32, device=right.device)
            return out.index_add_(0, self.left.flatten(), scaled)
        scaled = (self.left.float() * factors[:, None, None]).flatten(0, 1)
        with exact_fp32_matmul():
            if out is None:
                return scaled.transpose(0, 1) @ right.flatten(0, 1)
            return out.addmm_(scaled.transpose(0, 1), right.flatten(0, 1))


@torch.no_grad()
def gather_tokens(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``(B, T_local, ...)`` -> ``(B, world * T_local, ...)``: the group's tokens, rank by rank."""
    world = dist.get_world_size(group)
    gathered = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(gathered, x.unsqueeze(0).contiguous(), group=group)
    return gathered.movedim(0, 1).flatten(1, 2)


@contextmanager
def exact_fp32_matmul() -> Iterator[None]:
    """fp32 matmuls without TF32 on CUDA: a clipped contribution must not be rounded above its bound."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def _gram(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(B, Ta, Tb)`` fp32 inner products of rows of ``a`` and ``b``; token ids stand for one-hot rows."""
    a_ids, b_ids = not a.is_floating_point(), not b.is_floating_point()
    if a_ids and b_ids:
        return (a[:, :, None] == b[:, None, :]).float()
    if a_ids:  # <onehot(a_t), b_s> = b_s[a_t]
        index = a[:, None, :].expand(b.shape[0], b.shape[1], a.shape[1])
        return b.float().gather(2, index).transpose(1, 2)
    if b_ids:
        return _gram(b, a).transpose(1, 2)
    with exact_fp32_matmul():
        return torch.bmm(a.float(), b.float().transpose(1, 2))


def cross_squared_norm(a: Use, b: Use) -> torch.Tensor:
    """``<left_a^T right_a, left_b^T right_b>`` per sample (fp64) from Gram blocks, ``a``'s rows in blocks."""
    batch, tokens_b = b.left.shape[0], b.tokens
    total = torch.zeros(batch, dtype=torch.float64, device=a.right.device)
    step = max(1, GRAM_BLOCK_ELEMENTS // max(1, batch * tokens_b))
    for start in range(0, a.tokens, step):
        rows = slice(start, start + step)
        product = _gram(a.left[:, rows], b.left) * _gram(a.right[:, rows], b.right)
        total += product.sum((1, 2), dtype=torch.float64)
    return total


def lookup_squared_norm(use: Use, shard: Optional[ParamShard] = None) -> torch.Tensor:
    """Squared norm per sample (fp64) of an embedding's per-sample gradient from its token ids: the output gradients
    of equal tokens are summed (one row each), then squared. With ``shard``: only the table rows it owns.

    Equal tokens are found by sorting each sample's ids: shapes never depend on the data (``B T`` rows, some left
    empty), so the same code runs on fake tensors (traced memory).
    """
    ids, grads = use.left, use.right.float()
    batch, tokens = ids.shape
    if shard is not None:
        grads = grads * shard.owns(ids)[..., None]
    sorted_ids, order = ids.sort(dim=1)
    new_token = torch.ones_like(sorted_ids, dtype=torch.long)
    new_token[:, 1:] = (sorted_ids[:, 1:] != sorted_ids[:, :-1]).long()
    rank_in_sample = new_token.cumsum(1) - 1 + torch.arange(batch, device=ids.device)[:, None] * tokens
    row_of_token = torch.empty_like(rank_in_sample).scatter_(1, order, rank_in_sample)
    summed = torch.zeros(batch * tokens, grads.shape[-1], dtype=torch.float32, device=grads.device)
    summed.index_add_(0, row_of_token.flatten(), grads.flatten(0, 1))
    return summed.view(batch, tokens, -1).double().square().sum((1, 2))


class BookKeeper:
    """Per-sample norms by ghost clipping and clipped sums by book-keeping for the linear and embedding weights of a
    model (with ``"mixed"``, those where it is cheaper); other parameters keep materialised per-sample gradients.

    ``method``: ``"ghost"`` takes every norm from Gram matrices (an embedding's from its token ids), ``"mixed"`` the
    cheaper per parameter (`ghost_norm_is_cheaper`, for the whole sequence). ``shared`` names the parameters used by
    several layers (tied weights): their method is chosen at their first use in a micro-batch and kept for the
    others, and their Gram-form norms are formed once all their uses are known.
    ``group`` / ``shards``: the context-parallel group and the shard of every parameter on this rank (``None`` / empty
    without context parallelism).

    ``estimate`` (randomized clipping, ``method="ghost"``): the norms of linear weights and of tied weights come from
    it instead of Gram matrices (`lightning_longshield.privacy.randomized.estimator.RandomizedNorms`), given partial
    products that it completes over the group; an untied embedding keeps its exact norm from token ids.
    """

    def __init__(
        self,
        method: PerSampleMethod,
        shared: set[str],
        group: Optional[dist.ProcessGroup] = None,
        shards: Optional[dict[str, ParamShard]] = None,
        estimate: Optional[NormEstimate] = None,
    ) -> None:
        if method not in ("ghost", "mixed"):
            raise ValueError(f"BookKeeper computes 'ghost' or 'mixed' norms, got {method!r}.")
        self.method = method
        self.shared = shared
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.shards = shards or {}
        self.uses: dict[str, list[Use]] = {}
        self.choices: dict[str, NormMethod] = {}
        self._shared_choices: dict[str, NormMethod] = {}  # this micro-batch's, for tied weights
        self._squared_norms: Optional[torch.Tensor] = None
        self.estimate = estimate
        self._estimated: Optional[torch.Tensor] = None  # complete on every rank: not summed over the group

    @staticmethod
    def handles(layer: nn.Module, trainable: dict[str, str]) -> bool:
        """Whether a layer's weight is book-kept (a trainable linear or embedding weight)."""
        return type(layer) in (nn.Linear, nn.Embedding) and "weight" in trainable

    @property
    def world(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def receive(self, layer: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
                name_of: Callable[[nn.Module, nn.Parameter], str]) -> dict[str, torch.Tensor]:
        """Book-keep the weight's use in this backward, or (mixed, where cheaper) form its per-sample gradient.

        Returns the per-sample gradients ``(B, *shape)`` the caller must treat as materialised, by parameter name: a
        trainable bias, and the weight when the mixed rule materialises it (its clipped sum then comes from the
        per-sample gradient: no (output gradient, input) is kept, and no second matmul is needed).
        """
        name = name_of(layer, layer.weight)
        batch = grad_output.shape[0]
        # Detached: a kept input with its autograd history would keep the micro-batch's graph (every saved
        # activation) alive through the norms and clipped sums computed from it.
        activation, grad_output = activation.detach(), grad_output.detach()
        if isinstance(layer, nn.Embedding):
            if layer.scale_grad_by_freq or layer.sparse:
                raise TypeError(f"{name}: ghost clipping supports embeddings without scale_grad_by_freq and sparse.")
            ids = activation.reshape(batch, -1)
            grads = without_padding(layer, ids, grad_output.reshape(batch, -1, grad_output.shape[-1]))
            use = Use(ids, grads, layer.num_embeddings)
        else:
            grads = grad_output.reshape(batch, -1, grad_output.shape[-1])
            use = Use(grads, activation.reshape(batch, -1, activation.shape[-1]), layer.out_features)
        materialized = {}
        bias = getattr(layer, "bias", None)
        if bias is not None and bias.requires_grad:
            materialized[name_of(layer, bias)] = grads.sum(1)
        if name in self.shared:
            choice = self._shared_choices.setdefault(name, self._choose(use))
        else:
            choice = self._choose(use)
        self.choices[name] = choice
        if choice == "materialize":
            materialized[name] = use.per_sample_gradient()
        elif name in self.shared:
            self.uses.setdefault(name, []).append(use)
        else:
            self.uses[name] = [use]
            self._add_norms(name, [use])
        return materialized

    def _choose(self, use: Use) -> NormMethod:
        if self.method == "ghost":
            return "ghost"
        cheaper = ghost_norm_is_cheaper(use.tokens * self.world, use.kept_width, use.weight_numel)
        return "ghost" if cheaper else "materialize"

    def _add_norms(self, name: str, uses: list[Use]) -> None:
        if self.estimate is None or (len(uses) == 1 and uses[0].is_lookup):
            partial = self._squared_norm(name, uses)
            self._squared_norms = partial if self._squared_norms is None else self._squared_norms + partial
            return
        estimated = self.estimate(uses, self._all_reduce)
        self._estimated = estimated if self._estimated is None else self._estimated + estimated

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(partial, group=self.group)
        return partial

    def _squared_norm(self, name: str, uses: list[Use]) -> torch.Tensor:
        """This rank's contribution to the squared norms of ``name``'s per-sample gradients (fp64, ``(B,)``)."""
        if len(uses) == 1 and uses[0].is_lookup:
            use = uses[0]
            if self.group is None:
                return lookup_squared_norm(use)
            return lookup_squared_norm(use.gathered(self.group), self.shards[name])
        gathered = [use.gathered(self.group) for use in uses]
        return sum(cross_squared_norm(a, b) for a in uses for b in gathered)

    def squared_norms(self, batch_size: int, device: torch.device) -> torch.Tensor:
        """Complete per-sample squared norms (fp64) of every book-kept parameter, summed over the group."""
        for name in sorted(self.shared):  # one order on every rank: estimates draw projections in it
            if name in self.uses:
                self._add_norms(name, self.uses[name])
        self._shared_choices.clear()
        total, estimated = self._squared_norms, self._estimated
        self._squared_norms = self._estimated = None
        if total is None:
            total = torch.zeros(batch_size, dtype=torch.float64, device=device)
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        return total if estimated is None else total + estimated

    @property
    def clip_margin(self) -> float:
        """Relative margin below ``C`` that covers the rounding between a book-kept norm and its summed gradient.

        The norm and the clipped sum are two fp32 reductions over the ``T`` tokens of a sample (with ``T`` the whole
        sequence); each is off by at most ``T * 2^-24`` relative, so clipping to ``C (1 - 2 T 2^-24)`` keeps every
        contribution, as computed, within ``C``.
        """
        tokens = max((use.tokens for uses in self.uses.values() for use in uses), default=0) * self.world
        return max(CLIP_MARGIN, 2 * tokens * 2.0**-24)

    def held_bytes(self) -> int:
        """Bytes of the book-kept tensors (each storage once: layers sharing an input share it)."""
        storages = {}
        for uses in self.uses.values():
            for use in uses:
                for tensor in (use.left, use.right):
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def clipped_sums(self, factors: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's part of every book-kept parameter's clipped sum (fp32), one parameter at a time; forgets each
        parameter's book-kept tensors once its sum is formed."""
        factors = factors.float()
        while self.uses:
            name, uses = self.uses.popitem()
            total = uses[0].clipped_sum(factors)
            for use in uses[1:]:
                use.clipped_sum(factors, out=total)
            del uses
            if self.group is not None:
                total = reduce_scatter_to_shard(total, self.shards[name], self.group)
            elif name in self.shards:  # one rank: the whole sum (padded when sharded over replicas)
                total = self.shards[name].take(total)
            yield name, total
