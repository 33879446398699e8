"""The default CPU noise (`privacy.keystream_normals`) against an independent reference: AES-256 applied block by block
to the documented counters (the raw block cipher, in ECB mode; checked against NIST SP 800-38A's CTR-AES256 vectors)
and Box-Muller in fp64 NumPy, following the documented layout, for one tensor and for tensors that share blocks; then
the statistics of the draws and the refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from scipy import stats

from lightning_longshield.privacy import GaussianNoise
from lightning_longshield.privacy.keystream_normals import BLOCK_VALUES, box_muller, keystream_normals_
from lightning_longshield.privacy.randomness import SecretKey

CPU = torch.device("cpu")
KEY = bytes(range(100, 132))


def counter_mode_keystream(key: bytes, first_counter: int, size: int) -> bytes:
    """``size`` bytes of AES's encryptions of the 128-bit big-endian counters ``first_counter``, ``+ 1``, ...: counter
    mode written out over the raw block cipher."""
    counters = b"".join(((first_counter + i) % 2**128).to_bytes(16, "big") for i in range(-(-size // 16)))
    block_cipher = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    return (block_cipher.update(counters) + block_cipher.finalize())[:size]


def test_the_reference_counter_mode_matches_nist_sp800_38a_ctr_aes256():
    """SP 800-38A, F.5.5 (CTR-AES256.Encrypt): ciphertext = plaintext XOR keystream, over four blocks whose counters
    carry within the low byte."""
    key = bytes.fromhex("603deb1015ca71be2b73aef0857d77811f352c073b6108d72d9810a30914dff4")
    counter = int("f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff", 16)
    plaintext = bytes.fromhex("6bc1bee22e409f96e93d7e117393172a" "ae2d8a571e03ac9c9eb76fac45af8e51"
                              "30c81c46a35ce411e5fbc1191a0a52ef" "f69f2445df4f9b17ad2b417be66c3710")
    ciphertext = bytes.fromhex("601ec313775789a5b7a7f504bbf3d228" "f443e3ca4d62b59aca84e990cacaf5c5"
                               "2b0930daa23de94ce87017ba2d84988d" "dfc9c58db67aada613c2dd08457941a6")
    keystream = counter_mode_keystream(key, counter, len(plaintext))
    assert bytes(p ^ k for p, k in zip(plaintext, keystream)) == ciphertext


def reference_normals(key: bytes, nonce: int, numel: int, std: float) -> np.ndarray:
    """fp64 values of the layout in `keystream_normals`, written out from its docstring."""
    block_sizes = [min(BLOCK_VALUES, numel - start) for start in range(0, numel, BLOCK_VALUES)]
    words_needed = sum(2 * ((size + 1) // 2) for size in block_sizes)
    stream = counter_mode_keystream(key, nonce * 2**64, 4 * words_needed)
    words = np.frombuffer(stream, dtype="<u4").astype(np.uint64)
    fine_stream = np.frombuffer(counter_mode_keystream(key, nonce * 2**64 + 2**63, 4 * 64), dtype="<u4")
    fine = iter((fine_stream & np.uint32(2**31 - 1)).astype(np.float32).astype(np.float64))
    values, position = [], 0
    for size in block_sizes:
        pairs = (size + 1) // 2
        block = words[position:position + 2 * pairs]
        position += 2 * pairs
        high = block[:pairs] & np.uint64(2**31 - 1)
        u = (high.astype(np.float32).astype(np.float64) + 1.0) * 2.0**-31
        for index in np.flatnonzero(high < 2**8):  # in order: the draw's fine words, one each
            u[index] = (float(high[index]) + (next(fine) + 1.0) * 2.0**-31) * 2.0**-31
        v = (block[pairs:] & np.uint64(2**24 - 1)).astype(np.float64) * 2.0**-24
        radius = np.sqrt(-2.0 * np.log(u)) * std
        sines = (radius * np.sin(2 * np.pi * v))[: size - pairs]
        values.append(np.concatenate([radius * np.cos(2 * np.pi * v), sines]))
    return np.concatenate(values)


@pytest.mark.parametrize("sizes", [[1], [6], [BLOCK_VALUES + 3], [5, 0, 3, BLOCK_VALUES - 7, 2 * BLOCK_VALUES + 1]],
                         ids=["one", "six", "two-blocks", "tensors-sharing-blocks"])
@pytest.mark.parametrize("nonce", [9, 2**64 - 1])
def test_normals_equal_the_reference_keystream_and_box_muller(sizes, nonce):
    expected = torch.from_numpy(reference_normals(KEY, nonce, sum(sizes), 2.5)).float().split(sizes)
    outs = [torch.full((size,), float("nan")) for size in sizes]
    keystream_normals_(outs, KEY, nonce, 2.5)
    for out, values in zip(outs, expected):
        torch.testing.assert_close(out, values, rtol=1e-5, atol=1e-5)
    totals = [torch.randn(size, generator=torch.Generator().manual_seed(size)) for size in sizes]
    summed = [total.clone() for total in totals]
    keystream_normals_(summed, KEY, nonce, 2.5, scale=0.25)
    for result, total, values in zip(summed, totals, expected):
        torch.testing.assert_close(result, total * 0.25 + values, rtol=1e-5, atol=1e-5)


def test_radius_words_below_2_to_the_8_take_the_draws_fine_words_as_the_reference_does():
    """Nonce 3444's first block has two radius words below 2^8 (positions 22808 and 125897: 163 and 64), about one
    block in 2^6: the values there come from fine words and reach beyond 5.65 sigma, equal to the reference's."""
    words = np.frombuffer(counter_mode_keystream(KEY, 3444 * 2**64, 4 * BLOCK_VALUES // 2), dtype="<u4")
    assert np.flatnonzero((words & (2**31 - 1)) < 2**8).tolist() == [22808, 125897]
    out = torch.empty(BLOCK_VALUES)
    keystream_normals_([out], KEY, 3444, 1.0)
    expected = torch.from_numpy(reference_normals(KEY, 3444, BLOCK_VALUES, 1.0)).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    pairs = BLOCK_VALUES // 2
    radii = torch.hypot(out[:pairs], out[pairs:])
    assert (radii[[22808, 125897]] > 5.65).all() and (radii.topk(2).indices.sort().values == torch.tensor([22808,
                                                                                                    125897])).all()


def test_draws_are_standard_normal_and_keyed_by_key_and_nonce():
    draws = []
    for key, nonce in ((KEY, 0), (KEY, 1), (bytes(32), 0)):
        draws.append(torch.empty(2**20))
        keystream_normals_([draws[-1]], key, nonce, 1.0)
    for draw in draws:
        values = draw.double().numpy()
        assert stats.kstest(values, "norm").pvalue > 1e-4
        assert abs(values.std() - 1) < 5 / math.sqrt(2 * values.size)
        assert abs(values.mean()) < 5 / math.sqrt(values.size)
        tail = np.mean(np.abs(values) > 3)  # 0.0027 for a standard normal; its standard error here is 5e-5
        assert abs(tail - 2 * stats.norm.sf(3)) < 5 * math.sqrt(tail / values.size)
        assert np.abs(values).max() <= math.sqrt(124 * math.log(2)) * (1 + 1e-6)
    correlations = torch.corrcoef(torch.stack(draws))
    assert correlations[~torch.eye(3, dtype=torch.bool)].abs().max() < 5 / 2**10


def test_the_extreme_words_give_the_largest_radius_and_zero():
    """A radius word's low 31 bits all zeros and its fine word's too: u = 2^-62, the largest radius sqrt(124 ln 2) ~
    9.27, beyond the 6.56 of 31-bit and the 5.77 of 24-bit uniforms (a shorter cut-off of the noise costs privacy:
    `privacy.cut_off`); a fine word of all ones: u = 2^-31, radius 6.56; a radius word of all ones: u = 1, radius 0.
    Only radius words below 2^8 take fine words, in order. The sign bit is ignored (a negative int32 word masks like
    any other)."""
    asked = []

    def fine_words(count):
        asked.append(count)
        return torch.tensor([0, -1][:count], dtype=torch.int32)

    words = torch.tensor([0, 0, -1, 0, 0, 0], dtype=torch.int32)  # radii from words 0-2, angles from words 3-5
    values = box_muller(words, 1.0, fine_words)  # r0 cos(0), r1 cos(0), r2 cos(0), then the sines
    torch.testing.assert_close(values, torch.tensor([math.sqrt(124 * math.log(2)), math.sqrt(62 * math.log(2)), 0.0,
                                                     0.0, 0.0, 0.0]))
    assert asked == [2] and values.data_ptr() == words.data_ptr()  # formed in the keystream's memory
    coarse = torch.tensor([2**8, 0], dtype=torch.int32)
    assert box_muller(coarse, 1.0, fine_words).tolist()[0] == pytest.approx(math.sqrt(-2 * math.log(257 / 2**31)))
    assert asked == [2]  # 2^8 takes no fine word


def test_the_release_draws_a_fresh_keystream_per_tensor_and_step():
    noise = GaussianNoise(CPU, SecretKey.from_seed(4), stream=(1, 0))
    noise.start_step(7)
    first, second = noise.sample(torch.Size([1000]), 1.0, CPU), noise.sample(torch.Size([1000]), 1.0, CPU)
    key = SecretKey.from_seed(4).stream(32, "noise-aes256-ctr", 1, 0, 7)
    torch.testing.assert_close(first, torch.from_numpy(reference_normals(key, 0, 1000, 1.0)).float())
    torch.testing.assert_close(second, torch.from_numpy(reference_normals(key, 1, 1000, 1.0)).float())
    noise.start_step(8)
    assert not torch.equal(noise.sample(torch.Size([1000]), 1.0, CPU), first)


def test_the_release_draws_all_its_tensors_as_one_keystream():
    noise = GaussianNoise(CPU, SecretKey.from_seed(6))
    noise.start_step(0)
    totals = [torch.zeros(3, 5), torch.zeros(7)]
    released = noise.add_to_scaled_all(totals, 0.5, 1.5)
    assert all(result is total for result, total in zip(released, totals))
    key = SecretKey.from_seed(6).stream(32, "noise-aes256-ctr", 0)
    expected = torch.from_numpy(reference_normals(key, 0, 22, 1.5)).float()
    torch.testing.assert_close(torch.cat([total.flatten() for total in totals]), expected)


def test_refuses_what_it_cannot_fill():
    with pytest.raises(ValueError, match="32-byte key"):
        keystream_normals_([torch.empty(4)], bytes(16), 0, 1.0)
    with pytest.raises(ValueError, match=r"nonce is in \[0, 2\^64\)"):
        keystream_normals_([torch.empty(4)], KEY, 2**64, 1.0)
    with pytest.raises(ValueError, match="contiguous fp32 CPU"):
        keystream_normals_([torch.empty(4), torch.empty(4, 4).t()], KEY, 0, 1.0)
    with pytest.raises(ValueError, match="contiguous fp32 CPU"):
        keystream_normals_([torch.empty(4, dtype=torch.float64)], KEY, 0, 1.0)
    with pytest.raises(ValueError, match="even number of words"):
        box_muller(torch.zeros(3, dtype=torch.int32), 1.0, lambda count: torch.zeros(count, dtype=torch.int32))
