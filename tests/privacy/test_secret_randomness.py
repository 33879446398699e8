"""The mechanism's secret randomness carries its whole key: no search over torch seeds finds a step's noise, secrets
that share their low 32 bits give unrelated streams, every MT19937 state word of the keyed generators (projections)
is keyed, and ChaCha20 (secure mode's stream) matches RFC 8439 and OpenSSL bit for bit and secure
mode's Gaussians are standard normal."""

from __future__ import annotations

import secrets

import pytest
import torch
from scipy import stats

from lightning_longshield.privacy import GaussianNoise
from lightning_longshield.privacy.chacha20 import (
    _openssl_keystream,
    chacha20_blocks,
    hardened_gaussians,
    secure_gaussians,
    uniform_bits,
)
from lightning_longshield.privacy.randomness import SecretKey

CPU = torch.device("cpu")
WINDOW = 2**16
PROBE = 8  # released values compared per candidate seed


def first_normals(seed: int) -> torch.Tensor:
    return torch.normal(0.0, 1.0, (PROBE,), generator=torch.Generator().manual_seed(seed))


def test_a_search_over_torch_seeds_around_the_secret_finds_nothing():
    """The attack that recovered a step's noise before: torch's CPU generator keeps 32 bits of a seed, so its streams
    are enumerable. The noise now comes from a keystream keyed by 256 bits: a search over 2^16 torch seeds around
    the secret's low 32 bits (a window that held the true stream before) reproduces none of the released noise."""
    planted = secrets.randbits(128)
    noise = GaussianNoise(CPU, SecretKey.from_seed(planted))
    noise.start_step(0)
    released = noise.sample(torch.Size([PROBE]), 1.0, CPU)
    assert noise._generators == ()  # no torch generator, hence no torch seed to start a search from
    centre = planted & 0xFFFFFFFF
    for candidate in range(max(0, centre - WINDOW // 2), centre + WINDOW // 2):
        assert not torch.equal(first_normals(candidate), released), candidate


def test_secrets_sharing_their_low_32_bits_give_different_streams():
    low = secrets.randbits(32)
    draws = []
    for secret in (low, low + 7 * 2**32, low + 2**100):
        noise = GaussianNoise(CPU, SecretKey.from_seed(secret))
        noise.start_step(3)
        draws.append(noise.sample(torch.Size([256]), 1.0, CPU))
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    # torch's own seeding, for contrast: these two seeds give one stream.
    assert torch.equal(first_normals(low), first_normals(low + 7 * 2**32))


def test_the_keyed_state_has_torch_s_layout():
    """A keyed state written with the words of a seeded one is that seeded generator: the layout is torch's."""
    from lightning_longshield.privacy.randomness import _key_mt19937

    seeded = torch.Generator().manual_seed(12345)
    words = seeded.get_state()[24:24 + 8 * 624].view(torch.int64).to(torch.int32).numpy().tobytes()
    keyed = torch.Generator()
    _key_mt19937(keyed, words)
    assert torch.equal(torch.randn(100, generator=keyed), torch.randn(100, generator=seeded))


def test_every_word_of_the_mt19937_state_is_keyed():
    key = SecretKey(bytes(range(32)))
    states = [key.generators(CPU, "noise", step)[0].get_state()[24:24 + 8 * 624].view(torch.int64)
              for step in (0, 1)]
    assert (states[0] != states[1]).float().mean() > 0.99  # all 624 words differ (a chance tie is 2^-32 each)
    assert (states[0] >> 32 == 0).all() and (states[0] != 0).float().mean() > 0.99
    again = key.generators(CPU, "noise", 0)[0].get_state()[24:24 + 8 * 624].view(torch.int64)
    assert torch.equal(states[0], again)


def test_keyed_draws_are_named_by_their_labels_and_standard_normal():
    key = SecretKey.from_seed(11)
    a = torch.randn(50_000, generator=key.generators(CPU, "projection", 0, "w")[0])
    assert torch.equal(a, torch.randn(50_000, generator=key.generators(CPU, "projection", 0, "w")[0]))
    assert not torch.equal(a, torch.randn(50_000, generator=key.generators(CPU, "projection", 1, "w")[0]))
    assert not torch.equal(a, torch.randn(50_000, generator=key.generators(CPU, "projection", 0, "v")[0]))
    assert stats.kstest(a.double().numpy(), "norm").pvalue > 1e-4
    assert "<secret>" in repr(key) and key.derive("x")._key != key._key


# ----------------------------------------------------------------------------------------------- ChaCha20, RFC 8439

RFC_KEY = bytes(range(32))


def test_chacha20_block_function_matches_rfc8439_2_3_2():
    nonce = bytes.fromhex("000000090000004a00000000")
    words = chacha20_blocks(RFC_KEY, nonce, first_block=1, blocks=1, device=CPU)[0]
    serialized = b"".join(int(word).to_bytes(4, "little") for word in words)
    assert serialized.hex() == (
        "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
        "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e"
    )


def test_chacha20_encryption_matches_rfc8439_2_4_2():
    nonce = bytes.fromhex("000000000000004a00000000")
    plaintext = (b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip for the future,"
                 b" sunscreen would be it.")
    words = chacha20_blocks(RFC_KEY, nonce, first_block=1, blocks=2, device=CPU)
    keystream = b"".join(int(word).to_bytes(4, "little") for word in words.flatten())
    ciphertext = bytes(p ^ k for p, k in zip(plaintext, keystream))
    assert ciphertext.hex().startswith("6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0b")
    assert ciphertext.hex().endswith("5af90bbf74a35be6b40b8eedf2785e42874d")


def test_the_torch_block_function_equals_openssl_bit_for_bit():
    """The torch code is what runs on CUDA; OpenSSL is what runs on CPU: the same integers at any offset."""
    key, nonce = secrets.token_bytes(32), secrets.token_bytes(12)
    for first, blocks in ((0, 3), (5, 1000), (2**32 - 4, 4)):
        words = chacha20_blocks(key, nonce, first, blocks, CPU)
        torch_bytes = b"".join(int(word).to_bytes(4, "little") for word in words.flatten())
        assert torch_bytes == _openssl_keystream(key, nonce, first, blocks)
        bits = (words[:, 1::2] << 21) | (words[:, 0::2] >> 11)
        assert torch.equal(bits.flatten(), uniform_bits(key, nonce, first, blocks, CPU))
    with pytest.raises(ValueError, match="wrap"):
        chacha20_blocks(key, nonce, 2**32 - 1, 2, CPU)


def test_secure_gaussians_are_standard_normal_and_fresh_per_key():
    key = secrets.token_bytes(32)
    draw = secure_gaussians(key, 200_001, CPU, chunk=2**16)
    assert draw.dtype == torch.float32 and draw.shape == (200_001,)
    assert stats.kstest(draw.double().numpy(), "norm").pvalue > 1e-4
    assert abs(draw.double().std().item() - 1) < 0.01
    assert torch.equal(draw, secure_gaussians(key, 200_001, CPU))  # chunking does not change the stream
    assert not torch.equal(draw, secure_gaussians(secrets.token_bytes(32), 200_001, CPU))
    # Extremes: the largest 53-bit uniform gives the largest radius, sqrt(2 * 53 ln 2) ~ 8.57 per pair.
    extreme = hardened_gaussians(torch.tensor([2**53 - 1, 0, 2**53 - 1, 0]))
    assert torch.isfinite(extreme).all() and 8.5 < extreme.item() < 8.6


def test_secure_mode_noise_is_keyed_per_tensor():
    noise = GaussianNoise(CPU, secure_mode=True)
    noise.start_step(0)
    a, b = (noise.sample(torch.Size([1000]), 2.0, CPU) for _ in range(2))
    assert not torch.equal(a, b) and abs(a.std().item() - 2.0) < 0.2
    with pytest.raises(ValueError, match="key cannot be combined"):
        GaussianNoise(CPU, SecretKey.fresh(), secure_mode=True)


def test_a_secret_key_is_never_pickled_or_copied():
    """Not even inside a trained strategy: pickling it would write the keys out, a copy would draw the same noise."""
    import copy
    import pickle

    from lightning_longshield import LongShieldStrategy
    from tests.support.helpers import RandomTokens, loader, make_module, make_trainer, small_config

    key = SecretKey.fresh()
    for attempt in (pickle.dumps, copy.deepcopy, copy.copy):
        with pytest.raises(TypeError, match="never pickled or copied"):
            attempt(key)
    strategy = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3)
    make_trainer(strategy, max_steps=1).fit(make_module(small_config(n_layers=1)), loader(RandomTokens(8, 8), 2))
    with pytest.raises(TypeError, match="never pickled or copied"):
        pickle.dumps(strategy)
    # The main process's session of a fit that ran in spawned workers holds a noise that has drawn nothing, and so no
    # key yet: its strategy pickles to the workers of a later validate or test (a TypeError before).
    finished = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3)
    finished.privacy.load_finished_fit(strategy.privacy.state_dict(), "cpu")
    assert finished.privacy.noise is not None and pickle.loads(pickle.dumps(finished)).get_epsilon() > 0
    finished.privacy.noise.start_step(0)  # its first draw takes a key, never pickled
    with pytest.raises(TypeError, match="never pickled or copied"):
        pickle.dumps(finished)


def test_secure_gaussians_refuse_a_chunk_that_splits_a_block():
    """A chunk of odd size starts mid-block and would draw a block's first values again."""
    key = bytes(range(32))
    with pytest.raises(ValueError, match="multiple of 2 coordinates"):
        secure_gaussians(key, 10, torch.device("cpu"), chunk=3)
    torch.testing.assert_close(secure_gaussians(key, 10, torch.device("cpu"), chunk=4),
                               secure_gaussians(key, 10, torch.device("cpu")), rtol=0, atol=0)
