"""The model spec with its presets, and hardware specs, as plain data (importable without torch).

`lightning_longshield.models.LlamaConfig` is `ModelSpec` and reads the presets from here, so the model that trains
and the model that is simulated can never drift apart.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency-dependent RoPE scaling (identity when ``factor == 1``)."""

    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


@dataclass(frozen=True)
class Linear:
    """A trainable matrix ``in_features x out_features`` (per block, or in the head)."""

    name: str
    in_features: int
    out_features: int

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features

    def lora_numel(self, rank: int) -> int:
        """Parameters of a LoRA adapter of ``rank`` on this matrix (``A``: in x r, ``B``: r x out)."""
        return rank * (self.in_features + self.out_features)


@dataclass(frozen=True)
class ModelSpec:
    """The one description of a Llama-3 family decoder: shapes, RoPE, and the parameter layout derived from them.

    ``lightning_longshield.models.LlamaConfig`` is this class (plus preset helpers) and ``Llama`` is built from it;
    every ``simulate`` module counts from it, and a test compares the counts with the real module's.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # e.g. from a checkpoint's hyper-parameters
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: every size of a model must be a positive integer.")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}.")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}.")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings.")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the K and V projections (``n_kv_heads`` heads)."""
        return self.n_kv_heads * self.head_dim

    def block_linears(self) -> list[Linear]:
        """The seven projections of one transformer block."""
        d, kv, f = self.dim, self.kv_dim, self.ffn_dim
        return [Linear("wq", d, d), Linear("wk", d, kv), Linear("wv", d, kv), Linear("wo", d, d),
                Linear("w1", d, f), Linear("w3", d, f), Linear("w2", f, d)]

    def head_linears(self) -> list[Linear]:
        """The output projection (the embedding is a lookup, not a matmul)."""
        return [Linear("output", self.dim, self.vocab_size)]

    @property
    def block_numel(self) -> int:
        """Parameters of one block, its two RMSNorm weights included."""
        return sum(lin.numel for lin in self.block_linears()) + 2 * self.dim

    @property
    def embedding_numel(self) -> int:
        """Parameters of the token embedding (and of the output projection, the same shape)."""
        return self.vocab_size * self.dim

    @property
    def root_numel(self) -> int:
        """Parameters outside the blocks (FSDP's root group): embedding, final norm, untied output."""
        return self.embedding_numel * (1 if self.tie_embeddings else 2) + self.dim

    @property
    def num_parameters(self) -> int:
        """Trainable parameter count (a tied embedding counted once)."""
        return self.n_layers * self.block_numel + self.root_numel


#: The projections LoRA adapts by default: every linear layer of every block.
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
#: The adapter rank of `LoraOptions` when none is given.
DEFAULT_LORA_RANK = 8


def lora_numel(spec: ModelSpec, rank: int, target_modules: tuple[str, ...] | list[str] = LORA_TARGETS) -> int:
    """Parameters of LoRA adapters of ``rank`` on the named linear layers of every block and the head."""
    targets = set(target_modules)
    per_block = sum(lin.lora_numel(rank) for lin in spec.block_linears() if lin.name in targets)
    head = sum(lin.lora_numel(rank) for lin in spec.head_linears() if lin.name in targets)
    return spec.n_layers * per_block + head


@dataclass(frozen=True)
class TrainableParams:
    """The parameters that take gradients: per block, in the (tied or untied) embedding/head weight of
    ``vocab_size x dim``, the largest single tensor of a block, and in all; ``linear_weights`` of them are the weights
    of linear layers used once (the fused per-layer kernels' share), ``largest_other_in_block`` the largest block
    tensor that is not one."""

    block: int
    embedding: int
    largest_in_block: int
    total: int
    linear_weights: int
    largest_other_in_block: int


def trainable_params(spec: ModelSpec, lora_rank: int = 0) -> TrainableParams:
    """Everything (``lora_rank=0``), or LoRA adapters of ``lora_rank`` on every block projection (`LORA_TARGETS`)."""
    if lora_rank == 0:
        linears = [lin.numel for lin in spec.block_linears()]
        untied_head = 0 if spec.tie_embeddings else spec.embedding_numel
        return TrainableParams(spec.block_numel, spec.embedding_numel, max(linears), spec.num_parameters,
                               linear_weights=spec.n_layers * sum(linears) + untied_head,
                               largest_other_in_block=spec.dim)  # the RMSNorm weights
    adapters = [lin for lin in spec.block_linears() if lin.name in LORA_TARGETS]
    total = lora_numel(spec, lora_rank)
    return TrainableParams(
        block=sum(lin.lora_numel(lora_rank) for lin in adapters),
        embedding=0,
        largest_in_block=max(lora_rank * max(lin.in_features, lin.out_features) for lin in adapters),
        total=total,
        linear_weights=total,  # every adapter is a linear layer
        largest_other_in_block=0,
    )


_LLAMA_3_1_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
_LLAMA_3_2_ROPE = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)

MODEL_PRESETS: dict[str, ModelSpec] = {
    # A CPU-friendly model (about 3.3M parameters) over a byte-level vocabulary.
    "tiny": ModelSpec(
        vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=4096,
        rope_theta=10000.0, tie_embeddings=False,
    ),
    "llama3.2-1b": ModelSpec(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, max_seq_len=131072,
        tie_embeddings=True, rope_scaling=_LLAMA_3_2_ROPE,
    ),
    "llama3.2-3b": ModelSpec(
        vocab_size=128256, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, max_seq_len=131072,
        tie_embeddings=True, rope_scaling=_LLAMA_3_2_ROPE,
    ),
    "llama3.1-8b": ModelSpec(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, max_seq_len=131072,
        tie_embeddings=False, rope_scaling=_LLAMA_3_1_ROPE,
    ),
    "llama3.1-70b": ModelSpec(
        vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, max_seq_len=131072,
        tie_embeddings=False, rope_scaling=_LLAMA_3_1_ROPE,
    ),
}


def looks_like_path(name: str, presets: Iterable[str]) -> bool:
    """Whether a model name is meant as a folder: it holds a path separator, starts with ``.`` or ``~``, or exists
    and is no preset name."""
    return (any(sep in name for sep in {os.sep, os.altsep or os.sep, "/"}) or name.startswith((".", "~"))
            or (os.path.exists(name) and name not in presets))


def get_model_spec(name: str) -> ModelSpec:
    """Return the preset called ``name``, or the spec of the local Hugging Face Llama checkpoint folder ``name``
    (its ``config.json``, read with `simulate.hf_config`); anything else lists the valid presets."""
    if name in MODEL_PRESETS:
        return MODEL_PRESETS[name]
    if os.path.isdir(os.path.expanduser(name)):
        from simulate.hf_config import read_hf_config

        try:
            return read_hf_config(os.path.expanduser(name))
        except FileNotFoundError as err:
            raise ValueError(str(err)) from None
    if looks_like_path(name, MODEL_PRESETS):  # meant as a folder, relative to the working directory
        path = os.path.abspath(os.path.expanduser(name))
        found = "not a folder" if os.path.exists(path) else "no such folder"
        raise ValueError(
            f"No Hugging Face model directory at {path!r}: {found} (a relative path is read from the working"
            f" directory, {os.getcwd()!r}). Fetch it (the planner reads only its config.json: hf download <repo>"
            f" config.json --local-dir <folder>), or give a preset: {sorted(MODEL_PRESETS)}."
        )
    raise ValueError(
        f"Unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}, or give a local Hugging Face Llama"
        " checkpoint folder (one with a config.json)."
    )


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator type, as the analytic model sees it.

    ``memory_gib`` is the capacity the CUDA caching allocator can see (``torch.cuda.get_device_properties(i)
    .total_memory``, which TorchTitan logs as "CUDA capacity"), not the marketing number. Bandwidths are
    unidirectional per GPU in bytes/s; ``latency_s`` is the per-step latency (alpha) of an NCCL ring step.
    FLOP/s are dense tensor-core peaks (bf16, and TF32 for fp32 training), and ``fp32_flops`` the CUDA cores' fp32
    peak (IEEE fp32 products, which the fused per-layer clipping kernels use on fp32 inputs).
    """

    name: str
    memory_gib: float
    bf16_flops: float
    tf32_flops: float
    fp32_flops: float
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    intra_node_latency_s: float
    inter_node_latency_s: float
    gpus_per_node: int = 8

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30


GPU_PRESETS: dict[str, GPUSpec] = {
    # H100 SXM5 80GB: 989 TFLOP/s dense bf16 (67 fp32 on CUDA cores), 3.35 TB/s HBM3, NVLink 4 (900 GB/s
    # bidirectional), 400 Gb/s NIC/GPU.
    "h100": GPUSpec(
        name="NVIDIA H100 SXM 80GB", memory_gib=79.11, bf16_flops=989e12, tf32_flops=494e12, fp32_flops=67e12,
        hbm_bytes_per_s=3.35e12,
        intra_node_bytes_per_s=450e9, inter_node_bytes_per_s=50e9,
        intra_node_latency_s=10e-6, inter_node_latency_s=20e-6,
    ),
    # H200 SXM 141GB: same compute and NVLink as H100, 4.8 TB/s HBM3e.
    "h200": GPUSpec(
        name="NVIDIA H200 SXM 141GB", memory_gib=139.81, bf16_flops=989e12, tf32_flops=494e12, fp32_flops=67e12,
        hbm_bytes_per_s=4.8e12,
        intra_node_bytes_per_s=450e9, inter_node_bytes_per_s=50e9,
        intra_node_latency_s=10e-6, inter_node_latency_s=20e-6,
    ),
    # A100 SXM4: 312 TFLOP/s dense bf16 (19.5 fp32 on CUDA cores), NVLink 3 (600 GB/s bidirectional), 200 Gb/s HDR
    # NIC/GPU.
    "a100-80": GPUSpec(
        name="NVIDIA A100 SXM 80GB", memory_gib=79.15, bf16_flops=312e12, tf32_flops=156e12, fp32_flops=19.5e12,
        hbm_bytes_per_s=2.04e12,
        intra_node_bytes_per_s=300e9, inter_node_bytes_per_s=25e9,
        intra_node_latency_s=10e-6, inter_node_latency_s=20e-6,
    ),
    "a100-40": GPUSpec(
        name="NVIDIA A100 SXM 40GB", memory_gib=39.39, bf16_flops=312e12, tf32_flops=156e12, fp32_flops=19.5e12,
        hbm_bytes_per_s=1.56e12,
        intra_node_bytes_per_s=300e9, inter_node_bytes_per_s=25e9,
        intra_node_latency_s=10e-6, inter_node_latency_s=20e-6,
    ),
}


def get_gpu_spec(name: str) -> GPUSpec:
    """Return the GPU preset called ``name``; unknown names list the valid ones."""
    try:
        return GPU_PRESETS[name]
    except KeyError:
        raise ValueError(f"Unknown GPU {name!r}; choose one of {sorted(GPU_PRESETS)}.") from None
