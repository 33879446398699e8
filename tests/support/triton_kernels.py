"""Running the library's Triton kernels in tests: on CUDA where there is one, else on CPU tensors in a process that
runs Triton's interpreter (``TRITON_INTERPRET=1``, which must be set before Triton is imported)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# For the test that starts the interpreter's process: it runs where the kernels cannot run directly.
needs_interpreter_process = pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available() or INTERPRETED,
                                               reason="the kernels run directly here, or Triton is missing")


@pytest.fixture
def kernel_device() -> torch.device:
    """CUDA if present, else CPU in a process running Triton's interpreter."""
    if torch.cuda.is_available() and HAS_TRITON:
        return torch.device("cuda")
    if HAS_TRITON and INTERPRETED:
        return torch.device("cpu")
    pytest.skip("needs CUDA and Triton, or Triton's interpreter (the file's interpreter test starts it)")


def run_file_under_interpreter(path: str, skipped: int) -> None:
    """Run the test file ``path`` again in a fresh process with ``TRITON_INTERPRET=1``; every test must pass but the
    ``skipped`` ones that only run outside it."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", path],
                            env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert f" {skipped} skipped" in result.stdout.splitlines()[-1], result.stdout[-2000:]
