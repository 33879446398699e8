"""What a DP step holds, announced to whoever watches it (the traced memory estimate labels tensors with it)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class DPStepObserver:
    """Receives the DP engine's events during a step; every method is a no-op here.

    Register one with `DPSGDEngine.observe`. The tensors are the engine's own: an observer may inspect them (shape,
    storage) but must not modify or keep them, or it changes what the step computes and holds.
    """

    def microbatch_started(self) -> None:
        """A micro-batch's forward is about to run."""

    def per_sample_gradient(self, grad_sample: torch.Tensor) -> None:
        """A layer's sampler computed a per-sample gradient ``(B, *shape)`` from this rank's tokens during backward
        (under context parallelism a partial, before the exchange completes it)."""

    def microbatch_gradients(self, grad_samples: Iterable[torch.Tensor]) -> None:
        """The per-sample gradients of a whole micro-batch, about to be clipped (at micro-batch 1: the ``.grad``); with
        per-layer clipping, those of the layers just completed during backward."""

    def clipped_sums(self, sums: Iterable[torch.Tensor]) -> None:
        """The logical batch's clipped-sum buffers after a micro-batch was added."""
