"""Hugging Face interoperability (optional dependencies: ``pip install "lightning-longshield[hf]"``).

Checkpoint import and export live in `lightning_longshield.hf.checkpoint`; this package imports nothing heavy.
"""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL_HINT = 'pip install "lightning-longshield[hf]"'


def require_hf(package: str) -> ModuleType:
    """Import the optional dependency ``package``, or raise an ImportError that says how to install it."""
    try:
        return importlib.import_module(package)
    except ImportError as error:
        raise ImportError(f"{package} is required for this feature but could not be imported; install it with: "
                          f"{INSTALL_HINT}") from error
