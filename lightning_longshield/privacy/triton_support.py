"""Where the library's Triton kernels (fused per-layer clipping, fused keyed noise) can run."""

from __future__ import annotations

import os

import torch


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can run on ``device``: Triton is installed (it ships with PyTorch's CUDA wheels) and
    the device is CUDA, or Triton's interpreter is on (``TRITON_INTERPRET=1``, CPU tensors, for tests)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
