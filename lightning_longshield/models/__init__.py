"""A compact Llama-3 (GQA, RoPE with Llama-3 scaling, SwiGLU, RMSNorm) and its configuration presets."""

from lightning_longshield.models.config import LlamaConfig
from lightning_longshield.models.llama import Llama

__all__ = ["Llama", "LlamaConfig"]
