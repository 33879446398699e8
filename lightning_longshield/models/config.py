"""`LlamaConfig`: the dimensions of a Llama-3 decoder, with presets shared with `simulate/`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from simulate.specs import MODEL_PRESETS, RopeScaling, get_model_spec


@dataclass
class LlamaConfig:
    """Hyper-parameters of `Llama`.

    `from_name` builds one from a preset (``"tiny"``, ``"llama3.2-1b"``, ``"llama3.2-3b"``, ``"llama3.1-8b"``,
    ``"llama3.1-70b"``); keyword overrides replace single fields.
    """

    vocab_size: int = 256
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 768
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}.")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}.")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings.")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> LlamaConfig:
        """Build the preset called ``name`` (see ``simulate.specs.MODEL_PRESETS``), then apply ``overrides``."""
        spec = get_model_spec(name)
        config = cls(**{f: getattr(spec, f) for f in cls.__dataclass_fields__})
        return replace(config, **overrides) if overrides else config

    @staticmethod
    def preset_names() -> list[str]:
        return sorted(MODEL_PRESETS)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
