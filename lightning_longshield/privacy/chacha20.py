"""ChaCha20 (RFC 8439) keystreams on any torch device, and secure-mode Gaussians drawn from them.

The block function is written in torch integer ops (32-bit words held in int64 lanes), so the same code runs on CPU
and CUDA and gives the same integers on both; on CPU the keystream comes from OpenSSL's ChaCha20 (the
``cryptography`` package), tested to match the torch code and RFC 8439's vectors bit for bit.

Gaussians: each coordinate takes 32 keystream bytes, four 53-bit uniforms, two Box-Muller pairs (fp64), i.e. four
standard normals whose sum over two is the coordinate (Opacus's four-draw hardening of the sampler). The keystream is
cryptographically secure; the conversion to floating point is not proven safe against attacks on floating-point
samplers (Mironov 2012; Jin et al., S&P 2022): summing four draws hardens it, it is no proof.
"""

from __future__ import annotations

import math

import torch

from lightning_longshield.privacy.randomness import top_53_bits

_MASK = 0xFFFFFFFF
_CONSTANTS = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)  # "expand 32-byte k"
#: Blocks per batch of the torch block function: its working set is 16 int64 words a block plus temporaries.
_BLOCKS_PER_BATCH = {"cpu": 2**16}
_DEFAULT_BLOCKS_PER_BATCH = 2**21
#: Uniforms per Gaussian coordinate (two Box-Muller pairs), 8 keystream bytes each.
UNIFORMS_PER_COORDINATE = 4


def _words(data: bytes) -> list[int]:
    return [int.from_bytes(data[i:i + 4], "little") for i in range(0, len(data), 4)]


def _rotate_left(x: torch.Tensor, bits: int) -> torch.Tensor:
    return ((x << bits) & _MASK) | (x >> (32 - bits))


def _quarter_round(state: list[torch.Tensor], a: int, b: int, c: int, d: int) -> None:
    state[a] = (state[a] + state[b]) & _MASK
    state[d] = _rotate_left(state[d] ^ state[a], 16)
    state[c] = (state[c] + state[d]) & _MASK
    state[b] = _rotate_left(state[b] ^ state[c], 12)
    state[a] = (state[a] + state[b]) & _MASK
    state[d] = _rotate_left(state[d] ^ state[a], 8)
    state[c] = (state[c] + state[d]) & _MASK
    state[b] = _rotate_left(state[b] ^ state[c], 7)


def chacha20_blocks(key: bytes, nonce: bytes, first_block: int, blocks: int, device: torch.device) -> torch.Tensor:
    """``(blocks, 16)`` int64 output words (each < 2^32) of ChaCha20 blocks ``first_block ...``, RFC 8439 section
    2.3: 256-bit ``key``, 96-bit ``nonce``, 32-bit block counter."""
    if len(key) != 32 or len(nonce) != 12:
        raise ValueError("ChaCha20 takes a 32-byte key and a 12-byte nonce.")
    if first_block + blocks > 2**32:
        raise ValueError("ChaCha20's 32-bit block counter would wrap: draw fewer than 2^32 blocks per key.")
    counter = torch.arange(first_block, first_block + blocks, dtype=torch.int64, device=device)
    fixed = [*_CONSTANTS, *_words(key)]
    initial = [torch.full_like(counter, word) for word in fixed] + [counter]
    initial += [torch.full_like(counter, word) for word in _words(nonce)]
    state = list(initial)
    for _ in range(10):
        _quarter_round(state, 0, 4, 8, 12)
        _quarter_round(state, 1, 5, 9, 13)
        _quarter_round(state, 2, 6, 10, 14)
        _quarter_round(state, 3, 7, 11, 15)
        _quarter_round(state, 0, 5, 10, 15)
        _quarter_round(state, 1, 6, 11, 12)
        _quarter_round(state, 2, 7, 8, 13)
        _quarter_round(state, 3, 4, 9, 14)
    return torch.stack([(s + i) & _MASK for s, i in zip(state, initial)], dim=1)


def _openssl_keystream(key: bytes, nonce: bytes, first_block: int, blocks: int) -> bytes:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    full_nonce = first_block.to_bytes(4, "little") + nonce  # the library's 16 bytes: counter, then the nonce
    encryptor = Cipher(algorithms.ChaCha20(key, full_nonce), mode=None).encryptor()
    return encryptor.update(bytes(64 * blocks))


def uniform_bits(key: bytes, nonce: bytes, first_block: int, blocks: int, device: torch.device) -> torch.Tensor:
    """``8 * blocks`` int64 values of 53 bits from ChaCha20 blocks ``first_block ...``: the keystream read as
    little-endian 64-bit words, each shifted right by 11 (its top 53 bits). The same integers on every device."""
    device = torch.device(device)
    if device.type == "cpu":
        return top_53_bits(_openssl_keystream(key, nonce, first_block, blocks))
    step = _BLOCKS_PER_BATCH.get(device.type, _DEFAULT_BLOCKS_PER_BATCH)
    out = torch.empty(blocks, 8, dtype=torch.int64, device=device)
    for start in range(0, blocks, step):
        words = chacha20_blocks(key, nonce, first_block + start, min(step, blocks - start), device)
        out[start:start + words.shape[0]] = (words[:, 1::2] << 21) | (words[:, 0::2] >> 11)
    return out.flatten()


def hardened_gaussians(bits: torch.Tensor) -> torch.Tensor:
    """fp64 standard normals from 53-bit integers ``bits`` (``4 n`` of them): per coordinate two Box-Muller pairs
    ``(u, v)``, ``u`` in (0, 1], ``v`` in [0, 1), and ``(r cos t + r sin t + r' cos t' + r' sin t') / 2``."""
    uniforms = bits.view(-1, 2, 2).double().mul_(2.0**-53)
    radius = torch.log1p(-uniforms[..., 0]).mul_(-2.0).sqrt_()  # 1 - u in (0, 1]
    angle = uniforms[..., 1].mul(2 * math.pi)
    pairs = radius * (torch.cos(angle) + torch.sin(angle))
    return pairs.sum(1).mul_(0.5)


def secure_gaussians(key: bytes, count: int, device: torch.device, chunk: int = 2**22) -> torch.Tensor:
    """``count`` fp32 ``N(0, 1)`` entries from ChaCha20 keyed by ``key`` (nonce 0), four-draw hardened, ``chunk``
    coordinates (``chunk / 2`` blocks) at a time so the integer and fp64 working sets stay bounded."""
    per_block = 8 // UNIFORMS_PER_COORDINATE
    if chunk < per_block or chunk % per_block:  # a chunk must start on a block, or a block's values repeat
        raise ValueError(f"chunk={chunk} must be a positive multiple of {per_block} coordinates (one ChaCha20 block).")
    if count > per_block * 2**32:
        raise ValueError(f"A secure-mode noise tensor is limited to {per_block} * 2^32 entries per key.")
    out = torch.empty(count, dtype=torch.float32, device=device)
    for start in range(0, count, chunk):
        stop = min(count, start + chunk)
        blocks = -(-(stop - start) // per_block)
        bits = uniform_bits(key, bytes(12), start // per_block, blocks, device)
        out[start:stop] = hardened_gaussians(bits)[:stop - start]
    return out
