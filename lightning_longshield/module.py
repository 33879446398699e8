"""`CausalLMModule`: a ready LightningModule that trains a `Llama` with the causal-LM loss."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any, Literal, Optional, Union

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_longshield import hf
from lightning_longshield.context_parallel.mesh import CONTEXT_PARALLEL
from lightning_longshield.lora import LoraOptions, apply_lora, reset_adapters
from lightning_longshield.loss import IGNORE_INDEX, chunked_token_loss_sums, loss_divisors, token_loss_sums
from lightning_longshield.models import Llama, LlamaConfig
from lightning_longshield.text_data import ByteTokenizer
from lightning_longshield.token_perplexity import TokenPerplexity
from simulate.loss_chunks import LossChunking, check_loss_chunking, resolve_loss_chunk_tokens
from simulate.specs import looks_like_path

OPTIMIZERS = ("adamw", "sgd")

# `CausalLMModule.on_before_batch_transfer` checks every batch, also when the data comes from a data module; Lightning
# says on every such run that the module's hook is the one used, which is the intent.
warnings.filterwarnings("ignore", "You have overridden `on_before_batch_transfer` in `LightningModule` but have passed")


def check_batch(batch: Any, vocab_size: Optional[int]) -> None:
    """Reject a batch that would crash deep inside torch: missing keys, mismatched shapes, ids outside the vocab
    (``vocab_size=None`` skips the range checks).

    The errors say what is wrong without quoting values of the batch (its ids, their range, its size or sequence
    length): the batch is a sample of the private data, and error messages end up in logs."""
    input_ids, labels, _, _ = unpack_batch(batch)
    if input_ids.shape != labels.shape or input_ids.dim() != 2:
        found = ("labels differ in shape from input_ids" if input_ids.dim() == labels.dim() == 2
                 else f"got a {input_ids.dim()}-D input_ids and a {labels.dim()}-D labels")
        raise ValueError(
            f"labels must have the shape of input_ids, (batch, T); {found}. Shift labels without dropping a position:"
            " labels[t] is the token after input_ids[t], and the last position (or any) can be -100."
        )
    if input_ids.dtype.is_floating_point or labels.dtype.is_floating_point:
        raise ValueError(f"input_ids and labels must be integer tensors; got {input_ids.dtype} and {labels.dtype}.")
    if labels.dtype != torch.int64:  # uint8 would pass cross-entropy, but holds no -100 to ignore a position
        raise ValueError(f"labels must be int64 (cross-entropy takes no other integer targets); got {labels.dtype}:"
                         " pass labels.long().")
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] > 1 and (mask[:, 1:] > mask[:, :-1]).any():
        raise ValueError(
            "attention_mask marks padding before a sample's tokens (left padding) or inside them: the model takes no"
            " attention mask, so such padding would be attended to and shift positions (and a sample's loss would"
            " depend on the others in its batch). Pad after each sample's tokens (padding_side='right'), with labels"
            " -100 there."
        )
    if input_ids.numel() == 0 or vocab_size is None:
        return
    if input_ids.min() < 0 or input_ids.max() >= vocab_size:
        raise ValueError(
            f"input_ids hold token ids outside [0, vocab_size) with the model's vocab_size {vocab_size}: use a"
            " tokenizer that matches the model, or a config with a larger vocab_size."
        )
    labelled = labels[labels != IGNORE_INDEX]
    if labelled.numel() and (labelled.min() < 0 or labelled.max() >= vocab_size):
        raise ValueError(
            f"labels hold ids outside [0, vocab_size) with the model's vocab_size {vocab_size} (only {IGNORE_INDEX}"
            " may lie outside, to ignore a position)."
        )


def resolve_model_config(
    config: Union[LlamaConfig, str, os.PathLike, Mapping[str, Any]],
) -> tuple[LlamaConfig, Optional[str]]:
    """``(LlamaConfig, Hugging Face directory or None)`` of a `CausalLMModule` ``config``.

    A Hugging Face model directory (with a ``config.json``) is read. Otherwise a path-like, or a string that looks
    like a path (it holds a path separator, starts with ``.`` or ``~``, or exists and is no preset name), is refused
    as a missing model directory, and any other string must be a preset name.
    """
    if isinstance(config, LlamaConfig):
        return config, None
    if isinstance(config, Mapping):  # as saved in a checkpoint's hyper-parameters
        return LlamaConfig(**config), None
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(
            f"config must be a LlamaConfig, a preset name, a Hugging Face model directory or a dict of LlamaConfig"
            f" fields; got {type(config).__name__}."
        )
    text = os.fspath(config)
    presets = LlamaConfig.preset_names()
    if not isinstance(config, str) or looks_like_path(text, presets) or hf.is_model_directory(text):
        directory = os.path.expanduser(text)
        config = hf.read_config(directory)  # a FileNotFoundError that says what is missing
        hf.check_weights(directory)  # now, not after the data is tokenized
        return config, directory
    if text not in presets:
        raise ValueError(
            f"Unknown model preset {text!r}: choose one of {presets}, or pass the path of a local Hugging Face model"
            " directory (holding config.json)."
        )
    return LlamaConfig.from_name(text), None


def lora_options(lora: Union[LoraOptions, Mapping[str, Any], None]) -> Optional[LoraOptions]:
    """A `LoraOptions` from itself, a mapping of its fields (unknown keys refused, naming the valid ones), or None."""
    if lora is None or isinstance(lora, LoraOptions):
        return lora
    if isinstance(lora, Mapping):
        return LoraOptions.from_mapping(lora)
    raise TypeError(f"lora must be a LoraOptions, a dict of its fields or None; got {type(lora).__name__}.")


def unpack_batch(
    batch: Any,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(input_ids, labels, position_ids, token_counts)`` of a batch dict; a clear error for a missing key.

    ``position_ids`` and ``token_counts`` (labelled tokens per sample over the whole sequence) are present when the
    strategy has sharded the sequence over a context-parallel group.
    """
    if not isinstance(batch, Mapping) or "input_ids" not in batch or "labels" not in batch:
        keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(
            f"A batch must be a dict with 'input_ids' and 'labels' (labels[t] is the token after input_ids[t], -100"
            f" to ignore); got {keys}. Build samples as {{'input_ids': LongTensor[T], 'labels': LongTensor[T]}}."
        )
    return batch["input_ids"], batch["labels"], batch.get("position_ids"), batch.get("token_counts")


#: Where a checkpoint keeps `CausalLMModule.trained_positions`.
TRAINED_POSITIONS_KEY = "longshield_trained_positions"


class CausalLMModule(L.LightningModule):
    """Trains `Llama` on batches ``{"input_ids", "labels"}`` with the per-sample-mean token loss.

    ``config`` is a `LlamaConfig`, a preset name or a local Hugging Face Llama directory (a string or path-like; its
    weights are loaded; under context parallelism each rank reads only its shards). The model is built in
    `configure_model` (so strategies can build it sharded); ``model`` is the `Llama`.
    The training loss is the mean over samples of each sample's mean token loss; clipping, noise and batch scaling
    belong to the strategy. Validation logs ``val_loss`` and ``val_perplexity``, testing ``test_loss`` and
    ``test_perplexity``; prediction returns the logits. Every batch is checked (shapes,
    token ids within ``vocab_size``) on the host before it moves to the device.

    ``lora`` (a `LoraOptions`) injects PEFT LoRA adapters and freezes the rest of the model: only the adapters are
    trained, clipped and noised.

    ``loss_chunk_tokens``: the loss (training and validation) runs the output head and the fp32 cross-entropy over
    chunks of that many positions (`chunked_token_loss_sums`), so the whole ``(B, T, vocab)`` logits never exist
    (``norms="ghost"`` and projected norms still keep the head's output gradients, as large, for its norms); the
    loss, its gradients and every clipping path's per-sample gradients are those of the whole logits (in bf16, to a
    rounding that grows with the chunks: the head's per-sample gradient is summed over them in bf16). ``"auto"`` (the
    default) chunks where the whole logits' fp32 working set (12 bytes a logit) would pass 1 GiB, with chunks sized by
    `simulate.loss_chunks.auto_loss_chunk_tokens`; ``None`` never chunks.

    ``log_train_loss=True`` also logs ``train_loss``, the loss of each sampled micro-batch. It is computed without
    noise from the private training data (at one sample per micro-batch it is one record's loss), so it is NOT
    covered by the privacy guarantee: off by default, and a warning says so when on.
    """

    #: ``training_step`` returns the mean over the micro-batch's samples of each sample's loss (the contract
    #: `LongShieldStrategy` relies on for a scalar loss).
    per_sample_mean_loss = True

    def __init__(
        self,
        config: Union[LlamaConfig, str, os.PathLike, Mapping[str, Any]] = "tiny",
        optimizer: Literal["adamw", "sgd"] = "adamw",
        learning_rate: float = 3e-4,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        log_train_loss: bool = False,
        lora: Optional[Union[LoraOptions, Mapping[str, Any]]] = None,
        loss_chunk_tokens: LossChunking = "auto",
    ) -> None:
        super().__init__()
        check_loss_chunking(loss_chunk_tokens)
        self.loss_chunk_tokens = loss_chunk_tokens
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} is not supported; choose one of {OPTIMIZERS}.")
        self.config, self.pretrained_directory = resolve_model_config(config)
        self.optimizer_name = optimizer
        self.learning_rate = learning_rate
        self.weight_decay = weight_decay
        if momentum and optimizer != "sgd":
            raise ValueError(f"momentum={momentum} is SGD's; AdamW keeps its own moments. Use optimizer='sgd' or drop"
                             " momentum.")
        self.momentum = momentum
        self.log_train_loss = log_train_loss
        self.lora = lora_options(lora)
        if log_train_loss:
            rank_zero_warn(
                "log_train_loss=True: train_loss is the un-noised loss of each sampled batch of private data; it is"
                " not covered by the differential-privacy guarantee. Monitor val_loss on held-out data instead."
            )
        self.save_hyperparameters({"config": self.pretrained_directory or self.config.to_dict(), "optimizer": optimizer,
                                   "learning_rate": learning_rate, "weight_decay": weight_decay, "momentum": momentum,
                                   "log_train_loss": log_train_loss,
                                   "lora": None if self.lora is None else asdict(self.lora),
                                   "loss_chunk_tokens": loss_chunk_tokens})
        self.model: Optional[Llama] = None
        #: The positions a fit trained beyond the config's ``max_seq_len`` (the data module's public ``seq_len``),
        #: declared by `save_pretrained` as ``max_position_embeddings``; kept in checkpoints and brought back from
        #: spawned processes. Set it where weights come from a ``state_dict`` alone.
        self.trained_positions: Optional[int] = None
        self.val_perplexity = TokenPerplexity()
        self.test_perplexity = TokenPerplexity()

    def setup(self, stage: str) -> None:
        """Refuse data whose tokenizer has more tokens than the model's embedding (the data module's `check_vocab`),
        and byte-level data for a pretrained checkpoint, whose token ids mean other things."""
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if self.pretrained_directory is not None and isinstance(getattr(datamodule, "tokenizer", None), ByteTokenizer):
            raise ValueError(
                f"The model is the pretrained checkpoint {self.pretrained_directory}, but the data module encodes"
                " text as UTF-8 bytes (ByteTokenizer): byte values would be trained as the checkpoint's token ids."
                " Encode the data with the checkpoint's tokenizer: LocalTextDataModule(files,"
                f" tokenizer='{self.pretrained_directory}') (longshield-train takes the model directory's tokenizer"
                " when --data.init_args.tokenizer is not set)."
            )
        check_vocab = getattr(datamodule, "check_vocab", None)
        if callable(check_vocab):
            check_vocab(self.config.vocab_size)
        seq_len = getattr(datamodule, "seq_len", None)  # a public setting of the library's data modules
        if stage == "fit" and isinstance(seq_len, int) and seq_len > self.config.max_seq_len:
            self.trained_positions = seq_len
            if self.pretrained_directory is not None:
                rank_zero_warn(
                    f"The data's seq_len {seq_len} is beyond the checkpoint's max_position_embeddings"
                    f" ({self.config.max_seq_len}): positions past it were not pretrained, and a model whose RoPE was"
                    " not scaled for the length may train worse there. An export declares max_position_embeddings"
                    f" {seq_len}, the length trained."
                )

    def configure_model(self) -> None:
        """Build the `Llama` (on the meta device under context parallelism), from the Hugging Face checkpoint if
        ``config`` named one, and inject its LoRA adapters, if any."""
        if self.model is None:
            if self.pretrained_directory is None:
                model = Llama(self.config)
            else:  # on the meta device the weights are read later, each rank its own shards
                model = hf.load_model(self.pretrained_directory, device=torch.get_default_device())
            if self.lora is not None:
                apply_lora(model, self.lora)
            self.model = model

    def initialize_materialized(self) -> None:
        """After a meta-device model's shards are allocated and the model's ``init_weights`` ran: initialise the LoRA
        adapters as PEFT does (A random, B zero). The strategy calls it; the model knows nothing of LoRA."""
        if self.lora is not None and self.model is not None:
            reset_adapters(self.model)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep `trained_positions` with the weights, for an export from the checkpoint."""
        if self.trained_positions is not None:
            checkpoint[TRAINED_POSITIONS_KEY] = self.trained_positions

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.trained_positions = checkpoint.get(TRAINED_POSITIONS_KEY, self.trained_positions)

    def save_pretrained(self, directory: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None,
                        max_shard_size: Union[int, str] = hf.DEFAULT_MAX_SHARD_SIZE, tokenizer: Any = None) -> None:
        """Write the model (LoRA adapters merged) as a Hugging Face Llama directory, in safetensors files of at most
        ``max_shard_size``; a collective under FSDP2. Its ``max_position_embeddings`` is the config's, or the length
        a fit trained where that is longer (`trained_positions`). ``tokenizer``: the Hugging Face tokenizer it was
        trained with, saved beside it where the model was not loaded from a checkpoint (whose own is carried)."""
        assert self.model is not None, "call configure_model() first"
        if self.trained_positions is not None and self.trained_positions > self.model.config.max_seq_len:
            self.model.config = replace(self.model.config, max_seq_len=self.trained_positions)
        hf.save_pretrained(self.model, directory, dtype, max_shard_size, tokenizer)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        assert self.model is not None, "call configure_model() first"
        return self.model(input_ids, position_ids)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        embeddings = getattr(self.model, "tok_embeddings", None)
        check_batch(batch, embeddings.num_embeddings if isinstance(embeddings, torch.nn.Embedding) else None)
        return batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, labels, position_ids, token_counts = unpack_batch(batch)
        loss = (self._token_loss_sums(input_ids, labels, position_ids) / loss_divisors(labels, token_counts)).mean()
        if self.log_train_loss:
            self.log("train_loss", self._whole_sequence(loss), prog_bar=True, batch_size=input_ids.shape[0])
        return loss

    def _token_loss_sums(self, input_ids: torch.Tensor, labels: torch.Tensor,
                         position_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """Each sample's summed token cross-entropy (B,), whole or by chunks (``loss_chunk_tokens``)."""
        assert self.model is not None, "call configure_model() first"
        batch, positions = input_ids.shape
        head = getattr(self.model, "output", None)
        head = getattr(head, "base_layer", head)  # a LoRA-adapted head (PEFT's lora.Linear) wraps the nn.Linear
        chunk = None
        if isinstance(head, torch.nn.Linear):  # a model of another kind computes its whole logits
            chunk = resolve_loss_chunk_tokens(self.loss_chunk_tokens, batch, positions, head.in_features,
                                              head.out_features)
        if chunk is None:
            return token_loss_sums(self(input_ids, position_ids), labels)

        def loss(hidden: torch.Tensor, output: torch.nn.Module) -> torch.Tensor:
            return chunked_token_loss_sums(hidden, output, labels, chunk)

        return self.model(input_ids, position_ids, head=loss)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_perplexity)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        """As `validation_step`, logging ``test_loss`` and ``test_perplexity``."""
        self._evaluate(batch, "test", self.test_perplexity)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The logits ``(B, T, vocab)`` of a batch's ``input_ids`` (a dict with that key, as the training batches, or
        the tensor itself)."""
        input_ids = batch["input_ids"] if isinstance(batch, Mapping) else batch
        if not isinstance(input_ids, torch.Tensor):
            raise ValueError("A predict batch is a LongTensor of token ids (B, T) or a dict with 'input_ids'; got"
                             f" {type(input_ids).__name__}.")
        return self(input_ids, batch.get("position_ids") if isinstance(batch, Mapping) else None)

    def _evaluate(self, batch: Any, stage: str, perplexity: TokenPerplexity) -> None:
        input_ids, labels, position_ids, token_counts = unpack_batch(batch)
        sums = self._token_loss_sums(input_ids, labels, position_ids)
        # The mean over the samples with a labelled token (over the whole sequence: the same on every CP rank); a
        # sample without one has no loss, where counting it as 0 would pull the mean down.
        counts = token_counts if token_counts is not None else (labels != IGNORE_INDEX).sum(dim=1)
        labelled = int((counts > 0).sum())
        loss = (sums / loss_divisors(labels, token_counts)).sum() / max(labelled, 1)
        # sync_dist: the mean over data-parallel groups (the CP ranks of a group already agree on the whole loss).
        # Logged by every rank for every batch (weight 0 without a labelled sample): the epoch's sync is a collective.
        self.log(f"{stage}_loss", self._whole_sequence(loss), batch_size=labelled, sync_dist=True)
        perplexity.update(sums.sum(), (labels != IGNORE_INDEX).sum())
        self.log(f"{stage}_perplexity", perplexity, prog_bar=True)

    def _whole_sequence(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss of whole sequences for logging: a shard's loss summed over the context-parallel group."""
        mesh = self.device_mesh
        if mesh is None or CONTEXT_PARALLEL not in (mesh.mesh_dim_names or ()):
            return loss.detach()
        context_parallel = mesh[CONTEXT_PARALLEL]
        if context_parallel.size() == 1:
            return loss.detach()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total, group=context_parallel.get_group())
        return total

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(params, lr=self.learning_rate, weight_decay=self.weight_decay,
                                   momentum=self.momentum)
        return torch.optim.AdamW(params, lr=self.learning_rate, weight_decay=self.weight_decay)
