"""A Hugging Face Llama ``config.json`` as a `ModelSpec` (``json`` only: no transformers, no torch).

`longshield-plan --model DIR` plans a local checkpoint folder with it, and `lightning_longshield.hf` reads a
checkpoint's configuration with it when the checkpoint loads: the model that is planned is the model that trains.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar, Union

from simulate.specs import ModelSpec, RopeScaling

CONFIG_FILE = "config.json"

#: transformers' `LlamaConfig` defaults, for the keys a ``config.json`` may leave out.
HF_LLAMA_DEFAULTS: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
    hidden_act="silu", attention_bias=False, mlp_bias=False,
)

#: The sizes of a ``config.json`` that must be positive integers.
HF_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings")

Spec = TypeVar("Spec", bound=ModelSpec)


def spec_from_hf_config(hf_config: Mapping[str, Any], spec_class: type[Spec] = ModelSpec) -> Spec:  # type: ignore[assignment]
    """The `ModelSpec` (or ``spec_class``, e.g. `LlamaConfig`) of a Hugging Face Llama ``config.json`` read as a
    dict; ValueError for what the Llama of this project lacks (another architecture, biases, another activation,
    another RoPE, a head size other than ``hidden_size // num_attention_heads``, pre-quantized weights).

    ``torch_dtype`` is not part of the shape: the training precision is chosen separately.
    """
    model_type, architectures = hf_config.get("model_type"), hf_config.get("architectures") or []
    # transformers builds the class of ``model_type``: another type (e.g. Mistral's sliding window) is not a Llama
    # whatever ``architectures`` says; the architectures decide only where the type is missing.
    if model_type != "llama" and (model_type is not None or "LlamaForCausalLM" not in architectures):
        raise ValueError(
            f"Found a checkpoint with model_type={model_type!r} and architectures={architectures}; only Llama"
            " checkpoints (model_type 'llama', LlamaForCausalLM) are supported."
        )
    quantization = hf_config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, Mapping) else "?"
        raise ValueError(
            f"The checkpoint is pre-quantized (quantization_config, quant_method {method!r}): its stored weights are"
            " not the model's parameters, and DP-SGD trains full-precision ones. Use the unquantized release of the"
            " model."
        )
    hf = {**HF_LLAMA_DEFAULTS, **{key: value for key, value in hf_config.items() if value is not None}}
    _check_sizes(hf)
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim", dim // heads) != dim // heads:
        raise ValueError(
            f"head_dim={hf['head_dim']} is not hidden_size // num_attention_heads = {dim // heads}; Llama derives"
            " its head size from hidden_size."
        )
    for flag in ("attention_bias", "mlp_bias"):
        if hf[flag]:
            raise ValueError(f"{flag}=True is not supported: Llama's projections have no biases.")
    if hf["hidden_act"] != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported: Llama's MLP is SwiGLU (silu).")
    rope_theta, rope_scaling = _rope_from_hf(hf)
    return spec_class(
        vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads", heads), ffn_dim=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"], rope_theta=rope_theta,
        norm_eps=_number(hf["rms_norm_eps"], "rms_norm_eps"),
        tie_embeddings=bool(hf["tie_word_embeddings"]), rope_scaling=rope_scaling,
    )


def _check_sizes(hf: Mapping[str, Any]) -> None:
    """Every size a positive integer, ``rope_scaling`` / ``rope_parameters`` a mapping or null: ValueError naming the
    key otherwise."""
    for key in HF_SIZES:
        value = hf.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r}: must be a positive integer.")
    for key in ("rope_scaling", "rope_parameters"):
        if not isinstance(hf.get(key) or {}, Mapping):
            raise ValueError(f"{key}={hf[key]!r}: must be a mapping (e.g. {{\"rope_type\": \"llama3\", ...}}) or null.")


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling]:
    """RoPE base and scaling as transformers reads them: ``rope_scaling`` where it is set (transformers 4, and 5 gives
    it priority over ``rope_parameters``), else ``rope_parameters``; the base from that mapping's ``rope_theta``,
    else the top-level one. ValueError naming the key of a value that is not a number."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(key) or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta_key = f"{key}.rope_theta" if params.get("rope_theta") is not None else "rope_theta"
    theta = _number(params.get("rope_theta") if theta_key != "rope_theta" else hf["rope_theta"], theta_key)
    if rope_type == "default":
        return theta, RopeScaling()
    if rope_type != "llama3":
        raise ValueError(
            f"RoPE type {rope_type!r} is not supported; Llama implements the default RoPE and Llama-3 scaling"
            " ('llama3')."
        )
    missing = [name for name in ("factor", "low_freq_factor", "high_freq_factor") if name not in params]
    if missing:
        raise ValueError(f"Llama-3 RoPE scaling {dict(params)} lacks {missing}.")
    factors = [_number(params[name], f"{key}.{name}") for name in ("factor", "low_freq_factor", "high_freq_factor")]
    original_key = (f"{key}.original_max_position_embeddings" if "original_max_position_embeddings" in params
                    else "original_max_position_embeddings" if "original_max_position_embeddings" in hf
                    else "max_position_embeddings")
    original = params.get("original_max_position_embeddings", hf.get("original_max_position_embeddings",
                                                                      hf["max_position_embeddings"]))
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ValueError(f"{original_key}={original!r}: must be a positive integer.")
    return theta, RopeScaling(*factors, original)


def _number(value: Any, key: str) -> float:
    """``value`` as a float; ValueError naming ``key`` where it is not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key}={value!r}: must be a number.")
    return float(value)


def read_hf_config(directory: Union[str, Path], spec_class: type[Spec] = ModelSpec) -> Spec:  # type: ignore[assignment]
    """The `ModelSpec` (or ``spec_class``) of the Hugging Face Llama checkpoint folder ``directory``; a ValueError
    names the file."""
    try:
        return spec_from_hf_config(read_config_json(directory), spec_class)
    except ValueError as err:
        path = Path(directory) / CONFIG_FILE
        message = str(err)
        raise ValueError(message if message.startswith(str(path)) else f"{path}: {message}") from None


def read_config_json(directory: Union[str, Path]) -> dict[str, Any]:
    """The JSON object of ``directory``'s config.json: FileNotFoundError or ValueError naming the file otherwise."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"No {CONFIG_FILE} in {directory}: expected a Hugging Face Llama checkpoint there.")
    try:
        hf_config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err.msg}, line {err.lineno}).") from None
    if not isinstance(hf_config, dict):
        raise ValueError(f"{path} holds no JSON object: expected a Hugging Face model configuration.")
    return hf_config
