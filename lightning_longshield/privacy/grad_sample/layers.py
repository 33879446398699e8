"""Which layer types have per-sample gradients, and the Opacus sampler that computes them.

Every supported sampler is a sum over the token dimension of a per-token outer product (or a per-token scatter),
so a partial per-sample gradient over a shard of the tokens is meaningful and shards sum to the full one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from opacus.grad_sample import GradSampleModule
from torch import nn

# Maps (layer, [activation], grad_output) -> {parameter: per-sample gradient (B, *parameter.shape)}.
GradSampler = Callable[[nn.Module, list[torch.Tensor], torch.Tensor], dict[nn.Parameter, torch.Tensor]]

SUPPORTED_LAYER_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding, nn.RMSNorm, nn.LayerNorm)


def per_sample_gradients(
    layer: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """``(B, *shape)`` per-sample gradients of ``layer``'s trainable parameters by the sampler for its exact type:
    the normalisations' own (`normalization_gradients`), else Opacus's registered one; an embedding's padding row gets
    none, as from autograd (Opacus's sampler scatters into it)."""
    if isinstance(layer, nn.Embedding):
        grad_output = without_padding(layer, activation, grad_output)
    if type(layer) in (nn.RMSNorm, nn.LayerNorm):
        return normalization_gradients(layer, activation, grad_output)
    if type(layer) is nn.Linear:
        return linear_gradients(layer, activation, grad_output)
    sampler: GradSampler = GradSampleModule.GRAD_SAMPLERS[type(layer)]
    return sampler(layer, [activation], grad_output)


def linear_gradients(
    layer: nn.Linear, activation: torch.Tensor, grad_output: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of a linear layer's weight and bias: the values of Opacus's sampler (the output gradient's
    outer product with the input, summed over the tokens; the bias's, the output gradient summed), the weight's as one
    `token_outer_products` (``bmm``) rather than an ``einsum``, which costs a few percent more on CPU here."""
    grads: dict[nn.Parameter, torch.Tensor] = {}
    if layer.weight.requires_grad:
        if activation.dtype != grad_output.dtype:
            activation = activation.to(grad_output.dtype)
        grads[layer.weight] = token_outer_products(grad_output, activation)
    if layer.bias is not None and layer.bias.requires_grad:
        grads[layer.bias] = grad_output.reshape(grad_output.shape[0], -1, grad_output.shape[-1]).sum(1)
    return grads


def token_outer_products(left: torch.Tensor, right: torch.Tensor,
                         add_to: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(B, p, d)``: for each sample, the sum over its tokens of ``left_t right_t^T``, from ``left`` ``(B, ..., p)``
    and ``right`` ``(B, ..., d)`` (any token dimensions, or none), as one batched matrix product; with ``add_to``
    (contiguous, ``(B, p, d)``) added into it in place, with no tensor of its own."""
    batch = left.shape[0]
    left = left.reshape(batch, -1, left.shape[-1])
    right = right.reshape(batch, -1, right.shape[-1])
    if add_to is not None:
        return add_to.baddbmm_(left.transpose(1, 2), right)
    return torch.bmm(left.transpose(1, 2), right)


def normalization_gradients(
    layer: nn.RMSNorm | nn.LayerNorm, activation: torch.Tensor, grad_output: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of an RMSNorm's or LayerNorm's affine parameters: the values of Opacus's samplers (the
    normalised activation times the output gradient, summed over the tokens; the bias's, the output gradient summed),
    with the product formed in place in the recomputed normalised activation (one activation-sized temporary fewer),
    and a LayerNorm without bias supported (Opacus's sampler reads the missing bias)."""
    grads: dict[nn.Parameter, torch.Tensor] = {}
    token_dims = tuple(range(1, activation.dim() - len(layer.normalized_shape)))
    if layer.weight is not None and layer.weight.requires_grad:
        if isinstance(layer, nn.RMSNorm):
            normalized = F.rms_norm(activation, layer.normalized_shape, eps=layer.eps)
        else:
            normalized = F.layer_norm(activation, layer.normalized_shape, eps=layer.eps)
        if torch.result_type(normalized, grad_output) == normalized.dtype:
            product = normalized.mul_(grad_output)
        else:  # a lower-precision normalised activation: promote, as the out-of-place product does
            product = normalized * grad_output
        grads[layer.weight] = product.sum(token_dims) if token_dims else product
    bias = getattr(layer, "bias", None)
    if bias is not None and bias.requires_grad:
        # A copy without token dimensions: the output gradient itself still flows into the layer's backward.
        grads[bias] = grad_output.sum(token_dims) if token_dims else grad_output.clone()
    return grads


def add_embedding_gradients_(
    total: torch.Tensor, layer: nn.Embedding, ids: torch.Tensor, grad_output: torch.Tensor
) -> None:
    """Add ``layer``'s per-sample weight gradients to ``total`` ``(B, V, d)`` in place, without the ``(B, V, d)``
    tensor the sampler forms (`per_sample_gradients`): only the rows of the (sample, token id) pairs the micro-batch
    holds are touched. The same values as ``total.add_`` of the sampler's tensor: each row's sum over its tokens in
    token order, in the output gradient's dtype from zero, then one rounding into ``total``'s dtype; padding tokens
    add nothing. A tied embedding's use is added into the head's per-sample gradient this way: under bf16-mixed the
    sampler's tensor is fp32 (the lookup runs outside autocast), twice the head's bytes.

    Every shape is static (fake tensors trace it): each token's row sum is formed at the row's first token, read back
    at all of its tokens, and written to the row once per token, the same value each time."""
    grad_output = without_padding(layer, ids, grad_output)
    batch, dim = total.shape[0], total.shape[-1]
    offsets = torch.arange(batch, device=ids.device).unsqueeze(1) * layer.num_embeddings
    rows = (ids.reshape(batch, -1) + offsets).reshape(-1)  # a row of total.view(-1, d) per token
    flat = total.view(-1, dim)
    positions = torch.arange(rows.numel(), device=rows.device)
    first = torch.full((flat.shape[0],), rows.numel(), dtype=torch.long, device=rows.device)
    first = first.scatter_reduce_(0, rows, positions, "amin")[rows]  # each token's row's first token
    sums = torch.zeros(rows.numel(), dim, dtype=grad_output.dtype, device=grad_output.device)
    sums.index_add_(0, first, grad_output.reshape(-1, dim))
    flat[rows] = flat[rows].add_(sums[first])


def without_padding(layer: nn.Embedding, ids: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """An embedding's output gradients ``(..., d)`` with those of its padding tokens zeroed."""
    if layer.padding_idx is None:
        return grad_output
    return grad_output * (ids != layer.padding_idx).unsqueeze(-1)


def trainable_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that directly own a trainable parameter, with their qualified names."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if any(p.requires_grad for p in module.parameters(recurse=False))
    ]


def check_supported_layers(model: nn.Module) -> None:
    """Raise a `TypeError` listing every trainable layer whose per-sample gradient cannot be computed, and a
    `ValueError` for embeddings whose options break the guarantee (`check_embedding_options`) and for layers that
    mix the batch's samples or keep its statistics (`check_no_running_statistics`)."""
    check_embedding_options(model)
    check_no_running_statistics(model)
    unsupported = [
        f"{name or '<root>'} ({type(module).__name__})"
        for name, module in trainable_layers(model)
        if type(module) not in SUPPORTED_LAYER_TYPES
    ]
    if unsupported:
        supported = ", ".join(t.__name__ for t in SUPPORTED_LAYER_TYPES)
        raise TypeError(
            "DP-SGD needs per-sample gradients for every trainable parameter, but these layers are not supported: "
            + "; ".join(unsupported)
            + f". Supported layer types: {supported}. Freeze these layers (requires_grad=False) or rebuild them from"
            " the supported types."
        )


def check_no_running_statistics(model: nn.Module) -> None:
    """Raise a `ValueError` naming every layer whose training forward depends on the other samples of the batch or
    updates state from it, trainable or frozen: BatchNorm (batch statistics mix the samples, so no per-sample gradient
    exists, and its running statistics, ``num_batches_tracked`` counting the micro-batches, are updated from the
    sampled batch without noise and released with the model) and an InstanceNorm that tracks running statistics.
    Opacus refuses them alike."""
    found = [f"{name or '<root>'} ({type(module).__name__})" for name, module in model.named_modules()
             if isinstance(module, nn.modules.batchnorm._BatchNorm)
             or (isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats)]
    if found:
        raise ValueError(
            "These layers mix the samples of a batch or keep statistics of the sampled batches, which DP-SGD cannot"
            " release: " + "; ".join(found) + ". Replace them with LayerNorm or RMSNorm, which normalise each sample"
            " alone."
        )


def check_embedding_options(model: nn.Module) -> None:
    """Raise a `ValueError` naming every ``nn.Embedding`` built with an option that DP-SGD cannot cover.

    ``max_norm``: the forward renormalises, in place and without noise, the table rows of the tokens it looks up, so
    the released weights would depend on the sampled private batch outside the mechanism; this holds for a frozen
    embedding too (its weights are released with the model). ``scale_grad_by_freq`` (trainable embeddings): the
    gradient is divided by token counts over the whole micro-batch, mixing samples, so no per-sample gradient exists.
    ``sparse`` (trainable embeddings): autograd's sparse ``.grad``, which a one-sample micro-batch's clipping reads,
    cannot be reshaped, and book-keeping has no sparse path; refused up front, where it would fail only at a random
    step under Poisson sampling.
    """
    problems = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Embedding):
            continue
        options = []
        if module.max_norm is not None:
            options.append(f"max_norm={module.max_norm}")
        if module.scale_grad_by_freq and module.weight.requires_grad:
            options.append("scale_grad_by_freq=True")
        if module.sparse and module.weight.requires_grad:
            options.append("sparse=True")
        if options:
            problems.append(f"{name or '<root>'} ({', '.join(options)})")
    if problems:
        raise ValueError(
            "DP-SGD cannot train with these embeddings: " + "; ".join(problems) + ". max_norm renormalises the rows"
            " of the sampled batch's tokens in place, without noise (a change to the released model that depends on"
            " the private batch); scale_grad_by_freq scales gradients by token counts over the whole micro-batch"
            " (no per-sample gradient); sparse gradients are not supported by per-sample clipping. Construct the"
            " embeddings without max_norm and scale_grad_by_freq, and with sparse=False (e.g."
            " nn.Embedding(num_embeddings, dim))."
        )
