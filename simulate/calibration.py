"""Every calibration constant of the analytic model, in one place.

Everything else is counted from first principles (tensor shapes, FLOPs, bytes on the wire). These few numbers
describe the software stack rather than the model, for the stack the paper measured (TorchTitan, FSDP2, eager
PyTorch, NCCL on one NVLink node); none is set per configuration.

* Memory constants are typical values for the CUDA caching allocator, the CUDA context and NCCL; they were not
  fitted to the paper.
* ``MFU_MATMUL``, ``MFU_ATTENTION`` and ``CP_KV_EXCHANGE_EFFICIENCY`` were set together, once, by a least-squares
  fit to the paper's 14 *non-private* throughput rows (Table 3 FSDP and Table 4 CP, max error 4 %). No private
  (ZeRO-DP+, V1, V2) number was used, so those rows are genuine checks of the DP cost model.
"""

from __future__ import annotations

# --- memory -------------------------------------------------------------------------------------------------
# The caching allocator reserves more than it hands out (block rounding, segments split by differently sized
# activations). TorchTitan reports *reserved* memory, so reserved = peak allocated x (1 + this).
ALLOCATOR_FRAGMENTATION = 0.03

# Device memory outside the allocator, so invisible in TorchTitan's reading but taken from the same GPU:
# the CUDA context with lazily loaded kernels, and NCCL's communicator buffers (FSDP and CP groups).
CUDA_CONTEXT_GIB = 0.5
NCCL_BUFFERS_GIB = 0.5

# --- throughput ---------------------------------------------------------------------------------------------
# Model FLOP utilisation of the dense matmuls (every nn.Linear, forward and backward) and of flash attention
# (FLOPs counted in simulate.flops: causal forward 2 T d per token and layer, backward 2.5x forward), as fractions
# of the GPU's dense bf16 peak. One pair for every method: DP work is counted as extra FLOPs, not lower MFU.
MFU_MATMUL = 0.354
MFU_ATTENTION = 0.293

# Fraction of the link bandwidth NCCL collectives achieve (bus bandwidth / link bandwidth, nccl-tests).
NCCL_BUS_EFFICIENCY = 0.8

# Fraction of the link bandwidth the CP K/V exchange achieves. It sits on the attention's critical path and runs
# as small serialized steps per layer (and per ring step), far from NCCL's large-message bus bandwidth. Measured
# (through the paper) on NVLink only; CP groups that span nodes apply the same fraction to the NIC, untested.
CP_KV_EXCHANGE_EFFICIENCY = 0.133

# The fused per-layer clipping kernels (Triton, tiles formed in registers): the fraction of their peak they reach
# (the tensor cores' bf16 peak, or the CUDA cores' fp32 peak for fp32 inputs, which they multiply in IEEE fp32).
# Fitted to one H100 measurement (llama3.2-1b, bf16-mixed, T 4096, MBS 2: per-layer clipping's step 1.503x
# non-DP's), which puts the kernels at 0.62 of the matmuls' efficiency (``MFU_MATMUL``); fp32 is not measured.
FUSED_CLIP_MFU = 0.22

# Ghost norm: the final (MBS, T, T) x (MBS, T, T) dot product takes about as long as building the two Gram
# matrices (the paper's profiling, section 2), so the ghost norm costs (1 + this) x its Gram-matrix time.
GHOST_REDUCTION_TIME_RATIO = 1.0
