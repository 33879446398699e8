"""The Llama-3 decoder as the memory and FLOP models see it: its linear layers and, tensor by tensor, what
autograd saves for backward per token.

The counts mirror the shipped model (``lightning_longshield.models.llama``, TorchTitan's Llama 3) in eager
PyTorch with FSDP2 bf16 mixed precision:

* ``RMSNorm`` is ``torch.rms_norm``'s composite: it upcasts its input to fp32 (saved by ``pow``), saves the fp32
  ``rsqrt`` per token and the bf16 normalised tensor (saved by the multiply with the weight).
* Every ``nn.Linear`` saves its input; ``wq/wk/wv`` share one input and so do ``w1/w3``.
* RoPE's angles are recomputed from the positions in every forward; its cos/sin tables (per token, ``head_dim``
  wide, fp32) are shared by all blocks and not counted per block.
* Attention runs flash SDPA, which saves q, k, v, its output and the fp32 log-sum-exp. Under context parallelism
  the attention function all-gathers K/V with their ``n_kv_heads`` heads, then repeats them up to ``n_heads``, so
  the attention saves the *gathered, repeated* K/V: ``MBS x T`` tokens of width ``dim`` instead of the local
  ``MBS x T / N``. At CP size 1 K/V are counted repeated as well (an upper bound where SDPA's ``enable_gqa``
  keeps them at ``n_kv_heads``).
* ``wo`` saves the contiguous copy of the attention output, counted separately. Flash kernels that lay their
  output out as (B, T, H, D) (torch's CPU flash kernel; checked in ``tests/memory/test_model_spec_matches_module.py``)
  make that copy a view of the output, so the count is ``dim`` elements per token per block high there.
* SwiGLU saves ``w1``'s output (silu), the silu output and ``w3``'s output (the product) and the product
  (``w2``'s input).
"""

from __future__ import annotations

from dataclasses import dataclass

from simulate.specs import ModelSpec

FP32 = 4


@dataclass(frozen=True)
class SavedTensor:
    """One tensor autograd keeps alive from forward to backward.

    ``width`` elements per local token of ``dtype_bytes`` each; ``gathered`` tensors span the whole sequence
    (all CP ranks' tokens) rather than the local shard.
    """

    name: str
    width: int
    dtype_bytes: int
    gathered: bool = False

    def nbytes(self, local_tokens: float, cp_size: int) -> float:
        tokens = local_tokens * cp_size if self.gathered else local_tokens
        return tokens * self.width * self.dtype_bytes


def rms_norm_saved(prefix: str, m: ModelSpec, act: int) -> list[SavedTensor]:
    """``torch.rms_norm`` (composite): fp32 upcast input, fp32 rsqrt, normalised bf16 (before the weight)."""
    return [
        SavedTensor(f"{prefix}.input_fp32", m.dim, max(act, FP32)),
        SavedTensor(f"{prefix}.rstd", 1, max(act, FP32)),
        SavedTensor(f"{prefix}.normalized", m.dim, act),
    ]


def block_saved_tensors(m: ModelSpec, act: int, context_parallel: bool) -> list[SavedTensor]:
    """Everything one transformer block saves for backward (``act`` = activation bytes per element)."""
    return [
        *rms_norm_saved("attention_norm", m, act),
        SavedTensor("wqkv.input", m.dim, act),
        SavedTensor("sdpa.q", m.dim, act),
        SavedTensor("sdpa.k_expanded", m.dim, act, gathered=context_parallel),
        SavedTensor("sdpa.v_expanded", m.dim, act, gathered=context_parallel),
        SavedTensor("sdpa.out", m.dim, act),
        SavedTensor("sdpa.logsumexp", m.n_heads, FP32),
        SavedTensor("wo.input", m.dim, act),
        *feed_forward_saved_tensors(m, act),
    ]


def feed_forward_saved_tensors(m: ModelSpec, act: int) -> list[SavedTensor]:
    """What a block's RMSNorm + SwiGLU half saves (freed in backward before the attention half runs)."""
    return [
        *rms_norm_saved("ffn_norm", m, act),
        SavedTensor("w13.input", m.dim, act),
        SavedTensor("w1.out", m.ffn_dim, act),
        SavedTensor("silu.out", m.ffn_dim, act),
        SavedTensor("w3.out", m.ffn_dim, act),
        SavedTensor("w2.input", m.ffn_dim, act),
    ]


def head_saved_tensors(m: ModelSpec, act: int) -> list[SavedTensor]:
    """Final norm and the output projection's input (logits and the loss are counted separately)."""
    return [*rms_norm_saved("norm", m, act), SavedTensor("output.input", m.dim, act)]


def checkpoint_saved_tensors(m: ModelSpec, act: int) -> list[SavedTensor]:
    """Under block activation checkpointing a block keeps only its input."""
    return [SavedTensor("block.input", m.dim, act)]


# Cross entropy in fp32 over the vocabulary, per token, in units of ``vocab_size`` elements (TorchTitan's
# ``cross_entropy(pred.float(), labels)`` with ``del pred`` before backward):
#   forward peak : bf16 logits + fp32 copy + fp32 log_softmax output (saved)          -> act + 4 + 4 bytes
#   backward peak: log_softmax output + grad of it (nll_loss backward) + grad input   -> 4 + 4 + 4 bytes
#   then the grad is cast to bf16 for the output projection's backward               -> act bytes
def loss_forward_bytes_per_token(m: ModelSpec, act: int) -> int:
    upcast_copy = FP32 if act < FP32 else 0  # ``.float()`` of fp32 logits is a no-op
    return m.vocab_size * (act + upcast_copy + FP32)


def loss_backward_bytes_per_token(m: ModelSpec, act: int) -> int:
    return m.vocab_size * 3 * FP32


def logits_grad_bytes_per_token(m: ModelSpec, act: int) -> int:
    return m.vocab_size * act
