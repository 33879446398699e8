"""The clipped-gradient sum of one logical batch and its noisy release."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_longshield.dist_compat import reduce_scatter_single
from lightning_longshield.privacy.clipping import factors_toward_zero, zero_non_finite_
from lightning_longshield.privacy.noise import GaussianNoise
from lightning_longshield.privacy.shards import ParamShard, local_tensor


class ClippedGradientSum:
    """fp32 running sums, per parameter name, of clipped per-sample gradients over one logical batch.

    A sum has the shape of this rank's part of the parameter (its FSDP2 shard under context parallelism: the
    exchange hands over only that part). Every sample's scaled gradient is formed and added
    in fp32 (a bf16 product or sum could round a clipped contribution above ``C``). `release` adds Gaussian noise
    and sums over the ``D`` data-parallel groups: each group adds its own independent ``N(0, (sigma C)^2 / D)``
    before the all-reduce, so the sum carries exactly ``N(0, (sigma C)^2)`` per coordinate, every replica holds the
    identical result, and no process ever needs another's noise seed. It then divides by the expected logical batch
    size, writes ``param.grad`` (a DTensor shard for FSDP2 parameters) and resets the sums.

    With ``replica_shards`` (FSDP2 over data-parallel x context-parallel ranks, ``shard_over="all"``) each sum is this
    rank's padded part over the replicas of its data-parallel group (`ParamShard.replicas`): `release`
    reduce-scatters it over the data-parallel group, leaving every rank the sum of its own FSDP2 chunk, and adds
    ``N(0, (sigma C)^2)`` there. The chunks of all ranks are disjoint and cover the parameter: the noise enters once
    per coordinate.
    """

    def __init__(
        self,
        parameters: dict[str, nn.Parameter],
        data_parallel_group: Optional[dist.ProcessGroup] = None,
        replica_shards: Optional[dict[str, ParamShard]] = None,
    ) -> None:
        self.parameters = parameters
        self.data_parallel_group = data_parallel_group
        self.replica_shards = replica_shards or {}
        self.sums: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def add(self, grad_samples: dict[str, torch.Tensor], factors: torch.Tensor, sync_free: bool = False,
            dropped: Optional[bool] = None) -> None:
        """Add ``sum_i factors[i] * grad_samples[name][i]`` for every parameter, in fp32. ``factors`` is ``(B,)``
        (one factor a sample: flat clipping) or ``(P, B)``, one row per tensor of ``grad_samples`` in its order
        (per-layer clipping: each layer has its own).

        ``dropped``: whether some factor is 0, where the caller already knows it (factors computed on the host);
        ``None``: asked of ``factors`` where needed (a host sync).

        ``sync_free``: read no value on the host, for clipping during backward on a GPU, where a host sync per layer
        leaves the GPU idle until the next launches (1B, T 4096, micro-batch 2 on an H100: per-layer clipping took
        1.290x non-DP's step with one, against V2's 1.040x). Every tensor's inf and NaN are then zeroed
        unconditionally, one in-place pass each, instead of after a check for a factor 0, and the samples are added
        one at a time (`_add_each_sample`).

        Every sample's scaled gradient is formed in fp32 (a bf16 product or sum could round a clipped contribution
        above ``C``), never by a GEMM, whose TF32 or bf16 rounding could do the same. fp32 CPU gradients of several
        samples take one fp32 matrix-vector product per parameter, at full fp32 matmul precision only
        (`_add_by_matrix_vector`); otherwise whichever of two batched forms issues fewer ops: a sample at a time over
        all parameters (1 op per sample: many parameters, as in flat clipping), or a parameter at a time over all
        samples (2 ops per fp32 parameter: few parameters). The per-sample buffers are consumed: they belong to this
        micro-batch and die here. A sample with factor 0 adds exactly zero even where its gradient holds inf or NaN
        (`clip_factors`). fp64 factors are rounded to fp32 toward zero, never up (`factors_toward_zero`).
        """
        if not grad_samples:
            return
        factors = factors_toward_zero(factors)
        rows = factors.expand(len(grad_samples), -1) if factors.dim() == 1 else factors
        if rows.shape[0] != len(grad_samples):
            raise ValueError(f"{rows.shape[0]} rows of factors for {len(grad_samples)} per-sample gradients.")
        fp32 = all(grad.dtype == torch.float32 for grad in grad_samples.values())
        if sync_free:
            self._add_each_sample(grad_samples, rows, sync_free=True)
        elif fp32 and rows.shape[1] > 1 and _exact_cpu_matrix_vector(grad_samples.values()):
            self._add_by_matrix_vector(grad_samples, rows, dropped)
        elif 2 * len(grad_samples) < rows.shape[1] and fp32:
            self._add_each_parameter(grad_samples, rows)
        else:
            self._add_each_sample(grad_samples, rows, dropped=dropped)

    def _add_by_matrix_vector(self, grad_samples: dict[str, torch.Tensor], factors: torch.Tensor,
                              dropped: Optional[bool] = None) -> None:
        """fp32 CPU gradients: each parameter's ``sum_i factors[i] g_i`` added by one fp32 matrix-vector product
        (``addmv_``; ``mv`` for a first sum), which reads the per-sample gradients once, where the per-sample
        `torch._foreach_addcmul_` reads and writes the sums once per sample (3.1 against 4.9 ms a micro-batch of 4 at
        the tiny preset). Every product ``factors[i] g_i`` is formed in fp32 (or exactly, in a fused multiply-add)
        and summed in fp32, as by the per-sample path."""
        _zero_non_finite_if_any_dropped(grad_samples.values(), factors, dropped=dropped)
        for (name, grad), row in zip(grad_samples.items(), factors):
            columns = grad.view(grad.shape[0], -1).t()  # (numel, B): one column per sample
            total = self.sums.get(name)
            if total is None:
                self.sums[name] = torch.mv(columns, row).view(grad.shape[1:])
            else:
                total.view(-1).addmv_(columns, row)

    def _add_each_parameter(self, grad_samples: dict[str, torch.Tensor], factors: torch.Tensor) -> None:
        """fp32 gradients scaled in place by their row of factors and summed over the samples, a parameter at a
        time."""
        for (name, grad), row in zip(grad_samples.items(), factors):
            # A sample with factor 0 may hold inf or NaN: its scaled values are 0 or NaN, and nansum skips the NaNs.
            total = grad.mul_(row.view(-1, *(1,) * (grad.dim() - 1))).nansum(0)
            if name in self.sums:
                self.sums[name] += total
            else:
                self.sums[name] = total

    def _add_each_sample(
        self, grad_samples: dict[str, torch.Tensor], factors: torch.Tensor, sync_free: bool = False,
        dropped: Optional[bool] = None,
    ) -> None:
        """A sample at a time over all parameters: each sample's gradients are scaled by their factors (column ``i``
        of ``factors``, one per tensor) and added by one `torch._foreach_addcmul_` (one pass over each tensor),
        computed in fp32 (the sums' dtype) without an fp32 copy of a lower-precision gradient. Before the loop, inf
        and NaN are zeroed in each tensor if any factor is 0 (only such samples can hold them; one host sync per call
        decides, instead of a pass over every tensor; ``sync_free``: every tensor, without the check). With one
        sample and no sum yet, the scaled gradient (upcast if needed) becomes the sum itself."""
        names = list(grad_samples)
        batch = factors.shape[1]
        shared = factors.stride(0) == 0  # one factor per sample (flat clipping): the same scalar for every tensor
        # Every sample's views and factors are formed before the host sync below: a GPU idles from the sync to the
        # next launch, so only launches follow it (the views alone took about 1 ms at 146 tensors on an H200 host).
        samples = [([grad_samples[name][i] for name in names],
                    [factors[0, i]] * len(names) if shared else list(factors[:, i].unbind())) for i in range(batch)]
        missing = [name for name in names if name not in self.sums]
        if missing and batch > 1:
            device = grad_samples[missing[0]].device
            fresh = [torch.empty(grad_samples[n].shape[1:], dtype=torch.float32, device=device) for n in missing]
            torch._foreach_zero_(fresh)
            self.sums.update(zip(missing, fresh))
            missing = []
        _zero_non_finite_if_any_dropped(grad_samples.values(), factors, sync_free, dropped)
        for rows, scales in samples:
            if not missing:  # one pass per tensor: sums += factor x gradient, formed in fp32
                torch._foreach_addcmul_([self.sums[name] for name in names], rows, scales)
                continue
            if any(row.dtype != torch.float32 for row in rows):  # one sample, first sums: fp32 copies become the sums
                rows = [row.float() for row in rows]
            # One factor for all tensors: the single-tensor overload, which CUDA runs as one vectorised multi-tensor
            # kernel (a list of 0-d factors took an unvectorised kernel per tensor).
            torch._foreach_mul_(rows, scales[0] if shared else scales)
            scaled = dict(zip(names, rows))
            self.sums.update((name, scaled.pop(name)) for name in missing)
            if scaled:
                torch._foreach_add_([self.sums[name] for name in scaled], list(scaled.values()))
            del rows, scaled  # hold no scaled copy into the next sample's work

    def running_sum(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The fp32 sum of ``name`` (zeros of ``shape`` if it has none yet), for a kernel that adds into it."""
        if name not in self.sums:
            self.sums[name] = torch.zeros(shape, dtype=torch.float32, device=device)
        return self.sums[name]

    @torch.no_grad()
    def add_sums(self, clipped_sums: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Add already clipped fp32 sums over a micro-batch's samples (book-keeping), this rank's part of each, as
        they are produced (one at a time: a producer that forms them lazily never holds them all)."""
        for name, total in clipped_sums:
            if name in self.sums:
                self.sums[name] += total
            else:
                self.sums[name] = total

    @torch.no_grad()
    def release(self, noise: GaussianNoise, noise_std: float, expected_batch_size: float) -> None:
        """Privatise the sums into ``param.grad`` and start a new logical batch."""
        replicas = 1 if self.data_parallel_group is None else dist.get_world_size(self.data_parallel_group)
        local = {name: local_tensor(param) for name, param in self.parameters.items()}
        means = self._noisy_means(  # every sum noised first, in place: one draw for all on CPU
            {name: self.sums.pop(name, None) for name in self.parameters if name not in self.replica_shards},
            local, noise, noise_std / replicas**0.5, expected_batch_size,
        )
        for name, param in self.parameters.items():
            if name in self.replica_shards:
                chunk = self._reduce_scatter_chunk(name, self.sums.pop(name, None), local[name])
                mean = self._noisy_means({name: chunk}, local, noise, noise_std, expected_batch_size)[name]
                param.grad = _like_parameter(param, mean.to(param.dtype))
                continue
            mean = means.pop(name)  # its fp32 sum is freed once converted: no second copy of every sum
            if self.data_parallel_group is not None:
                dist.all_reduce(mean, group=self.data_parallel_group)
            param.grad = _like_parameter(param, mean.to(param.dtype))
        self.sums.clear()

    @staticmethod
    def _noisy_means(
        totals: dict[str, Optional[torch.Tensor]], local: dict[str, torch.Tensor], noise: GaussianNoise,
        noise_std: float, batch_size: float,
    ) -> dict[str, torch.Tensor]:
        """``(total + N(0, noise_std^2)) / batch_size`` of each sum (noise alone for a parameter without one, of its
        local shape), formed as the sum scaled by ``1 / batch_size`` plus noise of std ``noise_std / batch_size`` in
        one pass (the same distribution, two passes over the parameter fewer; in place on CPU and through the fused
        CUDA kernel, `GaussianNoise.add_to_scaled_all`)."""
        if noise_std == 0:
            return {name: (torch.zeros(local[name].shape, dtype=torch.float32, device=local[name].device)
                           if total is None else total).div_(batch_size).contiguous()
                    for name, total in totals.items()}
        present = {name: total for name, total in totals.items() if total is not None}
        means = dict(zip(present, noise.add_to_scaled_all(list(present.values()), 1.0 / batch_size,
                                                          noise_std / batch_size)))
        for name in (name for name in totals if name not in present):
            means[name] = noise.sample(local[name].shape, noise_std / batch_size, local[name].device)
        return {name: means[name] for name in totals}

    def _reduce_scatter_chunk(self, name: str, total: Optional[torch.Tensor], local: torch.Tensor) -> torch.Tensor:
        """The sum of this rank's FSDP2 chunk: its replicas' parts reduce-scattered over the data-parallel group
        (the noise is then added once, to the chunk)."""
        shard = self.replica_shards[name]
        if total is None:
            shape = list(local.shape)
            shape[shard.dim] = shard.replicas * shard.chunk_size
            total = torch.zeros(shape, dtype=torch.float32, device=local.device)
        chunks = shard.data_parallel_chunks_first(total)
        chunk = torch.empty_like(chunks[:1])
        reduce_scatter_single(chunk, chunks, group=self.data_parallel_group)
        return chunk[0].narrow(shard.dim, 0, local.shape[shard.dim]).contiguous()


def _exact_cpu_matrix_vector(grads: Iterable[torch.Tensor]) -> bool:
    """Whether the clipped sums may be formed by fp32 matrix-vector products: contiguous CPU tensors, with fp32
    matrix products at full precision (``torch.set_float32_matmul_precision("high")`` or lower, or
    ``torch.backends.fp32_precision = "bf16"``, lets oneDNN run fp32 products in bf16 on CPUs with AMX, which could
    round a clipped contribution above ``C``)."""
    # The tensors first: the precision setting is a slower query, and moot off CPU.
    return all(grad.device.type == "cpu" and grad.is_contiguous() for grad in grads) and _full_precision_cpu_matmuls()


def _full_precision_cpu_matmuls() -> bool:
    """Whether CPU fp32 matrix products run in fp32. Read from ``torch.backends.mkldnn.matmul.fp32_precision``, which
    every setting reaches (the legacy `torch.set_float32_matmul_precision` and the global and oneDNN
    ``fp32_precision`` alike; ``"none"`` inherits the default), and never `torch.get_float32_matmul_precision`
    where it exists: that raises once the newer API has been used. torch releases without it have only the legacy
    setting."""
    precision = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", None)
    if precision is None:
        return torch.get_float32_matmul_precision() == "highest"
    return precision in ("none", "ieee")


def _zero_non_finite_if_any_dropped(
    grads: Iterable[torch.Tensor], factors: torch.Tensor, sync_free: bool = False, dropped: Optional[bool] = None
) -> None:
    """Zero inf and NaN in every per-sample gradient, in place, if some sample has factor 0: only such a sample may
    hold them, and ``0 x inf`` would be NaN in its scaled contribution. ``sync_free``: zero them without asking (the
    question is a host sync); ``dropped``: the answer, where the caller knows it."""
    if sync_free or (_any_zero(factors) if dropped is None else dropped):
        for grad in grads:
            zero_non_finite_(grad)


def _any_zero(factors: torch.Tensor) -> bool:
    """Whether some sample has factor 0 (a host sync); ``True`` where the value cannot be read (a fake-tensor trace,
    which then counts the zeroing pass)."""
    try:
        return bool((factors == 0).any())
    except RuntimeError:  # data-dependent output of a fake tensor
        return True


def _like_parameter(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient for ``param``: wrapped as a DTensor shard when the parameter is one."""
    if not hasattr(param, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
