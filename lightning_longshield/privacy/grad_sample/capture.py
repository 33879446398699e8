"""Per-sample gradient capture for every trainable layer of a model, without a second weight-gradient pass."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_longshield.privacy.grad_sample.layers import check_supported_layers, grad_sampler_for, trainable_layers
from lightning_longshield.privacy.grad_sample.tap import PerSampleGradTap


class PerSampleGradCapture:
    """Computes per-sample gradients ``(B, *param.shape)`` of all trainable parameters of ``model``.

    In per-sample mode (``enabled``) each trainable layer runs its forward with detached parameters and its output
    passes through a `PerSampleGradTap`; the Opacus sampler of the layer turns (activation, output gradient) into
    per-sample gradients during backward, and autograd never builds the summed ``.grad``. A parameter shared by
    several layers (tied embeddings) receives the sum of its uses, as one parameter.

    When a micro-batch holds a single sample, the summed gradient *is* its per-sample gradient, so the capture stays
    disabled and plain autograd fills ``.grad``: no extra buffer and no extra work.
    """

    def __init__(self, model: nn.Module) -> None:
        check_supported_layers(model)
        self.parameters: list[nn.Parameter] = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
        self.names: dict[nn.Parameter, str] = {}
        for name, p in model.named_parameters():
            self.names.setdefault(p, name)
        self.grad_samples: dict[nn.Parameter, torch.Tensor] = {}
        self.enabled = False
        self._detached: dict[int, dict[str, nn.Parameter]] = {}
        self._handles: list[RemovableHandle] = []
        for _, layer in trainable_layers(model):
            self._handles.append(layer.register_forward_pre_hook(self._detach_parameters))
            self._handles.append(layer.register_forward_hook(self._attach_tap, always_call=True))

    def remove(self) -> None:
        """Remove all hooks; the model behaves as before."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _detach_parameters(self, layer: nn.Module, args: tuple[Any, ...]) -> None:
        if not (self.enabled and torch.is_grad_enabled()):
            return
        originals = {n: p for n, p in layer._parameters.items() if p is not None and p.requires_grad}
        for name, param in originals.items():
            layer._parameters[name] = param.detach()  # type: ignore[assignment]
        self._detached[id(layer)] = originals

    def _attach_tap(self, layer: nn.Module, args: tuple[Any, ...], output: Any) -> Optional[torch.Tensor]:
        originals = self._detached.pop(id(layer), None)
        if originals is None:
            return None
        layer._parameters.update(originals)
        if not isinstance(output, torch.Tensor):
            return None  # the forward raised; parameters are restored and the error propagates
        return PerSampleGradTap.apply(self._receive, layer, output, args[0], *originals.values())

    def _receive(self, layer: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor) -> None:
        for param, grad_sample in grad_sampler_for(layer)(layer, [activation], grad_output).items():
            previous = self.grad_samples.get(param)
            self.grad_samples[param] = grad_sample if previous is None else previous + grad_sample

    def collect(self) -> dict[nn.Parameter, torch.Tensor]:
        """Per-sample gradients of the last backward, then forget them (and any ``.grad``) to free memory."""
        if self.enabled:
            leaked = [self.names[p] for p in self.parameters if p.grad is not None]
            if leaked:
                raise RuntimeError(
                    "These parameters received a summed gradient outside a supported layer's forward, so their"
                    f" per-sample gradients are unknown: {leaked}. Use parameters only inside the module that owns"
                    " them (tie weights by sharing the nn.Parameter between modules, not with functional calls)."
                )
            grads, self.grad_samples = self.grad_samples, {}
            return grads
        grads = {p: p.grad.unsqueeze(0) for p in self.parameters if p.grad is not None}
        for p in self.parameters:
            p.grad = None
        return grads
