"""A tiny random Hugging Face Llama with a BPE tokenizer trained on local text: a stand-in checkpoint for examples
and tests on machines that cannot download one."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from lightning_longshield.hf import require_hf

PAD, EOS = "<pad>", "<eos>"


def train_bpe_tokenizer(texts: Iterable[str], directory: str | Path, vocab_size: int = 512) -> Any:
    """Train a byte-level BPE tokenizer (with ``<pad>`` and ``<eos>``) on ``texts`` and save it in ``directory`` in
    the Hugging Face format (``AutoTokenizer.from_pretrained(directory)`` loads it); returns it."""
    tokenizers, transformers = require_hf("tokenizers"), require_hf("transformers")
    byte_level = tokenizers.pre_tokenizers.ByteLevel
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = byte_level(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, EOS],
                                             initial_alphabet=byte_level.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=PAD)
    wrapped.save_pretrained(directory)
    return wrapped


def write_demo_llama(
    directory: str | Path, texts: Iterable[str], vocab_size: int = 512, seed: int = 0, **sizes: Any
) -> Path:
    """A randomly initialised ``LlamaForCausalLM`` (default: 2 layers of width 64, GQA, Llama-3 RoPE scaling) with
    a tokenizer trained on ``texts``, saved in ``directory`` (safetensors); ``sizes`` override config fields."""
    transformers = require_hf("transformers")
    tokenizer = train_bpe_tokenizer(texts, directory, vocab_size)
    config = transformers.LlamaConfig(**{
        "vocab_size": len(tokenizer), "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 192, "max_position_embeddings": 4096,
        "tie_word_embeddings": True, "bos_token_id": None,  # the tokenizer has no start token
        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 512},
        **sizes,
    })
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return Path(directory)
