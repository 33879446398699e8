"""Hugging Face interoperability (optional dependencies: ``pip install "lightning-longshield[hf]"``).

`load_model`, `save_pretrained` and `read_config` read and write Hugging Face Llama directories; they live in
`lightning_longshield.hf.checkpoint` (reading) and `lightning_longshield.hf.export` (writing), imported only when one
is called, so this package imports nothing heavy.
"""

from __future__ import annotations

import importlib
import os
import re
from types import ModuleType
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    import torch

    from lightning_longshield.models import Llama, LlamaConfig

INSTALL_HINT = 'pip install "lightning-longshield[hf]"'
#: The files by which a Hugging Face model directory holds a tokenizer (any one of them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
#: The largest weights file an export writes unless told otherwise (``save_pretrained(max_shard_size=...)``).
DEFAULT_MAX_SHARD_SIZE = "5GB"
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}


def shard_bytes(size: Union[int, str]) -> int:
    """``size`` in bytes: an int, or a string such as ``"5GB"`` (10^9 bytes), ``"2GiB"`` (2^30) or ``"1000000"``
    (bytes), as transformers reads ``max_shard_size``."""
    if isinstance(size, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", size, flags=re.IGNORECASE)
        if match is None:
            raise ValueError(f"max_shard_size={size!r} is not a size: give bytes (1000000000), or e.g. '5GB' or"
                             " '2GiB'.")
        size = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"max_shard_size must be a positive number of bytes, not {size!r}.")
    return size


def model_tokenizer(directory: Union[str, os.PathLike], fix: str) -> Optional[str]:
    """``directory`` where that model directory holds a tokenizer (`TOKENIZER_FILES`), to tokenize its training data
    with; else ``None``, with a warning that the data is tokenized as UTF-8 bytes, and ``fix``."""
    if any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES):
        return os.fspath(directory)
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    files = ", ".join(TOKENIZER_FILES)
    rank_zero_warn(f"The model directory {os.fspath(directory)!r} has no tokenizer (none of {files}): the data is"
                   f" tokenized as UTF-8 bytes, ids the model was not trained on. {fix}")
    return None


def require_hf(package: str) -> ModuleType:
    """Import the optional dependency ``package``, or raise an ImportError that says how to install it."""
    try:
        return importlib.import_module(package)
    except ImportError as error:
        raise ImportError(f"{package} is required for this feature but could not be imported; install it with: "
                          f"{INSTALL_HINT}") from error


def load_model(
    directory: Union[str, os.PathLike], device: Optional[Union[torch.device, str]] = None,
    dtype: Optional[torch.dtype] = None,
) -> Llama:
    """The `Llama` of the Hugging Face Llama directory ``directory`` (``config.json`` + safetensors) on ``device``
    (default CPU; ``"meta"`` defers reading to the model's materialisation, shard by shard) in ``dtype``."""
    from lightning_longshield.hf import checkpoint

    return checkpoint.load_model(directory, device, dtype)


def save_pretrained(model: torch.nn.Module, directory: Union[str, os.PathLike],
                    dtype: Optional[torch.dtype] = None,
                    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE, tokenizer: Any = None) -> None:
    """Write ``model`` (a `Llama`, possibly FSDP2-sharded, LoRA adapters merged) as a Hugging Face Llama directory
    that ``transformers.AutoModelForCausalLM.from_pretrained`` loads, in safetensors files of at most
    ``max_shard_size`` (bytes, or e.g. ``"5GB"``); a collective when the model is sharded. A Hugging Face
    ``tokenizer`` (the one it trained with) is saved with a model not loaded from a checkpoint."""
    from lightning_longshield.hf import export

    export.save_pretrained(model, directory, dtype, max_shard_size, tokenizer)


def read_config(directory: Union[str, os.PathLike]) -> LlamaConfig:
    """The `LlamaConfig` of the Hugging Face Llama directory ``directory``."""
    from lightning_longshield.hf import checkpoint

    return checkpoint.read_config(directory)


def check_weights(directory: Union[str, os.PathLike]) -> None:
    """Raise a FileNotFoundError that names the fix unless ``directory`` holds safetensors weights (one file or an
    index)."""
    from lightning_longshield.hf import checkpoint

    checkpoint.weight_map(directory)


def is_model_directory(directory: Union[str, os.PathLike]) -> bool:
    """Whether ``directory`` holds a Hugging Face model (a ``config.json``)."""
    from lightning_longshield.hf import checkpoint

    return checkpoint.is_model_directory(directory)
