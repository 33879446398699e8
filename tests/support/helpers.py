"""Shared test fixtures: small datasets, an independent per-sample-loop DP-SGD reference, trainer factory."""

from __future__ import annotations

import collections
import copy
import gc
import json
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, Dataset

from lightning_longshield import CausalLMModule, LongShieldStrategy
from lightning_longshield.models import LlamaConfig

SMALL = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=256,
             rope_theta=10000.0)


def small_config(**overrides: Any) -> LlamaConfig:
    return LlamaConfig(**{**SMALL, **overrides})


class RandomTokens(Dataset):
    """Random token sequences; ``ignore_fraction`` of the labels of every other sample are -100, and one sample
    (index 3) is fully ignored."""

    def __init__(self, size: int = 16, seq_len: int = 16, vocab: int = 64, ignore: bool = True, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab, (size, seq_len + 1), generator=generator)
        self.input_ids, self.labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        if ignore:
            self.labels[::2, : seq_len // 3] = -100
            if size > 3:
                self.labels[3] = -100

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}


def write_sentencepiece_tokenizer(directory: Path, texts: list[str], vocab_size: int = 200) -> None:
    """A Llama-2-style tokenizer saved only as ``tokenizer.model`` (SentencePiece BPE, trained on ``texts``) and
    ``tokenizer_config.json``: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, a BOS added to every text."""
    import sentencepiece

    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / "corpus.txt"
    corpus.write_text("".join(texts), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(directory / "tokenizer"),
                                             vocab_size=vocab_size, model_type="bpe", unk_id=0, bos_id=1, eos_id=2,
                                             pad_id=-1, minloglevel=2)
    corpus.unlink()
    (directory / "tokenizer.vocab").unlink()
    (directory / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="LlamaTokenizer", bos_token="<s>", eos_token="</s>", unk_token="<unk>", add_bos_token=True)))


# Trainers' root directories (a saved checkpoint's privacy ledger goes there) live under one directory per process,
# removed when the process exits (`process_runner` removes its forked workers'): a run of the suite creates thousands.
TRAINER_ROOTS = tempfile.TemporaryDirectory(prefix="longshield-tests-")


def make_trainer(strategy: LongShieldStrategy, max_steps: int, **kwargs: Any) -> L.Trainer:
    defaults = dict(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=tempfile.mkdtemp(dir=TRAINER_ROOTS.name),
    )
    return L.Trainer(strategy=strategy, **{**defaults, **kwargs})


def make_module(config: LlamaConfig, seed: int = 0, **kwargs: Any) -> CausalLMModule:
    """A module whose model is built now (same init for the same seed), so a reference copy can be taken."""
    torch.manual_seed(seed)
    module = CausalLMModule(config, **{"optimizer": "sgd", "learning_rate": 1.0, **kwargs})
    module.configure_model()
    return module


def make_lora_module(config: LlamaConfig, seed: int = 0, module_kwargs: Optional[dict[str, Any]] = None,
                     **lora: Any) -> CausalLMModule:
    """`make_module` (with ``module_kwargs``) with LoRA adapters whose B is drawn at random (PEFT starts B at zero,
    which would make every A gradient zero and the exactness tests vacuous for A)."""
    from lightning_longshield.lora import LoraOptions

    module = make_module(config, seed, lora=LoraOptions(**{"rank": 4, **lora}), **(module_kwargs or {}))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in module.model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return module


def loader(dataset: Dataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


def reference_sample_loss(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One sample's loss, written independently of the library: mean token cross-entropy over labelled tokens."""
    logits = model(input_ids[None])[0].double()
    mask = labels != -100
    if not mask.any():
        return logits.sum() * 0.0
    log_probs = torch.log_softmax(logits[mask], dim=-1)
    return -log_probs.gather(1, labels[mask][:, None]).mean()


def reference_dp_sgd(
    model: torch.nn.Module,
    batches: list[list[dict[str, torch.Tensor]]],
    max_grad_norm: float,
    expected_batch_size: int,
    learning_rate: float = 1.0,
    noise: Optional[list[dict[str, torch.Tensor]]] = None,
    layer_thresholds: Optional[Mapping[str, float]] = None,
) -> torch.nn.Module:
    """Plain DP-SGD on an unsharded copy: for each batch, a per-sample loop, flat clipping (or, with
    ``layer_thresholds`` {parameter name: C_l}, each parameter's gradient clipped to its own C_l), sum, (noise), SGD."""
    model = copy.deepcopy(model)
    named = {name: p for name, p in model.named_parameters() if p.requires_grad}  # a tied weight once
    params = list(named.values())
    for step, batch in enumerate(batches):
        total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
        for sample in batch:
            grads = torch.autograd.grad(
                reference_sample_loss(model, sample["input_ids"], sample["labels"]), params, allow_unused=True
            )
            grads = [torch.zeros_like(p).double() if g is None else g.double() for p, g in zip(params, grads)]
            if layer_thresholds is None:
                factors = [_clip_factor(torch.sqrt(sum(g.pow(2).sum() for g in grads)), max_grad_norm)] * len(grads)
            else:
                factors = [_clip_factor(g.norm(), layer_thresholds[name]) for name, g in zip(named, grads)]
            for t, g, factor in zip(total, grads, factors):
                t += factor * g
        with torch.no_grad():
            for i, (p, t) in enumerate(zip(params, total)):
                if noise is not None:
                    t = t + noise[step][i]
                p -= learning_rate * (t / expected_batch_size).to(p.dtype)
    return model


def layer_bounds(model: torch.nn.Module, max_grad_norm: float, rule: str = "equal") -> dict[str, float]:
    """Per-layer bounds for `reference_dp_sgd`, computed independently: over the L trainable parameter tensors (a tied
    weight once) ``"equal"`` gives C / sqrt(L), ``"proportional"`` C sqrt(n_l / sum n)."""
    counts = {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}
    if rule == "equal":
        return {name: max_grad_norm / len(counts) ** 0.5 for name in counts}
    assert rule == "proportional", rule
    return {name: max_grad_norm * (n / sum(counts.values())) ** 0.5 for name, n in counts.items()}


def _clip_factor(norm: torch.Tensor, bound: float) -> float:
    return min(1.0, bound / norm.item()) if norm > 0 else 1.0


def samples(dataset: Dataset, indices: range) -> list[dict[str, torch.Tensor]]:
    return [dataset[i] for i in indices]


def full_state(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A detached, unsharded copy of a model's state: FSDP2's DTensor shards (at any CP size) gathered whole."""
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    return {name: whole(value).detach().clone()
            for name, value in state.items()}


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient as one plain tensor (an FSDP2 DTensor shard gathered whole)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def flat_parameters(module: torch.nn.Module) -> torch.Tensor:
    """Every parameter of ``module``, whole and detached, in one flat vector."""
    return torch.cat([whole(p).detach().flatten().clone() for p in module.parameters()])


def assert_models_close(
    actual: torch.nn.Module | Mapping[str, torch.Tensor],
    expected: torch.nn.Module | Mapping[str, torch.Tensor],
    rtol: float = 1e-4,
    atol: float = 1e-6,
):
    expected_state = full_state(expected)
    for name, value in full_state(actual).items():
        torch.testing.assert_close(
            value, expected_state[name], rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )


def live_tensor_count() -> int:
    """Tensors reachable by the garbage collector, after a collection."""
    gc.collect()
    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


class CountLiveTensors(Callback):
    """Record :func:`live_tensor_count` at the end of the given optimizer steps, in ``counts``."""

    def __init__(self, steps: tuple[int, ...]) -> None:
        self.steps, self.counts = steps, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step in self.steps:
            self.counts[trainer.global_step] = live_tensor_count()


@contextmanager
def cpu_matmul_precision(precision: str) -> Iterator[None]:
    """CPU fp32 matrix products at ``precision`` (``torch.backends.mkldnn.matmul.fp32_precision``: "ieee", "tf32",
    "bf16") inside the block, restored after it."""
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = precision
    try:
        yield
    finally:
        matmul.fp32_precision = before


class AtenOpCounts(TorchDispatchMode):
    """Counts the aten ops run under it by name (``counts["linalg_vector_norm"]``), fake tensors included."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
