"""Hugging Face Llama checkpoints (``config.json`` plus safetensors) read into `Llama` (written by `hf.export`).

Our RoPE rotates interleaved pairs ``(x[2i], x[2i+1])`` of each head (Meta's layout), Hugging Face's rotates halves
``(x[i], x[i + head_dim/2])``. The two models are the same once the rows of every head of ``wq`` and ``wk`` are
permuted: `to_interleaved` on import, `to_halves` on export.

Loading reads from the files only the part of each parameter this rank holds (FSDP2 `DTensor` shards along any
dimension), so a meta-device model is filled shard by shard without ever holding the whole checkpoint.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_longshield.hf import TOKENIZER_FILES, require_hf
from lightning_longshield.lora import is_adapter_parameter
from lightning_longshield.models import Llama, LlamaConfig
from simulate.hf_config import read_config_json, spec_from_hf_config

PathLike = Union[str, "os.PathLike[str]"]
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

_TOP_NAMES = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
#: Name segments of wrappers that leave the weight itself unchanged (torch.compile, activation checkpointing, PEFT).
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "base_layer"})
#: Files of the source checkpoint that an export copies as they are: the tokenizer (also a byte-level BPE one saved
#: as ``vocab.json`` and ``merges.txt``), the generation defaults, and the license files a derivative of a model such
#: as Llama must carry.
TOKENIZER_AND_GENERATION_FILES = (*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json",
                                  "chat_template.jinja", "chat_template.json", "generation_config.json", "vocab.json",
                                  "merges.txt")
CARRIED_FILES = (*TOKENIZER_AND_GENERATION_FILES, "LICENSE", "LICENSE.txt", "LICENSE.md", "USE_POLICY.md", "NOTICE")
#: How to download a model from the Hub (huggingface_hub's ``hf`` command; ``huggingface-cli`` before its 1.0).
DOWNLOAD_COMMAND = "hf download <repo> --local-dir <folder> (huggingface-cli download with older huggingface_hub)"
#: ``config.json`` entries an export takes from the source checkpoint: the special tokens' ids.
CARRIED_CONFIG_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


# ---------------------------------------------------------------------------------------------------- configuration


def config_from_hf(hf_config: Mapping[str, Any]) -> LlamaConfig:
    """The `LlamaConfig` of a Hugging Face Llama ``config.json`` (as a dict); ValueError for what `Llama` lacks.

    The reading is the planner's (`simulate.hf_config`, torch-free), so ``longshield-plan --model DIR`` plans the
    model that loads here.
    """
    return spec_from_hf_config(hf_config, LlamaConfig)


def hf_config_dict(config: LlamaConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of ``config``, readable by transformers 4.x and 5.x.

    RoPE is written both as ``rope_theta`` + ``rope_scaling`` (transformers 4) and as ``rope_parameters``
    (transformers 5), and the dtype as ``torch_dtype`` and ``dtype``.
    """
    scaling = config.rope_scaling
    rope_scaling = None
    if scaling.factor != 1.0:
        rope_scaling = dict(
            rope_type="llama3", factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor, original_max_position_embeddings=scaling.original_max_seq_len,
        )
    dtype_name = str(dtype).removeprefix("torch.")
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=config.vocab_size,
        hidden_size=config.dim, intermediate_size=config.ffn_dim, num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim,
        hidden_act="silu", max_position_embeddings=config.max_seq_len, rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings, attention_bias=False, mlp_bias=False,
        rope_theta=config.rope_theta, rope_scaling=rope_scaling,
        rope_parameters={**(rope_scaling or {"rope_type": "default"}), "rope_theta": config.rope_theta},
        torch_dtype=dtype_name, dtype=dtype_name,
    )


def is_model_directory(directory: PathLike) -> bool:
    """Whether ``directory`` holds a Hugging Face model (a ``config.json``)."""
    return (Path(directory).expanduser() / CONFIG_FILE).is_file()


def read_config(directory: PathLike) -> LlamaConfig:
    """The `LlamaConfig` of the Hugging Face Llama checkpoint in ``directory``; a FileNotFoundError that says what is
    missing when ``directory`` is not one."""
    path = Path(directory).expanduser()
    if not is_model_directory(path):
        found = ("no such directory" if not path.exists() else "not a directory" if not path.is_dir()
                 else f"no {CONFIG_FILE} in it")
        raise FileNotFoundError(
            f"No Hugging Face model directory at {os.fspath(directory)!r}: {found}. Pass a local directory holding"
            f" {CONFIG_FILE} and safetensors weights (as written by save_pretrained); a model on the Hub is read from"
            f" a download, e.g. {DOWNLOAD_COMMAND}."
        )
    return config_from_hf(read_config_json(path))


def checkpoint_dtype(directory: PathLike) -> Optional[torch.dtype]:
    """The floating-point dtype the checkpoint in ``directory`` declares (``dtype`` or ``torch_dtype`` in its
    ``config.json``), or None where it names none."""
    hf_config = read_config_json(Path(directory).expanduser())
    name = hf_config.get("dtype") or hf_config.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


# ------------------------------------------------------------------------------------------------ names and layouts


def hf_name(name: str) -> str:
    """The Hugging Face name of one of `Llama`'s parameter names (wrapper segments such as PEFT's ``base_layer``
    are looked through)."""
    *module, leaf = (part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)
    module = ".".join(module)
    block = re.fullmatch(r"layers\.(\d+)\.(.+)", module)
    if leaf == "weight" and module in _TOP_NAMES:
        return f"{_TOP_NAMES[module]}.weight"
    if leaf == "weight" and block and block[2] in _BLOCK_NAMES:
        return f"model.layers.{block[1]}.{_BLOCK_NAMES[block[2]]}.weight"
    raise KeyError(f"{name!r} is not a parameter of a Llama checkpoint.")


def is_rotary(hf: str) -> bool:
    return hf.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight"))


def to_interleaved(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Permute the rows of whole heads from Hugging Face's rotate-half order to interleaved pairs."""
    return weight.unflatten(0, (weight.shape[0] // head_dim, 2, head_dim // 2)).transpose(1, 2).flatten(0, 2)


def to_halves(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of `to_interleaved`."""
    return weight.unflatten(0, (weight.shape[0] // head_dim, head_dim // 2, 2)).transpose(1, 2).flatten(0, 2)


# ---------------------------------------------------------------------------------------------------------- loading


def load_model(
    directory: PathLike, device: Optional[Union[torch.device, str]] = None, dtype: Optional[torch.dtype] = None
) -> Llama:
    """The `Llama` of the Hugging Face Llama checkpoint in ``directory`` (safetensors), on ``device`` (default CPU)
    in ``dtype`` (default fp32).

    With ``device="meta"`` nothing is read yet: the model's ``load_weights`` hook reads the weights when it is
    materialised (its ``init_weights``, e.g. from `lightning_longshield.parallelize.materialize_meta_parameters`,
    shard by shard). The model's ``source_directory`` names ``directory``: `save_pretrained` carries its tokenizer,
    special tokens' ids and dtype into an export.
    """
    with torch.device("meta"):
        model = Llama(read_config(directory))
    model.source_directory = os.fspath(Path(directory).expanduser())
    model.load_weights = functools.partial(load_pretrained_weights, directory=model.source_directory)
    if dtype is not None:
        model.to(dtype)
    device = torch.device(device or "cpu")
    if device.type != "meta":
        model.to_empty(device=device)
        if model.config.tie_embeddings:  # to_empty gives each module its own copy
            model.output.weight = model.tok_embeddings.weight
        model.init_weights()
    return model


#: How a Git LFS pointer file starts (https://github.com/git-lfs/git-lfs/blob/main/docs/spec.md).
_LFS_POINTER = b"version https://git-lfs"


def weight_map(directory: PathLike) -> dict[str, Path]:
    """The safetensors file that holds each tensor of the checkpoint in ``directory`` (one file or an index)."""
    directory = Path(directory)
    single, index = directory / WEIGHTS_FILE, directory / WEIGHTS_INDEX_FILE
    if single.is_file():
        _check_downloaded(single)
        with require_hf("safetensors").safe_open(single, framework="pt") as handle:
            return dict.fromkeys(handle.keys(), single)
    if index.is_file():
        files = {name: directory / file for name, file in _read_index(index).items()}
        for path in sorted(set(files.values())):
            _check_downloaded(path)
        return files
    raise FileNotFoundError(
        f"No weights in {directory}: looked for {WEIGHTS_FILE} and {WEIGHTS_INDEX_FILE} (safetensors checkpoints"
        " only; convert PyTorch .bin weights first, e.g. with transformers:"
        " AutoModelForCausalLM.from_pretrained(d).save_pretrained(d))."
    )


def _read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a sharded checkpoint's index: ValueError naming the file and the fix where it is not
    one (a download cut short)."""
    try:
        mapping = json.loads(index.read_text())["weight_map"]
        if not isinstance(mapping, dict) or not all(isinstance(file, str) for file in mapping.values()):
            raise TypeError("weight_map is not a mapping of tensor names to files")
        return mapping
    except (ValueError, KeyError, TypeError) as error:
        reason = "no weight_map" if isinstance(error, KeyError) else str(error)
        raise ValueError(f"{index} is not a whole safetensors index ({reason}): download it again"
                         f" ({DOWNLOAD_COMMAND}).") from None


def _check_whole_safetensors(path: Path) -> None:
    """Raise, naming the file and the fix, if ``path`` is cut short or its header is damaged: safetensors says
    only "incomplete metadata" or "invalid header", without the file."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        length = int.from_bytes(handle.read(8), "little") if size >= 8 else None
        problem = "shorter than a header" if length is None else None
        if length is not None and 8 + length > size:
            problem = f"its header says {length} bytes, the file holds {size}"
        if problem is None:
            try:
                header = json.loads(handle.read(length))
                end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"),
                          default=0)
            except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                problem = "its header is not safetensors'"
            else:
                if 8 + length + end > size:
                    problem = f"its tensors end at byte {8 + length + end}, the file holds {size}"
    if problem is not None:
        raise ValueError(f"{path} is not a whole safetensors file ({problem}): the download was cut short or the file"
                         f" is damaged. Download it again ({DOWNLOAD_COMMAND}).")


def _check_downloaded(path: Path) -> None:
    """Raise, naming the fix, if a weights file the checkpoint names is missing (a download cut short), is a Git
    LFS pointer (a repository cloned without git-lfs), which safetensors would only call a bad header, or is cut
    short (`_check_whole_safetensors`)."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: {WEIGHTS_INDEX_FILE} names it, so the checkpoint was not downloaded whole. Download"
            f" every file again (e.g. {DOWNLOAD_COMMAND})."
        )
    with path.open("rb") as handle:
        head = handle.read(len(_LFS_POINTER))
    if head == _LFS_POINTER:
        raise ValueError(
            f"{path} is a Git LFS pointer, not the weights: the repository was cloned without git-lfs. Run"
            f" 'git lfs pull' in {path.parent}, or download the model with {DOWNLOAD_COMMAND}."
        )
    _check_whole_safetensors(path)


@torch.no_grad()
def load_pretrained_weights(model: nn.Module, directory: PathLike) -> None:
    """Copy the checkpoint in ``directory`` into ``model`` (a `Llama`, possibly FSDP2-sharded), in place.

    Each parameter reads only the slice this rank holds (a `DTensor`'s local shard, along any dimension; the whole
    heads a row shard of ``wq``/``wk`` overlaps, for the permutation) and is cast to the parameter's dtype. LoRA
    adapters are skipped (their own initialisation applies). Missing or unexpected tensors raise a ValueError.
    """
    safe_open = require_hf("safetensors").safe_open
    files = weight_map(directory)
    params = {hf_name(name): param for name, param in model.named_parameters() if not is_adapter_parameter(name)}
    sources = {name: name for name in params}
    if "lm_head.weight" in params and "lm_head.weight" not in files and model.config.tie_embeddings:
        sources["lm_head.weight"] = "model.embed_tokens.weight"  # a tied model whose parameters were untied
    if model.config.tie_embeddings and {"lm_head.weight", "model.embed_tokens.weight"} <= set(files):
        _refuse_a_stored_head_unlike_the_embedding(files)
    ignored = {"lm_head.weight"} | {name for name in files if name.endswith("rotary_emb.inv_freq")}
    missing = sorted(set(sources.values()) - set(files))
    unexpected = sorted(set(files) - set(sources.values()) - ignored)
    if missing or unexpected:
        raise ValueError(
            f"The checkpoint in {directory} does not match the model ({model.config}): missing tensors {missing},"
            f" unexpected tensors {unexpected}."
        )
    by_file = defaultdict(list)
    for name, source in sources.items():
        by_file[files[source]].append(name)
    head_dim = model.config.head_dim
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as handle:
            for name in names:
                rotary_head_dim = head_dim if is_rotary(name) else 0
                _copy_local_part(params[name], handle.get_slice(sources[name]), name, rotary_head_dim)


def _refuse_a_stored_head_unlike_the_embedding(files: dict[str, Path], rows: int = 8192) -> None:
    """A tied checkpoint may store ``lm_head.weight`` too, as a copy of the embedding; one that differs would be
    dropped silently (transformers 4 ties it, transformers 5 keeps it): refuse it. Compared ``rows`` rows at a time."""
    safe_open = require_hf("safetensors").safe_open
    with safe_open(files["lm_head.weight"], framework="pt") as head_file, \
            safe_open(files["model.embed_tokens.weight"], framework="pt") as embedding_file:
        head, embedding = head_file.get_slice("lm_head.weight"), embedding_file.get_slice("model.embed_tokens.weight")
        same = list(head.get_shape()) == list(embedding.get_shape()) and all(
            torch.equal(head[start:start + rows], embedding[start:start + rows])
            for start in range(0, head.get_shape()[0], rows)
        )
    if not same:
        raise ValueError(
            "config.json ties the output head to the embedding (tie_word_embeddings: true), but the checkpoint stores"
            " an lm_head.weight that differs from model.embed_tokens.weight. Set tie_word_embeddings to false in"
            " config.json to train with the stored head, or remove lm_head.weight from the checkpoint to tie them."
        )


def _copy_local_part(param: torch.Tensor, source: Any, name: str, head_dim: int) -> None:
    """Copy this rank's part of ``source`` (a safetensors slice) into ``param``; ``head_dim`` > 0 permutes rows."""
    if list(source.get_shape()) != list(param.shape):
        raise ValueError(f"{name} has shape {source.get_shape()} in the checkpoint, {list(param.shape)} in the model.")
    if isinstance(param, DTensor):
        local = param.to_local()
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    else:
        local, shape, offset = param, param.shape, (0,) * param.dim()
    if local.numel() == 0:
        return
    box = [slice(start, start + size) for start, size in zip(offset, shape)]
    if head_dim:
        start, stop = box[0].start, box[0].stop
        first = start // head_dim * head_dim
        box[0] = slice(first, -(-stop // head_dim) * head_dim)
        local.copy_(to_interleaved(source[tuple(box)], head_dim)[start - first : stop - first])
    else:
        local.copy_(source[tuple(box)])
