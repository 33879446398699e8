"""The fused CUDA noise kernel (`privacy.fused_noise`) against an independent NumPy Philox-4x32-10 and Box-Muller,
the reference itself against Random123's known-answer vectors, and the statistics of the draws.

The kernel runs on CUDA; without CUDA but with Triton installed, `test_kernel_under_the_interpreter` runs this file
again in a process where Triton's interpreter executes it on CPU tensors (``TRITON_INTERPRET=1``). Without Triton the
kernel's tests are skipped; the reference, the key words and the path selection are tested everywhere."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from lightning_longshield.privacy import GaussianNoise
from lightning_longshield.privacy.randomness import SecretKey
from tests.support import triton_kernels
from tests.support.triton_kernels import (
    HAS_TRITON,
    INTERPRETED,
    needs_interpreter_process,
    run_file_under_interpreter,
)

BLOCK = 1024  # fused_noise.BLOCK, restated: the reference's element-to-counter map is written out here
_MASK = np.uint64(0xFFFFFFFF)

kernel_device = triton_kernels.kernel_device  # the fixture


def philox4x32_10(counter: list[np.ndarray], key: tuple[int, int]) -> list[np.ndarray]:
    """Philox-4x32-10 (Salmon et al., 2011), written from the paper's round function."""
    c0, c1, c2, c3 = (np.asarray(word, dtype=np.uint64) for word in counter)
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    for _ in range(10):
        p0, p1 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _MASK, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _MASK
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & _MASK, (k1 + np.uint64(0xBB67AE85)) & _MASK
    return [word.astype(np.uint32) for word in (c0, c1, c2, c3)]


def box_muller(bits_radius: np.ndarray, bits_angle: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    u1 = bits_radius.astype(np.float64) * 2.0**-32 + 2.0**-33
    radius = np.sqrt(-2.0 * np.log(u1))
    angle = 2 * math.pi * (bits_angle.astype(np.float64) * 2.0**-32 - 0.5)
    return radius * np.cos(angle), radius * np.sin(angle)


def reference_noise(words: list[int], call: int, numel: int, std: float) -> np.ndarray:
    """The kernel's noise in fp64: two keyed streams, four normals per counter, summed and scaled by std/sqrt(2)."""
    programs = -(-numel // (4 * BLOCK))
    counters = np.arange(programs * BLOCK, dtype=np.uint64)
    total = np.zeros((programs, 4, BLOCK))
    for stream in range(2):
        seed, word_a, word_b = words[3 * stream: 3 * stream + 3]
        seed &= 2**64 - 1
        fill = np.full_like(counters, 1)
        r = philox4x32_10([counters, fill * word_a, fill * word_b, fill * call], (seed & 0xFFFFFFFF, seed >> 32))
        normals = [*box_muller(r[0], r[1]), *box_muller(r[2], r[3])]
        for j, normal in enumerate(normals):
            total[:, j, :] += normal.reshape(programs, BLOCK)
    return (total.reshape(-1)[:numel] * std / math.sqrt(2))


@pytest.mark.parametrize(("counter", "key", "expected"), [
    ([0, 0, 0, 0], (0, 0), [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, (0xFFFFFFFF, 0xFFFFFFFF), [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], (0xA4093822, 0x299F31D0),
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
])
def test_the_reference_philox_matches_random123_known_answers(counter, key, expected):
    assert [int(word) for word in philox4x32_10(counter, key)] == expected


def test_the_reference_draws_are_standard_normal_and_independent_across_streams_and_calls():
    words = SecretKey.from_seed(3).philox_words("noise", 0)
    first = reference_noise(words, 0, 2**20, 1.0)
    assert stats.kstest(first, "norm").pvalue > 1e-3
    assert abs(first.std() - 1) < 0.005 and abs(first.mean()) < 0.005
    beyond_three = np.mean(np.abs(first) > 3)
    assert abs(beyond_three - 2 * stats.norm.sf(3)) < 5 * math.sqrt(2 * stats.norm.sf(3) / 2**20)
    second_call = reference_noise(words, 1, 2**20, 1.0)
    other_step = reference_noise(SecretKey.from_seed(3).philox_words("noise", 1), 0, 2**20, 1.0)
    for other in (second_call, other_step):
        assert abs(np.corrcoef(first, other)[0, 1]) < 5 / math.sqrt(2**20)
    # Neighbouring elements come from one counter's four outputs or from neighbouring counters: uncorrelated too.
    assert abs(np.corrcoef(first[:-1], first[1:])[0, 1]) < 5 / math.sqrt(2**20)
    assert abs(np.corrcoef(first[:-BLOCK], first[BLOCK:])[0, 1]) < 5 / math.sqrt(2**20)


def test_the_key_words_are_256_secret_bits_named_by_their_labels():
    key = SecretKey.from_seed(11)
    words = key.philox_words("noise", 0, 0, 5)
    assert len(words) == 6
    assert all(-2**63 <= words[i] < 2**63 for i in (0, 3))
    assert all(0 <= words[i] < 2**32 for i in (1, 2, 4, 5))
    assert words == key.philox_words("noise", 0, 0, 5)
    assert words != key.philox_words("noise", 0, 0, 6) and words != key.philox_words("noise", 1, 0, 5)
    assert words != SecretKey.from_seed(12).philox_words("noise", 0, 0, 5)


@pytest.mark.skipif(HAS_TRITON and INTERPRETED, reason="this process runs the fused kernel on CPU")
def test_cpu_noise_takes_the_fused_kernel_only_where_triton_runs():
    noise = GaussianNoise(torch.device("cpu"), key=SecretKey.from_seed(1))
    noise.start_step(0)
    assert noise._fused_keys is None
    total = torch.ones(10)
    assert noise.add_to_scaled(total, 0.5, 1.0) is total  # the keystream CPU path, in place


@needs_interpreter_process
def test_kernel_under_the_interpreter():
    """This file's kernel tests in a fresh process with ``TRITON_INTERPRET=1``."""
    run_file_under_interpreter(__file__, skipped=2)


@pytest.mark.parametrize("numel", [5, 4 * BLOCK, 2 * 4 * BLOCK + 37])
def test_the_kernel_draws_the_reference_noise_and_adds_it_to_the_scaled_sum(kernel_device, numel):
    from lightning_longshield.privacy.fused_noise import keyed_noise_

    words = SecretKey.from_seed(numel).philox_words("noise", 0, 0, 7)
    words[0], words[3] = -1 - (words[0] & (2**62 - 1)), words[3] & (2**62 - 1)  # one key of each sign
    keys = torch.tensor(words, dtype=torch.int64, device=kernel_device)
    expected = torch.from_numpy(reference_noise(words, 3, numel, 2.5)).float()
    out = torch.full((numel,), float("nan"), device=kernel_device)
    keyed_noise_(out, keys, 3, 2.5)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4)
    total = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(kernel_device)
    summed = total.clone()
    assert keyed_noise_(summed, keys, 3, 2.5, total=summed, scale=0.25) is summed
    torch.testing.assert_close(summed.cpu(), total.cpu() * 0.25 + expected, rtol=1e-4, atol=1e-4)


def test_the_kernel_refuses_what_it_cannot_draw_into(kernel_device):
    from lightning_longshield.privacy.fused_noise import keyed_noise_

    keys = torch.zeros(6, dtype=torch.int64, device=kernel_device)
    with pytest.raises(ValueError, match="fp32 contiguous"):
        keyed_noise_(torch.zeros(4, 4, device=kernel_device).t(), keys, 0, 1.0)
    with pytest.raises(ValueError, match="int64 key words"):
        keyed_noise_(torch.zeros(4, device=kernel_device), keys[:5], 0, 1.0)
    with pytest.raises(ValueError, match="32 bits"):
        keyed_noise_(torch.zeros(4, device=kernel_device), keys, 2**32, 1.0)


def test_gaussian_noise_releases_through_the_kernel_in_place_fresh_per_draw_and_step(kernel_device):
    noise = GaussianNoise(kernel_device, key=SecretKey.from_seed(5), stream=(0, 1))
    noise.start_step(4)
    words = SecretKey.from_seed(5).philox_words("noise", 0, 1, 4)
    total = torch.zeros(3 * BLOCK, device=kernel_device)
    released = noise.add_to_scaled(total, 0.5, 2.0)
    assert released is total
    torch.testing.assert_close(released.cpu(), torch.from_numpy(reference_noise(words, 0, total.numel(), 2.0)).float(),
                               rtol=1e-4, atol=1e-4)
    sampled = noise.sample(torch.Size([2, BLOCK]), 2.0, kernel_device)  # the step's next draw
    torch.testing.assert_close(sampled.cpu().reshape(-1),
                               torch.from_numpy(reference_noise(words, 1, sampled.numel(), 2.0)).float(),
                               rtol=1e-4, atol=1e-4)
    noise.start_step(5)
    next_step = noise.add_to_scaled(torch.zeros(3 * BLOCK, device=kernel_device), 0.5, 2.0)
    assert not torch.equal(next_step, released)
    assert stats.kstest((next_step.cpu() / 2.0).numpy(), "norm").pvalue > 1e-3


def test_a_dp_step_through_the_kernel_adds_noise_of_std_sigma_c_over_b(kernel_device, monkeypatch):
    """The strategy's release on the kernel's device: the update's noise is ``N(0, (sigma C / B)^2)`` per coordinate
    and the same with the same ``noise_seed`` (on CPU this runs in the interpreter's process only)."""
    if kernel_device.type == "cuda":
        pytest.skip("the strategy's one-process tests run on CPU; on CUDA the kernel tests above cover the release")
    from lightning_longshield.privacy import fused_noise
    from tests.privacy.test_noise import BATCH, CLIP, SIGMA, one_step

    draws = []
    kernel = fused_noise.keyed_noise_
    monkeypatch.setattr(fused_noise, "keyed_noise_", lambda out, *args, **kwargs: draws.append(out.numel()) or
                        kernel(out, *args, **kwargs))
    _, clean = one_step(0.0, seed=0)
    _, noisy = one_step(SIGMA, seed=0, noise_seed=0)
    assert sum(draws) == clean.numel()  # every coordinate's noise came from the kernel
    _, again = one_step(SIGMA, seed=0, noise_seed=0)
    noise = -(noisy - clean)
    torch.testing.assert_close(noisy, again, rtol=0, atol=0)
    expected_std = SIGMA * CLIP / BATCH
    assert abs(noise.std().item() / expected_std - 1) < 5 / (2 * noise.numel()) ** 0.5
    assert stats.kstest((noise / expected_std).numpy(), "norm").pvalue > 1e-3
