"""Per-sample gradient capture for every trainable layer of a model, without a second weight-gradient pass."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from lightning_longshield.privacy.clipping import NOT_BATCH_FIRST
from lightning_longshield.privacy.grad_sample.bookkeeping import (
    PER_SAMPLE_METHODS,
    BookKeeper,
    NormEstimate,
    PerSampleMethod,
)
from lightning_longshield.privacy.grad_sample.exchange import LocalExchange
from lightning_longshield.privacy.grad_sample.layers import check_supported_layers, trainable_layers
from lightning_longshield.privacy.grad_sample.tap import PerSampleGradTap, PerSampleLinear, PerSampleRMSNorm

# Receives (weight name, activation, output gradient) of a linear layer during backward.
LinearWeightHandler = Callable[[str, torch.Tensor, torch.Tensor], None]


class PerSampleGradCapture:
    """Computes per-sample gradients ``(B, *shape)`` of all trainable parameters of ``model``, keyed by name.

    In per-sample mode (``enabled``) each trainable layer's forward (replaced on the instance by a `CapturedForward`)
    runs a plain ``nn.Linear`` as the one autograd node `PerSampleLinear`, a plain ``nn.RMSNorm`` on CPU as
    `PerSampleRMSNorm` (which forms its per-sample gradient itself), and any other layer with detached parameters, its
    output passed through a `PerSampleGradTap`; in backward, the exchange turns (activation, output gradient) into
    per-sample gradients (with the layer's Opacus sampler, completing context-parallel partials by communication),
    and autograd never builds the summed ``.grad``. A parameter shared by several layers (tied
    embeddings) receives the sum of its uses, under its first name.

    With ``per_sample="ghost"`` or ``"mixed"`` linear and embedding weights go to a `BookKeeper`: it takes their
    per-sample norms from Gram matrices (or token ids) and keeps (output gradient, input) to form their clipped sums
    once the clipping factors are known; under ``"mixed"`` a layer where that costs more hands the exchange its
    per-sample gradient instead. With ``estimate`` (randomized clipping) linear and embedding weights are book-kept as
    under ``"ghost"`` and the norms of linear and tied weights are estimated from random projections.

    `fuse_linear_weights` sends the (activation, output gradient) of linear layers whose only trainable parameter is
    a weight used once straight to a handler instead (per-layer clipping's fused kernel).

    When a micro-batch holds a single sample, the summed gradient *is* its per-sample gradient, so the exchange
    keeps the capture disabled and plain autograd (with FSDP2's reduce-scatter, if the model is sharded) fills
    ``.grad``, which the exchange reads back.
    """

    def __init__(
        self,
        model: nn.Module,
        exchange: Optional[LocalExchange] = None,
        per_sample: PerSampleMethod = "materialize",
        estimate: Optional[NormEstimate] = None,
    ) -> None:
        if per_sample not in PER_SAMPLE_METHODS:
            raise ValueError(f"per_sample={per_sample!r}; choose one of {PER_SAMPLE_METHODS}.")
        check_supported_layers(model)
        self.exchange = exchange or LocalExchange()
        self._all_parameters = list(model.named_parameters())  # to see `requires_grad` change, without a module walk
        self.parameters: dict[str, nn.Parameter] = {name: p for name, p in self._all_parameters if p.requires_grad}
        self._check_no_gradient_hooks()
        name_of_param = {id(p): name for name, p in self.parameters.items()}
        self._layer_names: dict[int, dict[str, str]] = {}
        self._forwards: list[CapturedForward] = []
        self._layers: list[nn.Module] = []
        self.enabled = False
        self.batch_size = 0  # of the micro-batch being captured
        for _, layer in trainable_layers(model):
            self._layers.append(layer)
            self._layer_names[id(layer)] = {
                attr: name_of_param[id(p)] for attr, p in layer._parameters.items() if p is not None and p.requires_grad
            }
            self._forwards.append(CapturedForward(self, layer))
        #: How many layers own each trainable parameter (2 for tied embeddings).
        self.owners = Counter(name for names in self._layer_names.values() for name in names.values())
        #: Each trainable parameter's uses in this micro-batch: its owning layers' calls in the forward (a tied
        #: weight 2, an output layer applied per chunk of a loss once per chunk). Filled in the forward, read in
        #: backward (per-layer clipping delivers a parameter once all its uses arrived); the same object throughout.
        self.uses: Counter[str] = Counter()
        self.exchange.count_uses(self.uses)
        self.bookkeeper: Optional[BookKeeper] = None
        self._fused: Optional[LinearWeightHandler] = None
        self._fused_layers: set[int] = set()
        self._forward_calls: Counter[int] = Counter()  # per layer, in this micro-batch's forward
        self._forward_tokens: Counter[int] = Counter()  # per book-kept layer: its calls' tokens a sample
        self._calls: Counter[int] = Counter()  # backward deliveries per layer in this micro-batch
        self._tied = {name for name, count in self.owners.items() if count > 1}
        if per_sample != "materialize" or estimate is not None:
            method = "ghost" if estimate is not None else per_sample
            self.bookkeeper = BookKeeper(method, set(self._tied), self.exchange.group, self.exchange.shards, estimate)
            self.bookkeeper.tokens_of = lambda layer: self._forward_tokens[id(layer)]

    def fuse_linear_weights(self, handler: LinearWeightHandler) -> list[str]:
        """In backward, hand ``handler(weight name, activation, output gradient)`` every ``nn.Linear`` whose only
        trainable parameter is its weight, owned by that layer alone; returns those weights' names."""
        self._fused = handler
        self._fused_layers = {
            id(layer) for layer in self._layers
            if type(layer) is nn.Linear and set(self._layer_names[id(layer)]) == {"weight"}
            and self.owners[self._layer_names[id(layer)]["weight"]] == 1
        }
        return [self._layer_names[layer_id]["weight"] for layer_id in self._fused_layers]

    def remove(self) -> None:
        """Restore every layer's own forward; the model behaves as before."""
        for forward in self._forwards:
            forward.uninstall()
        self._forwards.clear()

    def _forward(self, layer: nn.Module, forward: Callable[..., Any], plain: Optional[type[nn.Module]],
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``layer``'s forward with per-sample capture: its parameters reach autograd only through a tap (or, for a
        ``plain`` layer with its class's own forward, one node: `PerSampleLinear`, `PerSampleRMSNorm`), whose
        backward hands the capture the layer's input and output gradient (or its per-sample gradient)."""
        if torch._C._current_graph_task_id() == -1:  # a forward call, not a checkpoint's recomputation in backward
            self._count_call(layer, args, kwargs)
        if plain is not None and len(args) == 1 and not kwargs:
            if plain is nn.Linear:
                return PerSampleLinear.apply(self._receive, layer, args[0], layer.weight, layer.bias)
            if _rms_norm_node_applies(layer, args[0]):
                return PerSampleRMSNorm.apply(self._receive_per_sample, layer, args[0], layer.weight)
        parameters = layer._parameters
        originals = {attr: parameters[attr] for attr in self._layer_names[id(layer)]}
        for attr, param in originals.items():
            parameters[attr] = param.detach()  # type: ignore[assignment]
        try:
            output = forward(*args, **kwargs)
        finally:
            parameters.update(originals)
        return PerSampleGradTap.apply(self._receive, layer, output, _layer_input(layer, args, kwargs),
                                      *originals.values())

    def _count_call(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """One more use of each of ``layer``'s parameters in this micro-batch. A weight used more than once is summed
        over its uses before its norm is taken: the book-keeper treats it as shared (as a tied weight), and judges
        it by the tokens of all the layer's calls (a head applied chunk by chunk: the chunks' lengths)."""
        self._forward_calls[id(layer)] += 1
        names = self._layer_names[id(layer)].values()
        self.uses.update(names)
        if self.bookkeeper is not None and self.bookkeeper.handles(layer, self._layer_names[id(layer)]):
            self._forward_tokens[id(layer)] += _tokens_per_sample(layer, _layer_input(layer, args, kwargs))
            if self._forward_calls[id(layer)] == 2:
                self.bookkeeper.shared = self.bookkeeper.shared | set(names)

    def _receive(self, layer: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor) -> None:
        self._count_delivery(layer, grad_output)
        if self._fused is not None and id(layer) in self._fused_layers and self._forward_calls[id(layer)] <= 1:
            self._fused(self._layer_names[id(layer)]["weight"], activation, grad_output)
            return
        if self.bookkeeper is None or not self.bookkeeper.handles(layer, self._layer_names[id(layer)]):
            self.exchange.receive(layer, activation, grad_output, self._name_of)
            return
        for name, grad_sample in self.bookkeeper.receive(layer, activation, grad_output, self._name_of).items():
            if grad_sample is None:  # materialised by the exchange (a layer with no other parameter to take)
                self.exchange.receive(layer, activation, grad_output, self._name_of)
            else:
                self.exchange.store(name, grad_sample)

    def _receive_per_sample(self, layer: nn.Module, param: nn.Parameter, grad_sample: torch.Tensor) -> None:
        """A one-parameter layer's per-sample gradient, formed by its own node (`PerSampleRMSNorm`): stored as the
        exchange stores its sampler's."""
        self._count_delivery(layer, grad_sample)
        self.exchange.store(self._name_of(layer, param), grad_sample)

    def _count_delivery(self, layer: nn.Module, batch_first: torch.Tensor) -> None:
        """Check that a delivery has the micro-batch's samples along dimension 0, and count it."""
        if batch_first.dim() == 0 or batch_first.shape[0] != self.batch_size:
            # Every path (materialised, book-kept, fused) would take dimension 0 as the samples: a layer applied to an
            # input shared by the batch would spread one sample's gradient over every sample's norm.
            raise RuntimeError(NOT_BATCH_FIRST)
        self._calls[id(layer)] += 1
        if self._calls[id(layer)] > max(1, self._forward_calls[id(layer)]):
            self._check_repeated_call(layer)

    def _check_repeated_call(self, layer: nn.Module) -> None:
        """More backward deliveries than forward calls were counted (a call the capture did not see as one): the
        fused kernel and book-keeping would clip or take the norm of the extra one apart, which could let a sample's
        contribution exceed its bound: refused, before anything is released. Materialised per-sample gradients sum
        every delivery."""
        names = self._layer_names[id(layer)]
        fused = self._fused is not None and id(layer) in self._fused_layers
        bookkept = self.bookkeeper is not None and self.bookkeeper.handles(layer, names) and any(
            name not in self.bookkeeper.shared for name in names.values())
        if fused or bookkept:
            how = "the fused per-layer kernel" if fused else "book-kept norms (norms='ghost', 'mixed' or randomized)"
            raise RuntimeError(
                f"{type(layer).__name__} ({', '.join(sorted(names.values()))}) received more per-sample gradients"
                f" than its calls in the forward; {how} would clip them apart. Call each layer within the forward"
                " (not from a hook in backward), or use norms='materialize'."
            )

    def _name_of(self, layer: nn.Module, param: nn.Parameter) -> str:
        for attr, name in self._layer_names[id(layer)].items():
            if layer._parameters[attr] is param:
                return name
        raise KeyError(f"{type(layer).__name__} returned a per-sample gradient for a parameter it does not own.")

    def start_microbatch(self, batch_size: int) -> None:
        """Capture per-sample gradients in the next backward if the exchange needs them (more than one sample)."""
        self.enabled = self.exchange.start_microbatch(batch_size)
        self.batch_size = batch_size
        self._calls.clear()
        self._forward_calls.clear()
        self._forward_tokens.clear()
        self.uses.clear()
        if self.bookkeeper is not None:
            self.bookkeeper.shared = set(self._tied)

    def check_trainable_unchanged(self) -> None:
        """Refuse a step once parameters were frozen or unfrozen after the capture began: an unfrozen one would get an
        unclipped summed gradient, a frozen one would still be noised and updated."""
        self._check_no_gradient_hooks()
        changed = [name for name, p in self._all_parameters if p.requires_grad != (name in self.parameters)]
        if changed:
            raise RuntimeError(
                f"Parameters were frozen or unfrozen after fit began: {changed[:5]}{' ...' * (len(changed) > 5)}."
                " The DP step clips, noises and accounts the parameters that were trainable when fit began. Set"
                " requires_grad before fit (e.g. in configure_model or setup), or run a new fit after changing it."
            )

    def _check_no_gradient_hooks(self) -> None:
        """Refuse gradient hooks on trainable parameters: the per-sample gradients never pass through them (only a
        one-sample micro-batch's ``.grad`` would), so what they do to a gradient would depend on the micro-batch
        size."""
        hooked = [name for name, p in self.parameters.items()
                  if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)]
        if hooked:
            raise RuntimeError(
                f"Trainable parameters have gradient hooks (Tensor.register_hook or"
                f" register_post_accumulate_grad_hook): {hooked[:5]}{' ...' * (len(hooked) > 5)}. DP-SGD clips"
                " per-sample gradients that these hooks never see. Remove them; to change the private gradient (e.g."
                " mask rows that must not train), do it in on_before_optimizer_step, which sees the released one."
            )

    def collect(self) -> dict[str, torch.Tensor]:
        """Per-sample gradients of the last backward, then forget them (and any ``.grad``) to free memory."""
        if not self.enabled:
            return self.exchange.summed_gradients(self.parameters)
        self.enabled = False
        leaked = [name for name, p in self.parameters.items() if p.grad is not None]
        if leaked:
            raise RuntimeError(
                "These parameters received a summed gradient outside a supported layer's forward, so their"
                f" per-sample gradients are unknown: {leaked}. Use parameters only inside the module that owns"
                " them (tie weights by sharing the nn.Parameter between modules, not with functional calls)."
            )
        return self.exchange.finish()


def _rms_norm_node_applies(layer: nn.Module, activation: Any) -> bool:
    """Whether `PerSampleRMSNorm` runs ``layer`` on ``activation``: an fp32 CPU input and weight. Elsewhere the
    layer's own forward runs behind a tap: on GPUs torch's RMSNorm has a fused kernel and backward, and
    lower-precision or mixed dtypes keep the sampler's dtypes."""
    return (isinstance(activation, torch.Tensor) and activation.device.type == "cpu"
            and activation.dtype == layer.weight.dtype == torch.float32)


def _tokens_per_sample(layer: nn.Module, batch_first: Any) -> int:
    """The tokens of one sample in a call of a book-kept layer: an embedding's ids ``(B, ...)``, a linear layer's
    input ``(B, ..., d)``."""
    if not isinstance(batch_first, torch.Tensor) or batch_first.dim() < 2 or not batch_first.shape[0]:
        return 1
    width = 1 if isinstance(layer, nn.Embedding) else batch_first.shape[-1]
    return batch_first.numel() // (batch_first.shape[0] * max(width, 1))


def _layer_input(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The input of a supported layer's call (its one argument: positional, or by keyword as ``input``)."""
    if args:
        return args[0]
    if len(kwargs) == 1:
        return next(iter(kwargs.values()))
    raise TypeError(f"{type(layer).__name__} was called without its input argument; call it as layer(x).")


class CapturedForward:
    """A trainable layer's forward routed through a `PerSampleGradCapture` while it captures (installed as the
    instance's ``forward``, as `lightning_longshield.activation_checkpointing.CheckpointedForward` is): one call
    per layer call, where a forward pre-hook and hook would take ``nn.Module``'s slower path with hooks."""

    def __init__(self, capture: PerSampleGradCapture, layer: nn.Module) -> None:
        self.capture: Optional[PerSampleGradCapture] = capture
        self.layer = layer
        self.own = layer.__dict__.get("forward")  # a forward installed on the instance before this one
        self.forward: Callable[..., Any] = layer.forward
        # The layer's class, where its forward is F.linear's or F.rms_norm's own (not replaced on the instance, which
        # is then called as it is): it runs as one autograd node.
        plain = type(layer) in (nn.Linear, nn.RMSNorm) and self.own is None
        self.plain: Optional[type[nn.Module]] = type(layer) if plain else None
        layer.forward = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        capture = self.capture
        if capture is None or not (capture.enabled and torch.is_grad_enabled()):
            return self.forward(*args, **kwargs)
        return capture._forward(self.layer, self.forward, self.plain, args, kwargs)

    def uninstall(self) -> None:
        """Pass every call through from now on, and put the layer's previous forward back if this one is still the
        layer's (a forward installed over it later keeps calling this one, which passes through)."""
        self.capture = None
        if self.layer.__dict__.get("forward") is self:
            if self.own is None:
                del self.layer.forward
            else:
                self.layer.forward = self.own
