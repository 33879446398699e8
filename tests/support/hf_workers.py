"""Worker for the multi-process Hugging Face checkpoint test (run by tests/hf/test_hf_checkpoint.py).

Every rank loads the checkpoint whole (the reference), then builds the model on the meta device, shards it with
FSDP2 and materialises it from the checkpoint, each rank reading only its shards; an assertion on any rank fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_longshield import hf
from lightning_longshield.parallelize import materialize_meta_parameters, shard_with_fsdp

EXACT = dict(rtol=0, atol=0)


def check_sharded_load(rank: int, world_size: int, directory: str, export_directory: str) -> None:
    """Row (Shard(0)) and column (Shard(1), ``shard_linear_inputs``) shards equal the reference's slices; the
    sharded model computes the reference's logits and exports the same checkpoint."""
    torch.set_num_threads(1)
    reference = hf.load_model(directory)
    expected = dict(reference.named_parameters())
    mesh = init_device_mesh("cpu", (world_size,))
    ids = torch.randint(0, reference.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    for shard_linear_inputs in (False, True):
        model = hf.load_model(directory, device="meta")
        holder = nn.ModuleDict({"model": model})  # as a LightningModule holds it: the model is sharded whole
        shards = shard_with_fsdp(holder, mesh, shard_linear_inputs=shard_linear_inputs)
        assert materialize_meta_parameters(holder, torch.device("cpu"), rank)
        for name, param in model.named_parameters():
            shard = shards[f"model.{name}"]
            torch.testing.assert_close(param.to_local(), shard.take(expected[name]), **EXACT)
            torch.testing.assert_close(param.full_tensor(), expected[name], **EXACT)
        dims = {shard.dim for shard in shards.values()}
        assert dims == ({0, 1} if shard_linear_inputs else {0}), dims
        with torch.no_grad():
            torch.testing.assert_close(model(ids), reference(ids), rtol=1e-5, atol=1e-5)
    hf.save_pretrained(model, export_directory, max_shard_size="8KB")  # all ranks gather, rank 0 writes shards
    assert Path(export_directory, "model.safetensors.index.json").is_file()
    for name, param in hf.load_model(export_directory).named_parameters():
        torch.testing.assert_close(param, expected[name], **EXACT)
    # Rank 0 failing between two shards still takes part in the other gathers: every rank raises, none hangs.
    import safetensors.torch

    save_file, saved = safetensors.torch.save_file, []

    def disk_full_at_the_second_shard(tensors, filename, metadata=None):
        if saved:
            raise OSError("No space left on device")
        saved.append(filename)
        save_file(tensors, filename, metadata=metadata)

    safetensors.torch.save_file = disk_full_at_the_second_shard
    expected_error = (OSError, "No space left") if rank == 0 else (RuntimeError, "failed on rank 0")
    with pytest.raises(expected_error[0], match=expected_error[1]):
        hf.save_pretrained(model, Path(export_directory, "full"), max_shard_size="8KB")
    safetensors.torch.save_file = save_file
    # An export that fails on rank 0 (a malformed index there) fails on every rank, none left waiting for it.
    broken = Path(export_directory, "broken")
    if rank == 0:
        broken.mkdir()
        (broken / "model.safetensors.index.json").write_text("not json")
    expected_error = (ValueError, "is not a safetensors index") if rank == 0 else (RuntimeError, "failed on rank 0")
    with pytest.raises(expected_error[0], match=expected_error[1]):
        hf.save_pretrained(model, broken)


def fine_tune_from_directory(rank: int, world_size: int, directory: str, out_path: str) -> None:
    """`CausalLMModule(config=directory)` built by the strategy under CP ``world_size`` (meta device, each rank
    reading its shards), two DP steps; rank 0 saves the gathered full state."""
    from tests.support.helpers import full_state

    strategy, module = fine_tune(directory, world_size)
    state = full_state(strategy.lightning_module_state_dict())
    if rank == 0:
        torch.save({k.removeprefix("model."): v for k, v in state.items()}, out_path)


def fine_tune(directory: str, world_size: int = 1):
    """Two noise-free DP-SGD steps (lr 1, clipping active) of the checkpoint in ``directory`` on fixed batches."""
    from lightning_longshield import CausalLMModule, LongShieldStrategy
    from tests.support.helpers import RandomTokens, loader, make_trainer

    module = CausalLMModule(directory, optimizer="sgd", learning_rate=1.0)
    strategy = LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=0.05, micro_batch_size=2, poisson_sampling=False,
                                  seed=0, context_parallel_size=world_size)
    make_trainer(strategy, max_steps=2, devices=world_size).fit(module, loader(RandomTokens(size=8, vocab=96), 4))
    return strategy, module
