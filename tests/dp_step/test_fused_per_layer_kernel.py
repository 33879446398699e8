"""The fused per-layer clipping kernels for linear weights (Triton): per-sample squared norms and the clipped sum
equal an explicit per-sample einsum, and a DP step through them equals the PyTorch path and the per-sample loop.

They run on CUDA; without CUDA but with Triton installed, `test_kernels_under_the_interpreter` runs them again in a
process where Triton's interpreter executes the same kernels on CPU tensors (``TRITON_INTERPRET=1``, which must be set
before Triton is imported; it mis-reads bf16, so the CPU cases use fp32 and fp16). Without Triton they are skipped;
when the fused path is and is not taken is tested everywhere."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_longshield import LongShieldStrategy, PerLayerClipping
from lightning_longshield.privacy.per_layer import use_fused_kernel
from tests.support import triton_kernels
from tests.support.helpers import (
    RandomTokens,
    assert_models_close,
    layer_bounds,
    loader,
    make_module,
    make_trainer,
    reference_dp_sgd,
    samples,
    small_config,
)
from tests.support.triton_kernels import (
    HAS_TRITON,
    INTERPRETED,
    needs_interpreter_process,
    run_file_under_interpreter,
)

CLIP = 0.05
BATCH = 4

kernel_device = triton_kernels.kernel_device  # the fixture


@needs_interpreter_process
def test_kernels_under_the_interpreter():
    """This file's kernel tests in a fresh process with ``TRITON_INTERPRET=1``."""
    run_file_under_interpreter(__file__, skipped=3)


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="compiles the kernel for a GPU target (Triton's compiler)")
def test_offsets_are_int64_in_the_compiled_kernels():
    """``t * stride`` along the tokens reaches ``T x out``, past 2^31 for an unchunked 128k-vocabulary head at
    T >= 16,744, where Triton passes the stride as int32; ``out * stride`` does the same for a transposed gradient and
    for a weight past 2^31 elements: the kernels form every offset product in int64 (read from the Triton IR of a
    CUDA compilation, which needs no GPU)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lightning_longshield.privacy.fused_linear_clip import _clipped_sum_kernel, _squared_norms_kernel

    strides = ["stride_ab", "stride_at", "stride_ai", "stride_gb", "stride_gt", "stride_go"]
    tiles = dict(BLOCK_OUT=64, BLOCK_IN=64, BLOCK_TOKENS=32, PRECISION="ieee")
    kernels = {
        _squared_norms_kernel: dict(a_ptr="*fp32", g_ptr="*fp32", norms_ptr="*fp64", tokens="i32", n_out="i32",
                                    n_in="i32", **dict.fromkeys(strides, "i32")),
        _clipped_sum_kernel: dict(a_ptr="*fp32", g_ptr="*fp32", factors_ptr="*fp32", out_ptr="*fp32", batch="i32",
                                  tokens="i32", n_out="i32", n_in="i32", **dict.fromkeys(strides, "i32"),
                                  stride_oo="i32", stride_oi="i32"),
    }
    for kernel, signature in kernels.items():
        source = ASTSource(kernel, {**signature, **dict.fromkeys(tiles, "constexpr")}, constexprs=tiles)
        ir = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ttir"]
        # the token block's offsets times a stride: (1, BLOCK_TOKENS) for G, (BLOCK_TOKENS, 1) for A
        token_products = [line for line in ir.splitlines()
                          if "arith.muli" in line and ("tensor<1x32x" in line or "tensor<32x1x" in line)]
        assert len(token_products) == 2, "\n".join(token_products)
        assert all("xi64>" in line for line in token_products), "\n".join(token_products)
        # the sample's offset, sample * stride (B x T x out elements in all), a scalar product
        sample_products = [line for line in ir.splitlines() if "arith.muli %sample" in line]  # for G and for A
        assert len(sample_products) == 2 and all(": i64" in line for line in sample_products), sample_products
        # the output and input rows' offsets times a stride: (64, 1) and (1, 64), in the tile and in the sum's store
        row_products = [line for line in ir.splitlines()
                        if "arith.muli" in line and ("tensor<64x1x" in line or "tensor<1x64x" in line)]
        assert len(row_products) == (2 if kernel is _squared_norms_kernel else 4), "\n".join(row_products)
        assert all("xi64>" in line for line in row_products), "\n".join(row_products)


def per_sample_weights(activation: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """Reference: every per-sample gradient ``G_i^T A_i`` in fp64."""
    a = activation.double().flatten(1, -2)
    g = grad_output.double().flatten(1, -2)
    return torch.einsum("bto,bti->boi", g, a)


@pytest.mark.parametrize("tiles", [(64, 32), (16, 16), (128, 64)], ids=lambda t: f"out{t[0]}-tokens{t[1]}")
@pytest.mark.parametrize("shape", [(3, 37, 70, 90), (2, 64, 64, 128), (1, 5, 3, 200)], ids=str)
def test_norms_and_clipped_sum_equal_the_per_sample_einsum(kernel_device, shape, tiles):
    """For the default tile and others (partial tiles and token blocks included): `FusedTiles` only moves work."""
    from lightning_longshield.privacy.fused_linear_clip import FusedTiles, add_clipped_linear_sum, linear_squared_norms

    batch, tokens, n_in, n_out = shape
    generator = torch.Generator().manual_seed(sum(shape))
    activation = torch.randn(batch, tokens, n_in, generator=generator).to(kernel_device)
    grad_output = torch.randn(batch, tokens, n_out, generator=generator).to(kernel_device)
    weights = per_sample_weights(activation, grad_output)
    expected_norms = weights.flatten(1).square().sum(1)
    block_out, block_tokens = tiles
    tiles = FusedTiles(block_out=block_out, block_tokens=block_tokens, num_warps=8 if block_out == 128 else 4)
    torch.testing.assert_close(linear_squared_norms(activation, grad_output, tiles).cpu(), expected_norms.cpu(),
                               rtol=1e-5, atol=0)
    factors = torch.rand(batch, generator=generator).to(kernel_device)
    start = torch.randn(n_out, n_in, generator=generator).to(kernel_device)
    out = add_clipped_linear_sum(start.clone(), activation, grad_output, factors, tiles)
    expected = start.double() + torch.einsum("b,boi->oi", factors.double(), weights)
    torch.testing.assert_close(out.double().cpu(), expected.cpu(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_strided_and_higher_rank_inputs(kernel_device, dtype):
    """fp16 and bf16 inputs (products formed in fp32), a transposed (non-contiguous) input and (B, x, T, F) inputs."""
    from lightning_longshield.privacy.fused_linear_clip import add_clipped_linear_sum, linear_squared_norms

    if dtype == torch.bfloat16 and kernel_device.type == "cpu":
        pytest.skip("Triton's interpreter mis-reads bf16; bf16 runs on CUDA")
    generator = torch.Generator().manual_seed(0)
    activation = torch.randn(2, 3, 40, 24, generator=generator).to(dtype).to(kernel_device)
    grad_output = torch.randn(2, 3, 24, 40, generator=generator).to(dtype).to(kernel_device).transpose(-1, -2)
    weights = per_sample_weights(activation, grad_output)
    torch.testing.assert_close(linear_squared_norms(activation, grad_output).cpu(),
                               weights.flatten(1).square().sum(1).cpu(), rtol=1e-5, atol=0)
    factors = torch.tensor([0.25, 1.0], device=kernel_device)
    out = add_clipped_linear_sum(torch.zeros(24, 24, device=kernel_device), activation, grad_output, factors)
    torch.testing.assert_close(out.double().cpu(), torch.einsum("b,boi->oi", factors.double(), weights).cpu(),
                               rtol=1e-5, atol=1e-3)


def test_a_non_finite_sample_adds_nothing(kernel_device):
    """A sample with inf inputs and one with NaN output gradients get non-finite norms, hence factor 0
    (`clip_factors`), and then add exactly zero: the sum is the other samples' and finite."""
    from lightning_longshield.privacy.clipping import clip_factors
    from lightning_longshield.privacy.fused_linear_clip import add_clipped_linear_sum, linear_squared_norms

    generator = torch.Generator().manual_seed(3)
    activation = torch.randn(4, 20, 30, generator=generator)
    grad_output = torch.randn(4, 20, 50, generator=generator)
    activation[1, 3, 7], grad_output[2, 5, 0] = float("inf"), float("nan")
    activation, grad_output = activation.to(kernel_device), grad_output.to(kernel_device)
    factors = clip_factors(linear_squared_norms(activation, grad_output), 1.0)
    assert factors.cpu()[1:3].tolist() == [0.0, 0.0] and factors.cpu()[[0, 3]].gt(0).all()
    out = add_clipped_linear_sum(torch.zeros(50, 30, device=kernel_device), activation, grad_output, factors)
    kept = [0, 3]
    expected = torch.einsum("b,boi->oi", factors.cpu()[kept].double(),
                            per_sample_weights(activation.cpu()[kept], grad_output.cpu()[kept]))
    assert out.isfinite().all()
    torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("micro_batch_size", [2, 4])
def test_fused_step_equals_the_pytorch_path_and_the_reference(kernel_device, micro_batch_size):
    """Whole DP steps with clipping active: every linear weight goes through the kernels."""
    if kernel_device.type == "cuda":
        pytest.skip("the trainers of these tests run on CPU: the interpreted kernels cover this step")
    config = small_config()
    dataset = RandomTokens(size=BATCH * 2, seq_len=16)
    updated = {}
    for kernel in ("triton", "torch"):
        module = make_module(config)
        if kernel == "triton":
            initial = copy.deepcopy(module.model)
        strategy = LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=CLIP, poisson_sampling=False, seed=0,
                                      clipping=PerLayerClipping(kernel=kernel),
                                      micro_batch_size=micro_batch_size)
        make_trainer(strategy, max_steps=2).fit(module, loader(dataset, BATCH))
        fused = strategy.dp_engine.fused_weights
        assert (len(fused) == 7 * config.n_layers + 1) if kernel == "triton" else not fused  # 7 per block, head
        updated[kernel] = module.model
    assert_models_close(updated["triton"], updated["torch"])
    batches = [samples(dataset, range(k * BATCH, (k + 1) * BATCH)) for k in range(2)]
    expected = reference_dp_sgd(initial, batches, CLIP, BATCH, layer_thresholds=layer_bounds(initial, CLIP))
    assert_models_close(updated["triton"], expected)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_tiles_are_validated():
    from lightning_longshield.privacy.fused_linear_clip import FusedTiles

    for bad in (dict(block_out=48), dict(block_tokens=8), dict(num_warps=3), dict(num_stages=0)):
        with pytest.raises(ValueError, match="FusedTiles"):
            FusedTiles(**bad)
    assert FusedTiles().launch() == dict(BLOCK_OUT=64, BLOCK_IN=64, BLOCK_TOKENS=32, num_warps=4, num_stages=3)


def test_when_the_fused_kernel_is_used(monkeypatch):
    """'auto' takes it only where it runs and never under context parallelism; 'triton' where it cannot run is an
    error naming the fix; 'torch' never takes it."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert not use_fused_kernel("auto", cpu, context_parallel=False)
    assert not use_fused_kernel("torch", cpu, context_parallel=False)
    with pytest.raises(ValueError, match="needs CUDA and Triton. Use kernel='auto'"):
        use_fused_kernel("triton", cpu, context_parallel=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_fused_kernel("auto", cpu, context_parallel=False) == HAS_TRITON
    assert not use_fused_kernel("auto", cpu, context_parallel=True)
    if HAS_TRITON:  # without Triton the "needs CUDA and Triton" reason is the one given
        with pytest.raises(ValueError, match="context-parallel size 1"):
            use_fused_kernel("triton", cpu, context_parallel=True)
