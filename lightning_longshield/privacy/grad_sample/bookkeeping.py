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

Rounding. A Gram-form norm is a sum of signed terms and a book-kept clipped sum a separate matmul, so unlike a
materialised gradient (whose norm is taken of the very tensor that is scaled) their rounding is relative to
``S_i = sum_t ||left_t|| ||right_t||``, not to the norm: with token gradients that cancel, fp32 Gram matrices were off
by several times the norm itself. Both are therefore formed in fp64 (in bounded blocks), and the clipping factors
use bounds instead of estimates: the squared norm plus ``gamma S_i^2`` (the fp64 rounding of products of length
``p``, ``d`` and ``T^2`` sums, `norm_rounding`) and, added to the norm, ``k S_i`` (what the clipped sum's fp32 steps
can add: `sum_rounding`). For tokens that do not cancel ``S_i`` is about ``sqrt(T)`` times the norm, and both terms
are below ``10^-5`` relative at ``T = 4096``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_longshield.dist_compat import all_gather_single
from lightning_longshield.privacy.clipping import zero_non_finite_
from lightning_longshield.privacy.grad_sample.layers import token_outer_products, without_padding
from lightning_longshield.privacy.shards import ParamShard, reduce_scatter_to_shard
from simulate.memory import BOOKKEEPING_BLOCK

PerSampleMethod = Literal["materialize", "ghost", "mixed"]
PER_SAMPLE_METHODS: tuple[str, ...] = ("materialize", "ghost", "mixed")
NormMethod = Literal["ghost", "materialize"]
# (parameter name, its uses, reduce over the context-parallel group) -> complete estimated squared norms (B,) fp64,
# with the scale of the projections they were sketched with.
NormEstimate = Callable[[str, list["Use"], Callable[[torch.Tensor], torch.Tensor]], "SketchEstimate"]

#: Elements of one fp64 block (a Gram block, an operand's token chunk, a clipped sum's row block): the fp64 working
#: set stays a few such blocks whatever the sequence length and layer width. Defined with the planner, which sizes
#: that working set by it.
BLOCK_ELEMENTS = BOOKKEEPING_BLOCK
FP32_EPSILON = 2.0**-24
FP64_EPSILON = 2.0**-53


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

    @property
    def left_width(self) -> int:
        return 1 if self.is_lookup else self.left.shape[-1]

    def token_norm_products(self) -> torch.Tensor:
        """``(B,)`` fp64 upper bounds of ``S_i = sum_t ||left_t|| ||right_t||`` (a token id's one-hot row has norm 1),
        the scale of this use's rounding (see the module docstring)."""
        right = _row_norm_bounds(self.right)
        if self.is_lookup:
            return right.sum(1)
        return (_row_norm_bounds(self.left) * right).sum(1)

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
        return token_outer_products(self.left, self.right.to(self.left.dtype))

    def clipped_sum(self, factors: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``sum_i factors[i] * left_i^T right_i`` added into ``out`` (fp32, the weight's shape; zeros when not given).

        ``factors`` are used in fp64 (give them in fp64, `clip_factors` with ``dtype=torch.float64``: an fp32 factor
        in the subnormal range is off by up to 2x). A linear use is summed over the tokens in fp64, a block of output
        rows at a time; an embedding use adds, per sample, its rows summed by token in fp64 (`deduplicated_rows`) and
        scaled in fp64, each rounded to fp32 once.
        """
        width = self.right.shape[-1]
        if out is None:
            out = torch.zeros(self.rows, width, dtype=torch.float32, device=self.right.device)
        if self.is_lookup:
            row_factors = factors.double()
            for table_rows, rows, samples in deduplicated_rows(self.left, self.right):
                out.index_add_(0, table_rows, zero_non_finite_(rows.mul_(row_factors[samples, None]).float()))
            return out
        left, right = self.left.flatten(0, 1), self.right.flatten(0, 1)
        row_factors = factors.double().repeat_interleave(self.tokens)
        out_block = min(self.rows, max(1, BLOCK_ELEMENTS // width))
        token_block = max(1, BLOCK_ELEMENTS // max(width, out_block))
        for first in range(0, self.rows, out_block):
            outputs = slice(first, first + out_block)
            total = torch.zeros(min(out_block, self.rows - first), width, dtype=torch.float64, device=out.device)
            for start in range(0, left.shape[0], token_block):
                tokens = slice(start, start + token_block)
                # A sample with factor 0 may hold inf or NaN in either factor: both fp64 copies drop them.
                scaled = zero_non_finite_(left[tokens, outputs].double() * row_factors[tokens, None])
                inputs = zero_non_finite_(right[tokens].to(torch.float64, copy=True))
                total.addmm_(scaled.transpose(0, 1), inputs)
            out[outputs] += total
        return out


@torch.no_grad()
def gather_tokens(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``(B, T_local, ...)`` -> ``(B, world * T_local, ...)``: the group's tokens, rank by rank."""
    world = dist.get_world_size(group)
    gathered = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    all_gather_single(gathered, x.unsqueeze(0).contiguous(), group=group)
    return gathered.movedim(0, 1).flatten(1, 2)


def _row_norm_bounds(x: torch.Tensor) -> torch.Tensor:
    """Upper bounds (fp64) of the L2 norms of the last-dimension rows of ``x``: an fp32 norm of ``n`` elements is within
    ``n 2^-24`` relative, so it is raised by twice that."""
    width = x.shape[-1]
    return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).double() * (1 + 2 * (width + 2) * FP32_EPSILON)


def deduplicated_rows(
    ids: torch.Tensor, grads: torch.Tensor
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """An embedding use's per-sample gradient as rows: for blocks of samples, ``(table row, fp64 sum of the output
    gradients of that sample's tokens with that id, sample)``, one row per distinct token of a sample.

    Equal tokens are found by sorting each sample's ids: shapes never depend on the data (``T`` rows per sample,
    some left empty, which add zeros to table row 0), so the same code runs on fake tensors (traced memory).
    """
    batch, tokens = ids.shape
    samples_per_block = max(1, BLOCK_ELEMENTS // max(1, tokens * grads.shape[-1]))
    for first in range(0, batch, samples_per_block):
        block_ids = ids[first:first + samples_per_block]
        size = block_ids.shape[0]
        sorted_ids, order = block_ids.sort(dim=1)
        new_token = torch.ones_like(sorted_ids)
        new_token[:, 1:] = (sorted_ids[:, 1:] != sorted_ids[:, :-1]).long()
        offsets = torch.arange(size, device=ids.device)[:, None] * tokens
        row_of_token = torch.empty_like(sorted_ids).scatter_(1, order, new_token.cumsum(1) - 1 + offsets).flatten()
        rows = torch.zeros(size * tokens, grads.shape[-1], dtype=torch.float64, device=grads.device)
        rows.index_add_(0, row_of_token, grads[first:first + size].flatten(0, 1).double())
        table_rows = torch.zeros(size * tokens, dtype=ids.dtype, device=ids.device)
        table_rows.scatter_(0, row_of_token, block_ids.flatten())
        samples = torch.arange(first, first + size, device=ids.device).repeat_interleave(tokens)
        yield table_rows, rows, samples


def _gram(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(B, Ta, Tb)`` fp64 inner products of rows of ``a`` and ``b``; token ids stand for one-hot rows."""
    a_ids, b_ids = not a.is_floating_point(), not b.is_floating_point()
    if a_ids and b_ids:
        return (a[:, :, None] == b[:, None, :]).double()
    if a_ids:  # <onehot(a_t), b_s> = b_s[a_t]
        index = a[:, None, :].expand(b.shape[0], b.shape[1], a.shape[1])
        return b.gather(2, index).transpose(1, 2).double()
    if b_ids:
        return _gram(b, a).transpose(1, 2)
    batch, rows, width = a.shape
    columns = max(1, BLOCK_ELEMENTS // (batch * max(rows, b.shape[1])))  # fp64 copies of bounded size
    gram = torch.zeros(batch, rows, b.shape[1], dtype=torch.float64, device=a.device)
    for start in range(0, width, columns):
        part = slice(start, start + columns)
        gram.baddbmm_(a[..., part].double(), b[..., part].double().transpose(1, 2))
    return gram


def cross_squared_norm(a: Use, b: Use) -> torch.Tensor:
    """``<left_a^T right_a, left_b^T right_b>`` per sample (fp64) from fp64 Gram blocks of bounded size."""
    batch = a.right.shape[0]
    step = max(1, math.isqrt(BLOCK_ELEMENTS // batch))
    total = torch.zeros(batch, dtype=torch.float64, device=a.right.device)
    for start_a in range(0, a.tokens, step):
        rows_a = slice(start_a, start_a + step)
        for start_b in range(0, b.tokens, step):
            rows_b = slice(start_b, start_b + step)
            product = _gram(a.left[:, rows_a], b.left[:, rows_b]) * _gram(a.right[:, rows_a], b.right[:, rows_b])
            total += product.sum((1, 2))
    return total


def lookup_squared_norm(use: Use, shard: Optional[ParamShard] = None) -> torch.Tensor:
    """Squared norm per sample (fp64) of an embedding's per-sample gradient from its token ids: the output gradients
    of equal tokens are summed in fp64 (`deduplicated_rows`), then squared. With ``shard``: only the table rows it
    owns."""
    grads = use.right if shard is None else use.right * shard.owns(use.left)[..., None]
    total = torch.zeros(use.left.shape[0], dtype=torch.float64, device=grads.device)
    for _, rows, samples in deduplicated_rows(use.left, grads):
        total.index_add_(0, samples, rows.square().sum(1))
    return total


def norm_rounding(tokens: int, widths: int) -> float:
    """``gamma``: a Gram-form squared norm in fp64 over ``tokens`` (the whole sequence) and operands ``widths``
    wide in all (``p + d``) is within ``gamma S^2`` of the exact one. Its rounding: inner products of length ``p`` and
    ``d`` (or an embedding's sums of at most ``T`` rows), their product, and a sum of ``T^2`` terms, each of which is
    at most ``S^2`` in absolute sum; twice that, for the first-order bound's higher terms."""
    return 2 * (tokens * tokens + tokens * widths + widths + 8) * FP64_EPSILON


def sum_rounding(world: int, uses: Union[int, torch.Tensor] = 1) -> Union[float, torch.Tensor]:
    """``k``: what a book-kept clipped sum adds for a sample differs from its exact ``c_i W_i`` by at most
    ``c_i k S_i``: fp64 sums over tokens, then for each of the weight's ``uses`` (a head applied chunk by chunk, a
    tied weight) an fp32 rounding of its result (or of an embedding's summed rows) and one of its addition into the
    fp32 sum, one rounding of the factor's product, and an fp32 sum of ``world`` ranks' partial sums under context
    parallelism. Each use's roundings count: an fp32 sum of many uses' parts can lose small ones entirely."""
    return (world + 1 + 2 * uses) * FP32_EPSILON


def sketch_rounding(rows: int, tokens: int, world: int, scale: torch.Tensor) -> torch.Tensor:
    """``rho``: the norm of an fp64 sketch ``M^T W_i`` of a sample (randomized clipping's estimate), formed from a
    projection ``M`` of Frobenius norm at most ``scale`` over ``tokens`` tokens (of every use, over the whole sequence,
    summed from ``world`` ranks' partials), is within ``rho S_i`` of the exact one. Each token's ``left_t M`` (a sum
    of ``rows`` products) is off by at most ``gamma_rows ||left_t|| scale``, and the sum over tokens and ranks adds
    ``gamma_(tokens + world) ||left_t M|| ||right_t||`` per token; twice that, for the higher-order terms. The
    estimator adds to ``scale`` what it needs for roundings of ``M`` itself (Hutch++'s residual projection)."""
    return 2 * (rows + tokens + world + 4) * FP64_EPSILON * scale


@dataclass
class SketchEstimate:
    """Estimated squared norms (fp64, ``(B,)``) and ``scale`` (fp64, 0-dim for a projection shared by the samples,
    ``(B,)`` for Hutch++'s per-sample ones), a bound on the Frobenius norm of the projections each sample was sketched
    with (`sketch_rounding`; 0 for exact norms)."""

    squared: torch.Tensor
    scale: torch.Tensor


@dataclass
class BookKeptNorms:
    """Per-sample bounds (fp64, ``(B,)``) for the book-kept parameters, complete over the group: ``squared`` is at
    least the exact squared norm of their per-sample gradient; ``rounding`` at least the norm by which what
    `BookKeeper.clipped_sums` adds for a sample with factor ``c`` can differ from ``c`` times that gradient, per unit
    ``c``. A factor ``C' / (sqrt(squared) + rounding)`` therefore keeps the computed contribution within ``C'``."""

    squared: torch.Tensor
    rounding: torch.Tensor


class BookKeeper:
    """Per-sample norms by ghost clipping and clipped sums by book-keeping for the linear and embedding weights of a
    model (with ``"mixed"``, those where it is cheaper); other parameters keep materialised per-sample gradients.

    ``method``: ``"ghost"`` takes every norm from Gram matrices (an embedding's from its token ids), ``"mixed"`` the
    cheaper per parameter (`ghost_norm_is_cheaper`, for the whole sequence). ``shared`` names the parameters used by
    several layers (tied weights) or several times (a head applied chunk by chunk): their method is chosen at their
    first use in a micro-batch, for the tokens of all of that layer's calls (``tokens_of(layer)``: a sample's tokens
    over its calls in the forward, which the capture counts), and kept for the others; their Gram-form norms are
    formed once all their uses are known.
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
        self.tokens_of: Callable[[nn.Module], int] = lambda layer: 0  # 0: unknown, a use's own tokens are taken
        self.choices: dict[str, NormMethod] = {}
        self._shared_choices: dict[str, NormMethod] = {}  # this micro-batch's, for tied weights
        self._squared_norms: Optional[torch.Tensor] = None
        self.estimate = estimate
        self._estimated: Optional[torch.Tensor] = None  # complete on every rank: not summed over the group
        # Per book-kept parameter: this rank's part of S_i (summed over the group) and its gamma (`norm_rounding`).
        self._token_norm_products: dict[str, torch.Tensor] = {}
        self._norm_roundings: dict[str, float] = {}
        self._sketch_roundings: dict[str, torch.Tensor] = {}  # estimated parameters' rho (`sketch_rounding`)

    @staticmethod
    def handles(layer: nn.Module, trainable: dict[str, str]) -> bool:
        """Whether a layer's weight is book-kept (a trainable linear or embedding weight)."""
        return type(layer) in (nn.Linear, nn.Embedding) and "weight" in trainable

    @property
    def world(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def receive(self, layer: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
                name_of: Callable[[nn.Module, nn.Parameter], str]) -> dict[str, Optional[torch.Tensor]]:
        """Book-keep the weight's use in this backward, or (mixed, where cheaper) form its per-sample gradient.

        Returns the per-sample gradients ``(B, *shape)`` the caller must treat as materialised, by parameter name: a
        trainable bias, and the weight when the mixed rule materialises it (its clipped sum then comes from the
        per-sample gradient: no (output gradient, input) is kept, and no second matmul is needed); for an
        embedding's weight ``None``: the caller has the exchange form it from the layer's inputs.
        """
        name = name_of(layer, layer.weight)
        batch = grad_output.shape[0]
        # Detached: a kept input with its autograd history would keep the micro-batch's graph (every saved
        # activation) alive through the norms and clipped sums computed from it.
        activation, grad_output = activation.detach(), grad_output.detach()
        if isinstance(layer, nn.Embedding):
            if layer.scale_grad_by_freq or layer.sparse:
                raise TypeError(f"{name}: ghost clipping supports embeddings without scale_grad_by_freq and sparse.")
            ids = activation.reshape(batch, -1).long()  # any integer dtype: the deduplication indexes in int64
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
            # A head applied chunk by chunk would otherwise be judged by one chunk's tokens and book-kept, holding
            # every chunk's (G, A): the whole logits' gradient.
            choice = self._shared_choices.setdefault(name, self._choose(use, self.tokens_of(layer)))
        else:
            choice = self._choose(use)
        self.choices[name] = choice
        if choice == "materialize":
            # An embedding's, and a linear weight's where the layer has nothing else to materialise, are left to the
            # exchange (``None``), which adds an embedding's rows into a tied head's per-sample gradient and a head's
            # later chunks into the sum of its earlier ones, instead of forming a second (B, V, d) tensor.
            left_to_exchange = use.is_lookup or (type(layer) is nn.Linear and not materialized)
            materialized[name] = None if left_to_exchange else use.per_sample_gradient()
            return materialized
        products = use.token_norm_products()
        previous = self._token_norm_products.get(name)
        self._token_norm_products[name] = products if previous is None else previous + products
        if name in self.shared:
            self.uses.setdefault(name, []).append(use)
        else:
            self.uses[name] = [use]
            self._add_norms(name, [use])
        # A weight used several times has a Gram norm over the tokens of all its uses (their cross terms included).
        tokens = sum(kept.tokens for kept in self.uses[name])
        gamma = norm_rounding(tokens * self.world, use.left_width + use.right.shape[-1])
        self._norm_roundings[name] = max(gamma, self._norm_roundings.get(name, 0.0))
        return materialized

    def _choose(self, use: Use, tokens: int = 0) -> NormMethod:
        """The method of ``use``'s weight for ``tokens`` a sample over all its layer's calls (0: ``use``'s own)."""
        if self.method == "ghost":
            return "ghost"
        cheaper = ghost_norm_is_cheaper((tokens or use.tokens) * self.world, use.kept_width, use.weight_numel)
        return "ghost" if cheaper else "materialize"

    def _add_norms(self, name: str, uses: list[Use]) -> None:
        if self.estimate is None or (len(uses) == 1 and uses[0].is_lookup):
            partial = self._squared_norm(name, uses)
            self._squared_norms = partial if self._squared_norms is None else self._squared_norms + partial
            return
        estimated = self.estimate(name, uses, self._all_reduce)
        self._estimated = estimated.squared if self._estimated is None else self._estimated + estimated.squared
        tokens = sum(use.tokens for use in uses) * self.world  # the sketch sums over every use's tokens
        self._sketch_roundings[name] = sketch_rounding(uses[0].rows, tokens, self.world, estimated.scale)

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

    def squared_norms(self, batch_size: int, device: torch.device) -> BookKeptNorms:
        """Complete per-sample squared norms of every book-kept parameter, summed over the group, as bounds that
        hold after rounding (see the module docstring)."""
        for name in sorted(self.shared):  # one order on every rank: the estimates' all-reduces follow it
            if name in self.uses:
                self._add_norms(name, self.uses[name])
        self._shared_choices.clear()
        total, estimated = self._squared_norms, self._estimated
        self._squared_norms = self._estimated = None
        if total is None:
            total = torch.zeros(batch_size, dtype=torch.float64, device=device)
        names = sorted(self._token_norm_products)  # one order on every rank
        products = torch.stack([total, *(self._token_norm_products.pop(name) for name in names)])
        if self.group is not None:
            dist.all_reduce(products, group=self.group)
        total, products = products[0], products[1:]
        gammas = products.new_tensor([self._norm_roundings.pop(name) for name in names]).unsqueeze(1)
        uses = products.new_tensor([len(self.uses[name]) for name in names]).unsqueeze(1)  # each kept till summed
        squared = total + (gammas * products.square()).sum(0)
        rounding = (sum_rounding(self.world, uses) * products).square().sum(0).sqrt()
        if estimated is not None:
            # An estimate's sketch norm is within rho S_i of the exact-arithmetic one the accountant covers: added to
            # the norm (sqrt of a sum of squares grows by at most the sum of what its terms' roots grow by).
            squared = squared + estimated
            zero = products.new_zeros(())  # a parameter with exact norms
            # (P, B): a shared projection's rho is the same for every sample, Hutch++'s is each sample's own.
            rhos = torch.stack([self._sketch_roundings.pop(name, zero).to(products).expand(products.shape[1])
                                for name in names])
            rounding = rounding + (rhos * products).sum(0)
        return BookKeptNorms(squared, rounding)

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
        parameter's book-kept tensors once its sum is formed. ``factors`` are used in fp64 (see `Use.clipped_sum`)."""
        factors = factors.double()
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
