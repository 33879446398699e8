"""The model's own randomness in a DP step (dropout): the global generators keyed per step from a secret.

A step's forward draws dropout masks from the global generators as it runs its micro-batches, so how much it draws
depends on the size of its Poisson batch. On the stream of the public ``seed``, a sample's presence at one step would
shift the masks of every sample after it, in that step and in every later one: the other samples' gradients would
change by more than the clipping bound, which the noise does not cover. So each DP step runs with the global
generators of its device keyed by a secret and the step's index, and the streams outside the step are put back as they
were: within a step the masks are as unpredictable as its noise (a sample's presence changes which masks the others
draw, not how they are distributed), and nothing drawn outside a step depends on a batch's size.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from lightning_longshield.privacy.randomness import SecretKey


class StepRandomness:
    """The global generators of one process for its DP steps: torch's on the CPU and, on an accelerator, its
    device's, and Python's and NumPy's (a ``training_step`` may draw a masking or an augmentation from them)."""

    def __init__(self, key: SecretKey, device: torch.device) -> None:
        self._key = key
        self._device = torch.device(device)

    @contextmanager
    def step(self, index: int) -> Iterator[None]:
        """Run DP step ``index`` with the global generators keyed for it, then restore the streams outside steps."""
        accelerator = self._device.type not in ("cpu", "meta")
        devices = [self._device_index()] if accelerator else []
        python_state, numpy_state = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=devices, device_type=self._device.type if accelerator else None):
                self._key.key_generator(torch.default_generator, "step", index)
                if accelerator:
                    self._key.key_generator(self._default_generator(), "step", index)
                random.seed(int.from_bytes(self._key.stream(32, "python-random", index), "little"))
                np.random.seed(np.frombuffer(self._key.stream(32, "numpy-random", index), dtype="<u4"))
                yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)

    def _device_index(self) -> int:
        module = torch.get_device_module(self._device.type)
        return self._device.index if self._device.index is not None else module.current_device()

    def _default_generator(self) -> torch.Generator:
        module = torch.get_device_module(self._device.type)
        generators = getattr(module, "default_generators", None)
        if generators is None:
            raise RuntimeError(f"The {self._device.type} device has no default generators to key for a DP step's"
                               " dropout; run the DP step on CUDA or the CPU.")
        return generators[self._device_index()]
