"""Randomized per-sample squared gradient norms: Hutchinson and Hutch++ on factored per-sample gradients.

A parameter's per-sample gradient is ``W_i = sum_u left_u,i^T right_u,i`` (``p x d``; one term per use, see
`Use`), and ``||W_i||_F^2 = trace(W_i W_i^T)``. Randomized trace estimation (summary of DP-SGD-RC, "Efficient DP-SGD
for LLMs with Randomized Clipping") replaces it by

- Hutchinson: ``||P^T W_i||_F^2`` with ``P`` ``p x k``, entries i.i.d. ``N(0, 1/k)``; unbiased since
  ``E[P P^T] = I``, with variance ``(2/k) ||W_i W_i^T||_F^2``. ``P^T W_i = sum_u (left_u,i P)^T right_u,i`` is
  formed from the factors: ``O(B k (T + d))`` memory besides ``P``, no ``p x d`` gradient and no ``T x T`` Gram.
- Hutch++: a head basis ``Q`` (``p x s``, orthonormal) of ``W_i W_i^T S`` for a Gaussian ``S``, the head
  ``||Q^T W_i||_F^2`` exactly, and Hutchinson with ``r`` fresh projections on the residual ``(I - Q Q^T) W_i``.
  Unbiased given ``Q`` (``||W||^2 = ||Q^T W||^2 + ||(I - Q Q^T) W||^2``), and far less spread when the spectrum
  decays. ``projection_dim = k`` is split as ``s = k // 3`` head columns and ``r = k - k // 3`` residual
  projections: ``k`` Gaussian columns in all. The accountant's conservative Hutch++ envelope (``envelope.py``) gives
  the adversary ``Q``, so its ``k`` is ``r`` (`residual_projections`).

The privacy analysis needs Gaussian projections, fresh at every step and independent of the data: every draw here
comes from the caller's ``generator`` (never the global RNG), on the uses' device.

Context parallelism: every product here that sums over tokens is linear in the tokens, so each rank's partial over
its token shard sums over the group to the full one; the ``reduce`` argument (an all-reduce over the CP group) is
applied to each such partial before anything non-linear (norms, QR) is computed from it.

Rounding. The accountant covers clipping by the estimate as exact arithmetic forms it from the drawn projections. A
sketch sums signed token terms, so, as a Gram-form norm (`bookkeeping`), its rounding scales with
``S_i = sum_t ||left_t|| ||right_t||``, not with the estimate: in fp32, token gradients that cancel made a sample's
contribution 1.06 times the accounted bound (Hutch++: 1.09). Sketches, range samples and QR are therefore formed in
fp64, in bounded token blocks, and each estimate comes with the scale of its projections (`SketchEstimate`), from
which `sketch_rounding` bounds the error of every sketch's norm; the book-keeper adds that bound to the norm it clips
with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Optional, Union

import torch

from lightning_longshield.privacy.grad_sample.bookkeeping import (
    SketchEstimate,
    Use,
    cross_squared_norm,
    lookup_squared_norm,
)
from lightning_longshield.privacy.randomized.envelope import ScaleEnvelope, scale_envelope
from lightning_longshield.privacy.randomness import SecretKey, standard_normal

ESTIMATORS = ("exact", "hutchinson", "hutchpp")

#: The envelope's name of each estimator (``envelope.ESTIMATORS`` spells Hutch++ ``"hutch++"``).
ENVELOPE_NAMES = {"exact": "exact", "hutchinson": "hutchinson", "hutchpp": "hutch++"}

#: fp64 elements of one token block's converted inputs (4 MiB): inputs are cast to fp64 block by block, so no fp64
#: copy of a whole ``(B, T, p)`` tensor is made.
BLOCK_ELEMENTS = 2**19

Reduce = Callable[[torch.Tensor], torch.Tensor]
#: One torch generator, or several whose draws are summed (a CUDA generator holds 126 secret bits).
Generators = Union[torch.Generator, Sequence[torch.Generator]]


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def check_estimator(estimator: str, projection_dim: int) -> None:
    """Raise ``ValueError`` unless ``estimator`` is one of `ESTIMATORS` with a usable ``projection_dim``.

    ``"exact"`` ignores ``projection_dim``; ``"hutchinson"`` needs ``projection_dim >= 1``; ``"hutchpp"`` needs
    ``projection_dim >= 3`` (a head of ``k // 3 >= 1`` columns and a residual of ``k - k // 3 >= 2`` projections).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator={estimator!r} is not supported; choose one of {ESTIMATORS}.")
    if estimator == "exact":
        return
    if isinstance(projection_dim, bool) or int(projection_dim) != projection_dim or projection_dim < 1:
        raise ValueError(f"projection_dim must be a positive integer (e.g. 32), got {projection_dim!r}.")
    if estimator == "hutchpp" and projection_dim < 3:
        raise ValueError(
            f"estimator='hutchpp' splits projection_dim into a head of k // 3 and a residual of k - k // 3 "
            f"projections, so it needs projection_dim >= 3, got {projection_dim}; raise it or use 'hutchinson'."
        )


def hutchpp_split(projection_dim: int) -> tuple[int, int]:
    """``(s, r)``: Hutch++'s head sketch columns ``k // 3`` and residual (Hutchinson) projections ``k - k // 3``."""
    check_estimator("hutchpp", projection_dim)
    head = projection_dim // 3
    return head, projection_dim - head


def residual_projections(estimator: str, projection_dim: int) -> Optional[int]:
    """The ``k`` the accountant's envelope must use: ``projection_dim`` for Hutchinson, the residual projections
    ``projection_dim - projection_dim // 3`` for Hutch++, ``None`` for exact norms (``scale_envelope``'s input)."""
    check_estimator(estimator, projection_dim)
    if estimator == "exact":
        return None
    if estimator == "hutchinson":
        return int(projection_dim)
    return hutchpp_split(projection_dim)[1]


def accountant_envelope(estimator: str, projection_dim: int) -> ScaleEnvelope:
    """The accountant's sensitivity-scale envelope for this estimator and ``projection_dim``."""
    return scale_envelope(ENVELOPE_NAMES[estimator], residual_projections(estimator, projection_dim))


def gaussian_projection(
    rows: int, k: int, generator: Generators, device: Union[torch.device, str, None] = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(rows, k)`` with i.i.d. ``N(0, 1/k)`` entries drawn from ``generator`` (which must live on ``device``), or
    from several generators (`SecretKey.generators`) whose draws are summed (`standard_normal`)."""
    generators = (generator,) if isinstance(generator, torch.Generator) else tuple(generator)
    return standard_normal(generators, (rows, k), torch.device(device or "cpu"), dtype, std=k**-0.5)


def _token_blocks(use: Use) -> Iterator[slice]:
    """Token ranges whose fp64 copies stay within `BLOCK_ELEMENTS`."""
    batch, tokens = use.left.shape[:2]
    width = (0 if use.is_lookup else use.left.shape[-1]) + use.right.shape[-1]
    step = max(1, BLOCK_ELEMENTS // max(1, batch * width))
    for start in range(0, tokens, step):
        yield slice(start, start + step)


def _left_times(left: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``left_i M`` (``(B, t, c)`` fp64) for fp64 ``M`` ``(p, c)`` shared or ``(B, p, c)`` per sample; token ids
    pick rows of ``M``."""
    if left.is_floating_point():
        return left.double() @ matrix
    if matrix.dim() == 2:
        return matrix[left]
    return matrix.gather(1, left[..., None].expand(-1, -1, matrix.shape[-1]))


def _sketch(use: Use, matrix: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``M^T W_i = (left_i M)^T right_i`` (``(B, c, d)`` fp64, for fp64 ``M``), added into ``out`` when given."""
    batch, width = use.right.shape[0], use.right.shape[-1]
    if out is None:
        out = torch.zeros(batch, matrix.shape[-1], width, dtype=torch.float64, device=use.right.device)
    for block in _token_blocks(use):
        projected = _left_times(use.left[:, block], matrix)
        out.baddbmm_(projected.transpose(1, 2), use.right[:, block].double())
    return out


def _apply(use: Use, matrix: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out += W_i Z_i = left_i^T (right_i Z_i)`` for ``Z`` ``(B, d, c)``: a scatter-add into rows for token ids."""
    for block in _token_blocks(use):
        mixed = use.right[:, block].double() @ matrix
        left = use.left[:, block]
        if left.is_floating_point():
            out.baddbmm_(left.double().transpose(1, 2), mixed)
        else:
            out.scatter_add_(1, left[..., None].expand(-1, -1, mixed.shape[-1]), mixed)
    return out


def sketch(use: Use, projection: torch.Tensor) -> torch.Tensor:
    """The per-sample ``(B, k, d)`` fp64 sketch ``P^T W_i = (left_i P)^T right_i`` for ``projection`` ``(p, k)``
    (``(rows, k)`` for a lookup use, whose ``left_i P`` is ``projection[ids]``).

    Memory ``O(B k (T + d))`` besides ``projection``: no ``(B, p, d)`` gradient and no ``(B, T, T)`` Gram. With
    token-sharded inputs (context parallelism) each rank's sketch is a partial one; the ranks' partials sum to the
    sketch of the whole sequence.
    """
    if projection.dim() != 2 or projection.shape[0] != use.rows:
        raise ValueError(f"projection must be ({use.rows}, k) for this use, got {tuple(projection.shape)}.")
    return _sketch(use, projection.double())


def hutchinson_squared_norms(sketches: torch.Tensor) -> torch.Tensor:
    """``(B,)`` fp64 squared Frobenius norms of complete ``(B, k, d)`` sketches: unbiased for ``||W_i||_F^2``.

    ``sketches`` must be the sum over a parameter's uses and, under context parallelism, over the group's ranks.
    """
    return sketches.double().square().sum((1, 2))


def _check_uses(uses: list[Use]) -> tuple[int, int, torch.device]:
    """``(B, rows)`` shared by the uses of one parameter, and their device."""
    if not uses:
        raise ValueError("at least one use is needed.")
    first = uses[0]
    shape = (first.right.shape[0], first.rows, first.right.shape[-1])
    for use in uses[1:]:
        if (use.right.shape[0], use.rows, use.right.shape[-1]) != shape:
            raise ValueError("the uses of one parameter must share the batch size and the weight's shape.")
    return first.right.shape[0], first.rows, first.right.device


def hutchpp_squared_norms(
    uses: list[Use], generator: Generators, projection_dim: int, reduce: Reduce = _identity,
) -> torch.Tensor:
    """``(B,)`` fp64 Hutch++ estimates of ``||W_i||_F^2``, ``W_i = sum_u left_u,i^T right_u,i``.

    Draws ``S`` (``rows x s``) then ``P`` (``rows x r``, ``N(0, 1/r)``) from ``generator`` (`hutchpp_split`), and per
    sample: ``Y = W (W^T S)``, ``Q = qr(Y)``, head ``||Q^T W||^2``, tail ``||(P - Q (Q^T P))^T W||^2``, all from the
    factors, in fp64. ``reduce`` is applied to ``W^T S``, ``Y``, ``Q^T W`` and the tail sketch, the partial sums over
    tokens: under context parallelism it is the all-reduce over the group, every rank then holds the same complete
    tensors, and QR (deterministic) of identical inputs gives every rank the same ``Q``.
    """
    return _hutchpp(uses, generator, projection_dim, reduce).squared


def _hutchpp(uses: list[Use], generator: Generators, projection_dim: int, reduce: Reduce) -> SketchEstimate:
    batch, rows, device = _check_uses(uses)
    head_dim, residual_dim = hutchpp_split(projection_dim)
    head_sketch = gaussian_projection(rows, head_dim, generator, device).double()
    residual = gaussian_projection(rows, residual_dim, generator, device).double()
    w_t_s = None  # (B, s, d): (W^T S)^T
    for use in uses:
        w_t_s = _sketch(use, head_sketch, w_t_s)
    w_t_s = reduce(w_t_s)
    range_sample = torch.zeros(batch, rows, head_dim, dtype=torch.float64, device=device)
    for use in uses:
        _apply(use, w_t_s.transpose(1, 2), range_sample)
    basis = torch.linalg.qr(reduce(range_sample)).Q  # (B, rows, s), orthonormal even if Y is rank-deficient
    del range_sample, w_t_s
    head = None
    for use in uses:
        head = _sketch(use, basis, head)
    head_norms = hutchinson_squared_norms(reduce(head))
    del head
    drawn_scale = _frobenius(residual)
    residual = residual - basis @ (basis.transpose(1, 2) @ residual)  # (B, rows, r): (I - Q Q^T) P
    tail = None
    for use in uses:
        tail = _sketch(use, residual, tail)
    # The head's and the tail's sketches, and the rounding of (I - Q Q^T) P itself: within gamma_(rows + s + 1)
    # (1 + ||Q||_F^2) ||P||_F, which moves the tail's norm by at most that times ||W_i||_2 <= S_i (`sketch_rounding`'s
    # factor covers gamma_(rows + s + 1) for s <= rows). Q's own departure from orthonormality (about rows s 2^-53)
    # changes head + tail relative to ||W_i||^2, not to S_i: a relative error, which the clipping margin absorbs.
    basis_scale = _frobenius(basis)
    scale = basis_scale + _frobenius(residual) + (1 + basis_scale.square()) * drawn_scale
    return SketchEstimate(head_norms + hutchinson_squared_norms(reduce(tail)), scale)


def _frobenius(matrices: torch.Tensor) -> torch.Tensor:
    """The Frobenius norm of each of the ``(..., rows, c)`` matrices (fp64, shape ``...``: 0-dim for one shared
    projection, ``(B,)`` for a sample's own), rounded up generously (a scale for a bound; a tensor, so that no value is
    read on the host). Never a maximum over samples: a sample's bound must not depend on the others (one sample's NaN
    basis would make every sample's bound NaN, and every factor 0)."""
    return matrices.flatten(-2).norm(dim=-1) * (1 + 2**-20)


def estimate_squared_norms(
    estimator: str, uses: list[Use], generator: Generators, projection_dim: int, reduce: Reduce = _identity,
) -> torch.Tensor:
    """``(B,)`` fp64 estimates of ``||sum_u left_u,i^T right_u,i||_F^2`` for the uses of one parameter.

    ``"hutchinson"``: one projection ``(rows, k)`` from ``generator``, shared by the uses; their sketches are summed,
    reduced and squared. ``"hutchpp"``: `hutchpp_squared_norms`. ``"exact"``: exact norms of the given tokens (no
    draws); it needs every token of each sequence, so it refuses a ``reduce`` (gather the uses instead, as
    `BookKeeper` does).
    """
    return _estimate(estimator, uses, generator, projection_dim, reduce).squared


def _estimate(
    estimator: str, uses: list[Use], generator: Generators, projection_dim: int, reduce: Reduce,
) -> SketchEstimate:
    check_estimator(estimator, projection_dim)
    _, rows, device = _check_uses(uses)
    if estimator == "exact":
        if reduce is not _identity:
            raise ValueError("estimator='exact' needs whole sequences: pass gathered uses (Use.gathered), no reduce.")
        if len(uses) == 1 and uses[0].is_lookup:
            squared = lookup_squared_norm(uses[0])
        else:
            squared = sum(cross_squared_norm(a, b) for a in uses for b in uses)
        return SketchEstimate(squared, torch.zeros((), dtype=torch.float64, device=device))
    if estimator == "hutchpp":
        return _hutchpp(uses, generator, projection_dim, reduce)
    projection = gaussian_projection(rows, projection_dim, generator, device).double()
    sketches = None
    for use in uses:
        sketches = _sketch(use, projection, sketches)
    return SketchEstimate(hutchinson_squared_norms(reduce(sketches)), _frobenius(projection))


class RandomizedNorms:
    """The book-keeper's norm estimate under randomized clipping: `estimate_squared_norms` with each parameter's
    projections drawn from generators keyed by ``(DP step, parameter name)`` (`start_step`, the strategy's secret
    projection key): fresh and secret at every step, the same for every micro-batch, data-parallel group and
    context-parallel rank of the step. So a sample's clip factor depends on its own gradient and the step's
    projections only, never on which other samples were drawn or how they were grouped into micro-batches."""

    def __init__(self, estimator: str, projection_dim: int) -> None:
        check_estimator(estimator, projection_dim)
        if estimator == "exact":
            raise ValueError("RandomizedNorms estimates norms; exact norms need no projections.")
        self.estimator = estimator
        self.projection_dim = projection_dim
        self._key: Optional[SecretKey] = None
        self._step = 0

    def start_step(self, key: SecretKey, step: int) -> None:
        """Key the projections of DP step ``step``."""
        self._key, self._step = key, step

    def __call__(self, name: str, uses: list[Use], reduce: Reduce) -> SketchEstimate:
        if self._key is None:
            raise RuntimeError("RandomizedNorms.start_step must key the projections before a backward.")
        generators = self._key.generators(uses[0].right.device, "projection", self._step, name)
        return _estimate(self.estimator, uses, generators, self.projection_dim, reduce)
