"""A compact Llama-3 decoder: token embedding, pre-norm blocks (GQA attention with RoPE, SwiGLU MLP), RMSNorm, head.

Parallelism (context-parallel attention, FSDP, activation checkpointing) is applied from outside the model: the
attention kernel is the replaceable `Attention.attention_fn`, and blocks live in `Llama.layers`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_longshield.models.config import LlamaConfig
from lightning_longshield.models.rope import apply_rope, rope_angles, rope_inverse_frequencies

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: Optional[torch.Tensor]
) -> torch.Tensor:
    """Causal SDPA of q (B, H, T, head_dim) over k, v (B, H_kv, T, head_dim), H a multiple of H_kv (GQA): each token
    attends to the tokens before it in the sequence, as under context parallelism. ``position_ids`` only place the
    rotary embeddings: a mask that compared positions would let a token see later ones whose positions restart (packed
    documents) and would build a T x T tensor."""
    del position_ids  # the rotary embeddings already carry the positions
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings.

    ``attention_fn(q, k, v, position_ids)`` receives K/V with their ``n_kv_heads`` heads (not repeated to the query
    heads), so a context-parallel attention gathers only those.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        self.attention_fn: AttentionFn = causal_attention

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], position_ids: Optional[torch.Tensor]
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = self.attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), position_ids)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], position_ids: Optional[torch.Tensor]
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, position_ids)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Llama-3 decoder returning logits (B, T, vocab_size).

    ``position_ids`` (B, T), or (T,) / (1, T) shared by the samples, are the tokens' global positions; they place the
    rotary embeddings (RoPE) only, so a shard of a sequence is processed with its true positions. ``None`` means
    ``0 .. T-1``. Attention is causal by token order whatever the positions (packed documents whose positions restart
    still see only earlier tokens); ``attention_fn`` receives them too, which context-parallel attention requires as
    the mark of a call on a shard.

    With ``load_weights`` set, `init_weights` calls ``load_weights(model)`` instead of drawing random weights, so a
    checkpoint reader can fill a meta-device model as it is materialised, each shard with only its part.
    """

    #: Called by `init_weights` with the model, instead of the random initialisation, when set.
    load_weights: Optional[Callable[[Llama], None]] = None
    #: The Hugging Face directory the model was loaded from, if any (`lightning_longshield.hf.load_model`).
    source_directory: Optional[str] = None

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """``load_weights(self)`` when set; otherwise TorchTitan-style init: N(0, 0.02) inputs, depth-scaled output
        projections, unit norms."""
        if self.load_weights is not None:
            self.load_weights(self)
            return
        nn.init.normal_(self.tok_embeddings.weight, std=1.0 if not self.config.tie_embeddings else 0.02)
        depth_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for block in self.layers:
            for linear in (block.attention.wq, block.attention.wk, block.attention.wv, block.feed_forward.w1):
                nn.init.trunc_normal_(linear.weight, std=0.02)
            for linear in (block.attention.wo, block.feed_forward.w2, block.feed_forward.w3):
                nn.init.trunc_normal_(linear.weight, std=depth_std)
            block.attention_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        if not self.config.tie_embeddings:
            bound = self.config.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, std=bound, a=-3 * bound, b=3 * bound)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        head: Optional[Callable[[torch.Tensor, nn.Module], torch.Tensor]] = None,
    ) -> torch.Tensor:
        """Logits (B, T, vocab_size), or ``head(hidden states, output layer)`` when given (e.g. a loss that applies
        the output layer chunk by chunk), inside this forward so that sharded parameters are gathered for it."""
        hidden = self.hidden_states(input_ids, position_ids)
        return self.output(hidden) if head is None else head(hidden, self.output)

    def hidden_states(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The normalised last hidden states (B, T, dim): what the output layer turns into logits."""
        batch, seq = input_ids.shape
        if position_ids is not None:
            position_ids = position_ids.expand(batch, seq)  # (T,) or (1, T): shared by the samples
        positions = position_ids
        if positions is None:
            positions = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        inv_freq = rope_inverse_frequencies(
            self.config.head_dim, self.config.rope_theta, self.config.rope_scaling, device=input_ids.device
        )
        rope = rope_angles(positions, inv_freq)
        h = self.tok_embeddings(input_ids)
        for block in self.layers:
            h = block(h, rope, position_ids)
        return self.norm(h)
