"""Gaussian noise for the DP-SGD release, from secret keys independent of the global RNG (`privacy.randomness`)."""

from __future__ import annotations

import secrets
from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

from lightning_longshield.privacy.chacha20 import secure_gaussians
from lightning_longshield.privacy.cut_off import KEYSTREAM_TAIL, PHILOX_TAIL, SECURE_TAIL, NoiseTail
from lightning_longshield.privacy.keystream_normals import keystream_normals_
from lightning_longshield.privacy.randomness import KEY_BYTES, SecretKey, standard_normal_
from lightning_longshield.privacy.triton_support import triton_runs_on


class GaussianNoise:
    """Draws ``N(0, std^2)`` fp32 noise for the DP steps of one process.

    Three sources, from the default to the explicit opt-in:

    - default: a 256-bit `SecretKey` from OS entropy at the object's first step (per process, never stored); step
      ``k``'s draws are keyed by ``(key, stream, k)``. On CPU each draw (a tensor, or all of a release's tensors
      together: `add_to_scaled_all`) is an AES-256-CTR keystream keyed by 256 bits of that stream, its nonce the draw's
      index in the step, turned into fp32 normals by `keystream_normals`: a cryptographically secure stream, faster
      than torch's MT19937. Where Triton runs (CUDA), the draws come from the fused kernel of `fused_noise`, keyed
      by 256 bits of the same stream per step, and are added to the sum in the same pass; elsewhere from torch
      generators whose whole state is keyed (`SecretKey.generators`: 2 x 126 bits of Philox state). Philox is not
      a cryptographic generator: keyed far beyond any search, not proven.
    - ``secure_mode``: every tensor drawn is ChaCha20 keyed by 256 fresh bits of OS entropy (`privacy.chacha20`), a
      cryptographically secure stream, turned into Gaussians with the four-draw hardening (sum of four Box-Muller
      normals over two), as Opacus hardens its sampler against Mironov's (2012) attack. That hardening is not a
      proof against floating-point attacks (Jin et al., S&P 2022).
    - ``key`` given (from ``noise_seed`` of the strategy): as the default but from that key, hence reproducible. The
      guarantee then holds only while the seed stays secret.

    ``stream`` separates processes (each draws the noise of its own shard and data-parallel replica), so noise is
    independent across coordinates and replicas however the parameters are sharded.
    """

    def __init__(
        self,
        device: torch.device,
        key: Optional[SecretKey] = None,
        stream: tuple[int, ...] = (),
        secure_mode: bool = False,
    ) -> None:
        if secure_mode and key is not None:
            raise ValueError("secure_mode draws fresh OS entropy for every noise tensor; a key cannot be combined.")
        self.reproducible = key is not None
        self.secure_mode = secure_mode
        # A fresh key is drawn at the first step: until then the object holds no secret and may travel to other
        # processes (the main process's copy of a finished spawned fit, pickled to the workers of a later validate).
        self._key: Optional[SecretKey] = key
        self._stream = stream
        self._device = torch.device(device)
        self._generators: tuple[torch.Generator, ...] = ()
        self._fused = not secure_mode and triton_runs_on(self._device)
        self._fused_keys: Optional[torch.Tensor] = None
        self._cpu_key: Optional[bytes] = None
        self._draws = 0  # draws in this step: the nonce of the next CPU keystream, the fused kernel's draw index

    @property
    def device(self) -> torch.device:
        """The device the draws are made on."""
        return self._device

    @property
    def keystream(self) -> bool:
        """Whether the default draws are AES-256-CTR keystreams (on CPU), not Philox generators or the fused kernel
        (which Triton's interpreter runs on CPU, in tests)."""
        return not self.secure_mode and self._device.type == "cpu" and not self._fused

    @property
    def tail(self) -> NoiseTail:
        """How the released normals end (`privacy.cut_off`): the keystream's one normal on CPU, two Philox normals
        summed elsewhere (the fused kernel, or torch's ``normal_``: cuRAND's on CUDA), and in ``secure_mode`` two
        (its four draws are two radii)."""
        if self.secure_mode:
            return SECURE_TAIL
        return KEYSTREAM_TAIL if self.keystream else PHILOX_TAIL

    def start_step(self, step: int) -> None:
        """Key the draws of DP step ``step`` (secure mode keys each tensor instead)."""
        if self.secure_mode:
            return
        self._draws = 0
        if self._key is None:
            self._key = SecretKey.fresh()
        if self.keystream:
            self._cpu_key = self._key.stream(KEY_BYTES, "noise-aes256-ctr", *self._stream, step)
            return
        self._generators = self._key.generators(self._device, "noise", *self._stream, step)
        if self._fused:
            words = torch.tensor(self._key.philox_words("noise", *self._stream, step), dtype=torch.int64)
            if self._device.type == "cuda":  # copied without a host sync, which would idle the GPU until the release
                words = words.pin_memory()
            self._fused_keys = words.to(self._device, non_blocking=True)

    def sample(self, shape: torch.Size, std: float, device: torch.device) -> torch.Tensor:
        """An fp32 tensor of shape ``shape`` with i.i.d. ``N(0, std^2)`` entries."""
        if self.secure_mode:
            count = int(torch.Size(shape).numel())
            return secure_gaussians(secrets.token_bytes(KEY_BYTES), count, device).view(shape).mul_(std)
        out = torch.empty(tuple(shape), dtype=torch.float32, device=device)
        if self._keystream_on(out):
            self._keystream_draw([out], std)
            return out
        if isinstance(out, FakeTensor) and out.device.type == "cpu":
            return out  # a traced step: nothing to draw
        if self._fused_on(out):
            return self._fused_draw(out, std)
        return standard_normal_(out, self._step_generators(), std)

    def add_to_scaled(self, total: torch.Tensor, scale: float, std: float) -> torch.Tensor:
        """``total * scale + N(0, std^2)``: in place on CPU and through the fused CUDA kernel (an fp32 contiguous
        ``total``), else a new tensor. The same draws as `sample`.

        On CPU the keystream's normals are formed and added a block at a time (`keystream_normals`): no tensor of
        noise is allocated. A fake tensor (a traced step, which models a GPU's memory) is scaled in place and
        allocates nothing, as the fused kernel does on a GPU.
        """
        return self.add_to_scaled_all([total], scale, std)[0]

    def add_to_scaled_all(self, totals: list[torch.Tensor], scale: float, std: float) -> list[torch.Tensor]:
        """`add_to_scaled` of each of ``totals``. On CPU those it fills in place take one draw together: one
        keystream over all of them, formed in blocks that span tensors, so a model's small tensors cost no more
        than its large ones."""
        keystream = [total for total in totals if self._keystream_on(total)]
        if keystream:
            self._keystream_draw(keystream, std, scale)
        drawn = {id(total) for total in keystream}
        return [total if id(total) in drawn else self._add_to_scaled_apart(total, scale, std) for total in totals]

    def _add_to_scaled_apart(self, total: torch.Tensor, scale: float, std: float) -> torch.Tensor:
        if isinstance(total, FakeTensor) and total.dtype == torch.float32 and total.is_contiguous():
            return total.mul_(scale)
        if _fillable_in_place(total) and self._fused_on(total):  # never in secure mode: no fused keys
            return self._fused_draw(total, std, total, scale)
        return self.sample(total.shape, std, total.device).add_(total, alpha=scale)

    def _keystream_on(self, tensor: torch.Tensor) -> bool:
        """Whether draws into ``tensor`` come from the CPU keystream (a real fp32 contiguous CPU tensor)."""
        return self._cpu_key is not None and tensor.device.type == "cpu" and _fillable_in_place(tensor)

    def _keystream_draw(self, outs: list[torch.Tensor], std: float, scale: Optional[float] = None) -> None:
        assert self._cpu_key is not None
        keystream_normals_(outs, self._cpu_key, self._draws, std, scale)
        self._draws += 1

    def _fused_on(self, tensor: torch.Tensor) -> bool:
        """Whether draws into ``tensor`` take the fused kernel (a real tensor on this noise's device: a fake one, in
        a trace that models memory, takes the torch path)."""
        keys = self._fused_keys
        return keys is not None and type(tensor) is torch.Tensor and tensor.device == keys.device

    def _fused_draw(self, out: torch.Tensor, std: float, total: Optional[torch.Tensor] = None,
                    scale: float = 1.0) -> torch.Tensor:
        from lightning_longshield.privacy.fused_noise import keyed_noise_

        keyed_noise_(out, self._fused_keys, self._draws, std, total, scale)
        self._draws += 1
        return out

    def _step_generators(self) -> tuple[torch.Generator, ...]:
        if not self._generators:
            raise RuntimeError("GaussianNoise.start_step must position the generators before the first sample.")
        return self._generators

    def __repr__(self) -> str:
        source = "secure" if self.secure_mode else "seeded (reproducible)" if self.reproducible else "secret"
        return f"{type(self).__name__}({source})"


def _fillable_in_place(tensor: torch.Tensor) -> bool:
    """A real (not fake) contiguous fp32 tensor: what the keystream and the fused kernel draw into in place."""
    return type(tensor) is torch.Tensor and tensor.dtype == torch.float32 and tensor.is_contiguous()
