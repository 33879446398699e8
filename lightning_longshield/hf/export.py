"""Hugging Face Llama exports: a `Llama` (FSDP2-sharded or not, LoRA adapters merged) as ``config.json`` plus
safetensors weights that ``transformers`` loads.

The weights are streamed: gathered a tensor at a time, cast, and written in shards of at most ``max_shard_size``
bytes (5 GB by default, the layout of Meta's Llama checkpoints on the Hub, whose files may not exceed 50 GB), so the
writing rank holds one shard and one gathered tensor, not the whole model. A model that fits in one shard is one
``model.safetensors``; a larger one is ``model-00001-of-0000N.safetensors`` ... with ``model.safetensors.index.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_longshield.dist_compat import all_gathered, world_size
from lightning_longshield.durable_checkpoints import replace_durably
from lightning_longshield.hf import DEFAULT_MAX_SHARD_SIZE, require_hf, shard_bytes
from lightning_longshield.hf.checkpoint import (
    CARRIED_CONFIG_KEYS,
    CARRIED_FILES,
    CONFIG_FILE,
    TOKENIZER_AND_GENERATION_FILES,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    PathLike,
    checkpoint_dtype,
    hf_config_dict,
    hf_name,
    is_model_directory,
    is_rotary,
    to_halves,
)
from lightning_longshield.lora import MergedUpdates, merged_tensors
from lightning_longshield.models import LlamaConfig
from lightning_longshield.privacy.ledger import fsync_directory
from simulate.hf_config import read_config_json

_EMBEDDING, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


class _Shards:
    """Tensors written to safetensors files of at most ``limit`` bytes each (a larger tensor alone in its own), in
    the order added, under temporary names beside the export until `publish` names them."""

    def __init__(self, directory: Path, limit: int) -> None:
        self.directory, self.limit = directory, limit
        self._tensors: dict[str, torch.Tensor] = {}
        self._bytes = 0
        self._written: list[tuple[Path, list[str]]] = []  # a temporary file and the tensors it holds
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._tensors and self._bytes + size > self.limit:
            self._flush()
        self._tensors[name] = tensor
        self._bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        temporary = self.directory / f".{WEIGHTS_FILE}.{os.getpid()}.{len(self._written)}.partial"
        self._written.append((temporary, list(self._tensors)))  # first: `discard` removes a file cut short
        require_hf("safetensors.torch").save_file(self._tensors, str(temporary), metadata={"format": "pt"})
        with open(temporary, "r+b") as file:
            os.fsync(file.fileno())
        self._tensors, self._bytes = {}, 0

    def publish(self) -> list[str]:
        """Rename the shards into place and write the index if there are several; their names. Loaders read
        ``model.safetensors`` before an index, so one shard replaces the weights in one rename. Several shards are
        renamed in only after a previous ``model.safetensors`` and index are removed: a cut-short export then leaves
        no weights to load, never the old ones beside the new or an index over a mix."""
        if self._tensors:
            self._flush()
        count = len(self._written)
        names = [WEIGHTS_FILE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in
                                                   range(1, count + 1)]
        previous = [path for path in (self.directory / WEIGHTS_FILE, self.directory / WEIGHTS_INDEX_FILE)
                    if path.is_file()]
        if count > 1 and previous:
            for path in previous:
                path.unlink()
            fsync_directory(self.directory)
        for (temporary, _), name in zip(self._written, names):
            os.replace(temporary, self.directory / name)
        fsync_directory(self.directory)
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {tensor: name for (_, tensors), name in zip(self._written, names)
                                    for tensor in tensors}}
            replace_durably(self.directory / WEIGHTS_INDEX_FILE,
                            lambda path: path.write_text(json.dumps(index, indent=2) + "\n"))
        self._written = []
        return names

    def discard(self) -> None:
        """Remove the temporary files of an export that failed."""
        for temporary, _ in self._written:
            temporary.unlink(missing_ok=True)
        self._written = []


def exported_tensor(name: str, tensor: torch.Tensor, config: LlamaConfig,
                    dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A tensor as the export writes it (``name`` is Hugging Face's): contiguous, on the CPU, in ``dtype``, the rows
    of ``wq``/``wk`` back in rotate-half order."""
    tensor = tensor.detach().to("cpu", dtype)
    return (to_halves(tensor, config.head_dim) if is_rotary(name) else tensor).contiguous()


def write_pretrained(
    state: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]], config: LlamaConfig,
    directory: PathLike, dtype: Optional[torch.dtype] = None, source: Optional[PathLike] = None,
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE, tokenizer: Any = None,
) -> None:
    """Write full tensors under `Llama`'s names (a mapping, or pairs one at a time as `merged_tensors` yields them)
    and ``config`` as a Hugging Face Llama directory: ``config.json`` and safetensors weights in shards of at most
    ``max_shard_size`` (see the module).

    A tied model whose output weight no longer equals its embedding (a LoRA adapter on the head, merged) is written
    untied, with ``lm_head.weight``. With ``source``, the Hugging Face directory the model was loaded from, the
    special tokens' ids of its ``config.json`` and its `CARRIED_FILES` (tokenizer, generation defaults, license) come
    along, and tokenizer files in ``directory`` that it lacks (another model's) are removed. Without ``source``, a
    Hugging Face ``tokenizer`` (the one the model was trained with) is saved there and gives those ids. Ids known
    from neither are written as null: transformers would otherwise read Llama 2's 1 and 2. The weights of an
    earlier export there are replaced: its index and shards that the new export does not overwrite are removed.
    """
    limit = shard_bytes(max_shard_size)
    directory = Path(directory).expanduser()  # as loading and the CLI's up-front check read it
    directory.mkdir(parents=True, exist_ok=True)
    previous = _previous_weights(directory)
    carried = read_config_json(Path(source).expanduser()) if source is not None else _token_ids(tokenizer)
    # Everything that can fail on its own is done first; the weights are written aside and renamed into place once
    # all are written, so an export cut short leaves no partial file beside (or shadowing) the checkpoint there.
    shards = _Shards(directory, limit)
    try:
        config, embedding_dtype = _add_tensors(shards, state.items() if isinstance(state, Mapping) else state,
                                               config, dtype)
        names = shards.publish()
    finally:
        shards.discard()
    config_dict = hf_config_dict(config, dtype or embedding_dtype)
    # A checkpoint's own keys as it has them (transformers reads a missing one as it read the checkpoint); a model
    # built here writes null for an id no tokenizer gives, never Llama 2's defaults.
    config_dict.update((key, carried.get(key)) for key in CARRIED_CONFIG_KEYS if source is None or key in carried)
    replace_durably(directory / CONFIG_FILE, lambda path: path.write_text(json.dumps(config_dict, indent=2) + "\n"))
    if source is None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(os.fspath(directory))
    if source is not None:
        source = Path(source).expanduser()
        for name in CARRIED_FILES:
            carried_file, target = source / name, directory / name
            if carried_file.is_file() and not (target.exists() and target.samefile(carried_file)):
                shutil.copyfile(carried_file, target)
        _remove_other_tokenizer_files(directory, source)
    _remove_replaced(previous, names, directory)


def _token_ids(tokenizer: Any) -> dict[str, Any]:
    """The special tokens' ids of a Hugging Face ``tokenizer`` (none for another kind, or none given)."""
    if not hasattr(tokenizer, "save_pretrained"):
        return {}
    return {key: getattr(tokenizer, key, None) for key in CARRIED_CONFIG_KEYS}


def _add_tensors(shards: _Shards, pairs: Iterable[tuple[str, torch.Tensor]], config: LlamaConfig,
                 dtype: Optional[torch.dtype]) -> tuple[LlamaConfig, torch.dtype]:
    """Add every exported tensor to ``shards``; the config as written (untied where a tied model's head differs
    from its embedding) and the exported embedding's dtype. A tied model's head waits for the comparison."""
    embedding: Optional[torch.Tensor] = None
    head: Optional[torch.Tensor] = None
    embedding_dtype = dtype
    for name, tensor in pairs:
        hf = hf_name(name)
        if hf == _HEAD and config.tie_embeddings:
            head = tensor
            continue
        if hf == _EMBEDDING:
            embedding = tensor if config.tie_embeddings else None
        exported = exported_tensor(hf, tensor, config, dtype)
        if hf == _EMBEDDING:
            embedding_dtype = exported.dtype
        shards.add(hf, exported)
    if embedding_dtype is None:
        raise ValueError(f"No {_EMBEDDING} among the tensors to export: is this a Llama?")
    if head is not None and (embedding is None or not torch.equal(head, embedding)):
        config = dataclasses.replace(config, tie_embeddings=False)
        shards.add(_HEAD, exported_tensor(_HEAD, head, config, dtype))
    return config, embedding_dtype


def _remove_other_tokenizer_files(directory: Path, source: Path) -> None:
    """Remove the tokenizer and generation files in ``directory`` that ``source`` lacks, saying so: another model's
    (an earlier export there), which transformers would read beside, or instead of, the carried ones (it prefers a
    ``tokenizer.json`` to a carried ``tokenizer.model``)."""
    stale = [name for name in TOKENIZER_AND_GENERATION_FILES
             if (directory / name).is_file() and not (source / name).is_file()]
    for name in stale:
        (directory / name).unlink()
    if stale:
        warnings.warn(f"{directory} held {', '.join(stale)}, which {source} does not have: another model's, removed so"
                      " that the export's tokenizer is its checkpoint's.", stacklevel=4)


def _previous_weights(directory: Path) -> list[Path]:
    """The weights already in ``directory``: ``model.safetensors``, the index of a sharded checkpoint and the shards
    it names there; read before anything is written, so a malformed index stops the export first."""
    single, index = directory / WEIGHTS_FILE, directory / WEIGHTS_INDEX_FILE
    previous = [single] if single.is_file() else []
    if not index.is_file():
        return previous
    try:
        names = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{index} is not a safetensors index, and the export's weights would sit beside it: export"
                         " into another directory, or remove it.") from error
    # Normalised, not resolved: "./x" and "x" are one shard, and a shard that is a link is removed as a link.
    shards = {Path(os.path.normpath(directory / name)) for name in names if isinstance(name, str)}
    folder = Path(os.path.normpath(directory))
    inside = sorted(shard for shard in shards if shard.parent == folder and shard.name != WEIGHTS_FILE)
    return [*previous, index, *inside]


def _remove_replaced(previous: list[Path], written: list[str], directory: Path) -> None:
    """Remove the earlier weights that the export did not overwrite (after its files are all written), saying so
    where they were a sharded checkpoint's."""
    index = directory / WEIGHTS_INDEX_FILE
    stale = [path for path in previous if path.name not in written and not (path == index and len(written) > 1)]
    for path in stale:
        if path.is_file() or path.is_symlink():
            path.unlink(missing_ok=True)
    if index in previous:
        shards = len([path for path in previous if path.name not in (WEIGHTS_FILE, WEIGHTS_INDEX_FILE)])
        files = written[0] if len(written) == 1 else f"{len(written)} shards"
        warnings.warn(f"{directory} held a sharded checkpoint: its index and {shards} shards were removed or"
                      f" overwritten, replaced by the export's {files}.", stacklevel=3)


#: Where the LoRA updates merged into an export narrower than fp32 keep this relative error or more, it is warned
#: about: a fine-tune whose changes are small against the base weights loses them to the rounding.
LOST_UPDATE_WARNING = 0.1


@torch.no_grad()
def save_pretrained(model: nn.Module, directory: PathLike, dtype: Optional[torch.dtype] = None,
                    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE, tokenizer: Any = None) -> None:
    """Write ``model`` (a `Llama`, possibly FSDP2-sharded, possibly with LoRA adapters, which are merged into their
    base weights) as a Hugging Face Llama directory that ``transformers.AutoModelForCausalLM.from_pretrained``
    loads, in weights files of at most ``max_shard_size`` (bytes, or e.g. ``"5GB"``). A model loaded by
    `load_model` carries its checkpoint's tokenizer, generation defaults and special tokens' ids into the export
    (`write_pretrained`), and ``dtype`` defaults to the checkpoint's (a bf16 checkpoint trained in fp32 is exported
    in bf16); otherwise to the parameters', and a Hugging Face ``tokenizer`` given (the one it was trained with)
    is saved with it.

    Sharded parameters are gathered one at a time to the CPU, a collective: with more than one process every rank
    calls this, only rank 0 keeps the gathered tensors (one shard's at a time) and writes them, and all return once
    the files are complete (or all raise, if rank 0 could not write them).
    """
    shard_bytes(max_shard_size)  # a bad size is refused on every rank, before any collective
    source = getattr(model, "source_directory", None)
    if source is not None and not is_model_directory(source):
        warnings.warn(f"The checkpoint {source} that the model was loaded from is gone: the export in {directory}"
                      " has no tokenizer, generation defaults or special tokens' ids from it.", stacklevel=2)
        source = None
    if dtype is None and source is not None:
        dtype = checkpoint_dtype(source)
    distributed = world_size() > 1
    writer = not distributed or dist.get_rank() == 0
    narrower = dtype is not None and dtype.itemsize < 4 and dtype.is_floating_point
    updates = MergedUpdates(dtype) if narrower and writer else None  # type: ignore[arg-type]
    tensors = merged_tensors(model, keep=writer, updates=updates)
    failure: Optional[Exception] = None
    if writer:
        try:
            write_pretrained(tensors, model.config, directory, dtype, source, max_shard_size, tokenizer)
        except Exception as error:
            if not distributed:
                raise
            failure = error
    for _ in tensors:  # the gathers this rank still owes the others (all of them where it writes nothing)
        pass
    if updates is not None and failure is None and updates.relative_error > LOST_UPDATE_WARNING:
        warnings.warn(
            f"The {str(dtype).removeprefix('torch.')} export in {directory} keeps the merged LoRA updates with a"
            f" relative error of {updates.relative_error:.0%}: much of them lies below the base weights' resolution"
            " in that dtype and rounds away. Export in float32 to keep them (save_pretrained(..., dtype=torch.float32);"
            " longshield-train --export_dtype float32).", stacklevel=2)
    if distributed:  # every rank learns whether rank 0 wrote the files: none is left waiting for it
        reported = all_gathered(None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        if reported[0] is not None:
            raise RuntimeError(f"The export to {directory} failed on rank 0 ({reported[0]}).")
