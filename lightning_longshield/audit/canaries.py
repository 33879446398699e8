"""Canaries for a one-run audit: records inserted into the training data, each with probability 1/2.

- `GradientCanaries` (white box): canary ``i``'s per-sample gradient is ``magnitude`` on one coordinate ``c_i`` of
  the trainable parameters alone (a Dirac canary), an entry of the output layer's weight reached through a call of
  that layer where it trains. It is sampled, clipped and noised like every record; its score is the sum over steps
  of the released (noisy, clipped, averaged) gradient at ``c_i``.
- `InputCanaries` (black box): canary ``i`` is a random token sequence; its score is minus its loss on the trained
  model.

The inclusion draws come from the audit's own generator, independent of the run's (secret) noise and sampling.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from lightning_longshield.privacy.poisson import CollateAllowingEmpty

CANARY_KEY = "canary"  # index of the canary a record is, -1 for the run's own records
EXCLUDED = -2  # the index of an excluded canary's filler record (`WithCanaries`)


@dataclass
class Canaries:
    """``m`` canaries, each included in the training data with probability 1/2 (``included``). The inclusion bits
    must be independent of everything else in the run, the canaries themselves included: with ``seed=None`` (the
    default) they are ``m`` bits of OS entropy, and ``seed`` (then drawn from OS entropy too, and reported) only
    places the canaries (coordinates, tokens). A given seed fixes the canaries and their bits too (known beforehand to
    whoever knows the seed): for tests and reruns. The run's noise and sampling stay fresh, so the bound still varies
    from run to run."""

    m: int
    seed: Optional[int] = None
    included: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        if self.m < 2:
            raise ValueError(f"m={self.m}: an audit needs canaries to guess about; pass m of a few hundred or more.")
        if self.seed is None:
            self.seed = secrets.randbits(53)  # read exactly by JSON parsers that hold numbers as doubles
            bits = secrets.randbits(self.m)
            self.included = [bool(bits >> index & 1) for index in range(self.m)]
        else:
            generator = torch.Generator().manual_seed(self.seed)
            self.included = (torch.rand(self.m, generator=generator) < 0.5).tolist()

    @property
    def inserted(self) -> list[int]:
        """The indices of the included canaries, the records added to the data."""
        return [index for index, chosen in enumerate(self.included) if chosen]


@dataclass
class GradientCanaries(Canaries):
    """White-box Dirac canaries: canary ``i`` adds ``magnitude`` to coordinate ``coordinates[i]`` of the flattened
    trainable parameters (chosen at random, distinct). ``magnitude`` above the clipping bound makes clipping part of
    what is audited.

    Where the module has a trainable output layer without a trainable bias (``module.model.output``, an `nn.Linear`),
    the coordinates are entries ``(k, j)`` of its weight and the canary's gradient comes from a call of that layer on
    the one-hot input ``e_j``, so per-sample gradients take the run's own path at any micro-batch size (``layer``
    names it); else they are anywhere among the trainable parameters, and one sample per micro-batch is needed."""

    magnitude: float = 1.0
    coordinates: list[tuple[str, int]] = field(default_factory=list)
    layer: Optional[nn.Linear] = None

    def place(self, module: nn.Module) -> None:
        """Choose the canaries' coordinates: in the output layer's weight where it trains, else among all of
        ``module``'s trainable parameters."""
        head = getattr(getattr(module, "model", None), "output", None)
        # A trainable bias would take part of each canary's gradient (the entry of its row), shared among canaries.
        bias_trains = isinstance(head, nn.Linear) and head.bias is not None and head.bias.requires_grad
        if isinstance(head, nn.Linear) and head.weight.requires_grad and not bias_trains \
                and head.weight.numel() >= self.m:
            name = next(n for n, p in module.named_parameters() if p is head.weight)
            self.layer = head
            self.coordinates = [(name, index) for index in self._distinct(head.weight.numel())]
            return
        parameters = [(name, p.numel()) for name, p in module.named_parameters() if p.requires_grad]
        total = sum(size for _, size in parameters)
        if total < self.m:
            raise ValueError(f"m={self.m} canaries need as many trainable coordinates; the model has {total}.")
        flat = self._distinct(total)
        starts, position = [], 0
        for name, size in parameters:
            starts.append((position, name, size))
            position += size
        self.coordinates = [next((name, index - start) for start, name, size in starts if index < start + size)
                            for index in flat]


    def _distinct(self, total: int) -> list[int]:
        """``m`` distinct indices below ``total``, uniformly, drawn from the audit's seed, in memory of ``m`` (not a
        permutation of ``total``: a large model's output layer has billions of entries)."""
        generator = torch.Generator().manual_seed(self.seed + 1)
        chosen: dict[int, None] = {}  # in order of drawing
        while len(chosen) < self.m:
            for index in torch.randint(total, (2 * (self.m - len(chosen)),), generator=generator).tolist():
                if len(chosen) < self.m:
                    chosen.setdefault(index)
        return list(chosen)


@dataclass
class InputCanaries(Canaries):
    """Black-box canaries: canary ``i`` is a sequence of ``seq_len`` tokens drawn uniformly from ``vocab_size``."""

    seq_len: int = 64
    vocab_size: int = 256
    tokens: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        generator = torch.Generator().manual_seed(self.seed + 2)
        self.tokens = torch.randint(0, self.vocab_size, (self.m, self.seq_len + 1), generator=generator)

    def record(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index, :-1], "labels": self.tokens[index, 1:]}


class WithCanaries(Dataset):
    """The run's ``N`` records (their index under `CANARY_KEY` is -1) followed by one record per canary: canary
    ``i``'s where it is included, else a filler that trains nothing (its labels all ignored, index `EXCLUDED`). The
    length, ``N + m``, and with it the sampling rate, the default delta and a calibrated noise multiplier, is then the
    same whatever the inclusion bits: nothing but the DP mechanism's output depends on them. `WithoutFillers` drops
    the fillers a batch draws before they cost any compute (they would add exactly zero)."""

    def __init__(self, records: Dataset, canaries: Canaries,
                 canary_record: Optional[Callable[[int], dict[str, Any]]] = None) -> None:
        """``canary_record``: canary ``i``'s record (`InputCanaries.record`); by default one shaped like the run's
        own records whose labels are all ignored (gradient canaries ignore the record; it only has to collate)."""
        self.records, self.canaries = records, canaries
        self.canary_record = canary_record or self.gradient_record
        first = records[0]
        if not isinstance(first, dict) or "input_ids" not in first:
            raise TypeError("An audit inserts canaries among records that are dicts with 'input_ids' (and 'labels').")
        self._template = first
        if hasattr(records, "seq_len"):  # the public length the pre-flight plans with
            self.seq_len = records.seq_len

    def __len__(self) -> int:
        return len(self.records) + self.canaries.m  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> dict[str, Any]:
        own = len(self.records)  # type: ignore[arg-type]
        if index < own:
            return {**self.records[index], CANARY_KEY: torch.tensor(-1)}
        canary = index - own
        if not self.canaries.included[canary]:
            return {**self.gradient_record(canary), CANARY_KEY: torch.tensor(EXCLUDED)}
        return {**self.gradient_record(canary), **self.canary_record(canary), CANARY_KEY: torch.tensor(canary)}

    def gradient_record(self, canary: int) -> dict[str, Any]:
        """A record shaped like the run's own (so that batches collate; an input canary's tokens replace its
        ``input_ids`` and ``labels``), its labels all ignored: a gradient canary's (the canary term gives its
        gradient) and an excluded canary's filler (no gradient at all). Every token is attended to and positions
        count from 0; other fields are zeros (none is copied from the run's records)."""
        return {key: _public_field(key, value) for key, value in self._template.items()
                if isinstance(value, torch.Tensor)}


def _public_field(key: str, like: torch.Tensor) -> torch.Tensor:
    """A canary record's ``key``, shaped like ``like`` (the run's first record's)."""
    if key == "labels":
        return torch.full_like(like, -100)
    if key == "attention_mask":
        return torch.ones_like(like)
    if key == "position_ids" and like.dim():
        return torch.arange(like.shape[-1], dtype=like.dtype).expand(like.shape).clone()
    return torch.zeros_like(like)


class WithoutFillers:
    """A collate function for `WithCanaries`: the sampled records without excluded canaries' fillers, collated by
    ``collate_fn``; none left, a batch of no records. Each record is still sampled on its own at the rate over all
    ``N + m``; a filler adds exactly zero to the release, so leaving it out changes no output. A class, so that
    DataLoader workers can pickle it."""

    def __init__(self, dataset: Dataset, collate_fn: Callable[[list[Any]], Any] = default_collate) -> None:
        self.empty_allowed = CollateAllowingEmpty(dataset, collate_fn)

    def __call__(self, records: list[dict[str, Any]]) -> Any:
        return self.empty_allowed([record for record in records if int(record[CANARY_KEY]) != EXCLUDED])


class CanaryScores(pl.Callback):
    """Adds, at every DP step, the released gradient at each gradient canary's coordinate to its score (the private
    gradient: `on_before_optimizer_step` runs after the noisy release)."""

    def __init__(self, canaries: GradientCanaries) -> None:
        self.canaries = canaries
        self.scores = torch.zeros(canaries.m, dtype=torch.float64)
        self._by_parameter: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name in {name for name, _ in canaries.coordinates}:
            indices = [(i, offset) for i, (owner, offset) in enumerate(canaries.coordinates) if owner == name]
            self._by_parameter[name] = (torch.tensor([i for i, _ in indices]), torch.tensor([o for _, o in indices]))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        parameters = dict(pl_module.named_parameters())
        for name, (canary_indices, offsets) in self._by_parameter.items():
            grad = parameters[name].grad
            if grad is None:
                continue
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            self.scores[canary_indices] += local.detach().reshape(-1)[offsets.to(local.device)].double().cpu()


def insert_gradient_canaries(module: pl.LightningModule, canaries: GradientCanaries) -> None:
    """Make ``module``'s training step give each canary record its Dirac gradient (``magnitude`` at ``c_i``, nothing
    elsewhere: its tokens' labels are all ignored) and the run's own records their usual loss.

    With an output layer (`GradientCanaries.layer`) the step adds ``magnitude x layer(x)[b, k_b] / B`` for a one-hot
    ``x[b] = e_{j_b}`` on canary rows (zero rows elsewhere): one more call of the layer, whose per-sample gradient the
    strategy captures as for any call. Otherwise a canary's loss is ``magnitude x theta[c_i]`` itself, which needs one
    sample per micro-batch (the canary's gradient is then the micro-batch's)."""
    step = module.training_step
    parameters = {name: p for name, p in module.named_parameters() if p.requires_grad}
    layer = canaries.layer

    def through_layer(canary: torch.Tensor, output: Any) -> Any:
        """The step's output with the canaries' term added to its loss (``output["loss"]`` of a mapping)."""
        assert layer is not None
        if isinstance(output, Mapping):
            return {**output, "loss": through_layer(canary, output["loss"])}
        rows = canary.reshape(-1) >= 0
        width = layer.in_features
        offsets = torch.tensor([canaries.coordinates[int(i)][1] if i >= 0 else 0 for i in canary.reshape(-1)],
                               device=layer.weight.device)
        x = torch.zeros(rows.numel(), 1, width, device=layer.weight.device, dtype=layer.weight.dtype)
        x[rows, 0, offsets[rows] % width] = 1.0
        picked = layer(x)[:, 0, :].gather(1, (offsets // width)[:, None]).squeeze(1)
        return output + canaries.magnitude * (picked * rows).sum() / rows.numel()

    def training_step(batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        canary = batch.pop(CANARY_KEY)
        if layer is not None:
            return through_layer(canary, step(batch, batch_idx, *args, **kwargs))
        if canary.numel() != 1:
            raise ValueError("These gradient canaries need LongShieldStrategy(micro_batch_size=1): a canary's"
                             " gradient is its micro-batch's (the model has no trainable output layer to use).")
        index = int(canary.reshape(()))
        if index < 0:
            return step(batch, batch_idx, *args, **kwargs)
        name, offset = canaries.coordinates[index]
        untouched = sum(p.reshape(-1)[0] * 0.0 for p in parameters.values())
        return canaries.magnitude * parameters[name].reshape(-1)[offset] + untouched

    module.training_step = training_step  # type: ignore[method-assign]


def loss_scores(module: pl.LightningModule, canaries: InputCanaries,
                loss: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]) -> list[float]:
    """Black-box scores: minus each canary's loss on the trained ``module`` (a member should have a lower loss), in
    evaluation mode (the module's mode is given back)."""
    training = module.training
    module.eval()
    device = next(module.parameters()).device  # the trained model stays where it trained
    try:
        with torch.no_grad():
            return [-float(loss(module, {key: value.to(device) for key, value in canaries.record(index).items()}))
                    for index in range(canaries.m)]
    finally:
        module.train(training)


def guess_candidates(m: int, fractions: Sequence[float] = (0.02, 0.05, 0.1, 0.2, 0.4)) -> list[tuple[int, int]]:
    """``(k_plus, k_minus)`` pairs to choose among (the union bound pays for each): guess "in" for the top
    ``fraction x m`` scores, alone and with as many "out" guesses at the bottom."""
    sizes = sorted({max(1, int(round(fraction * m))) for fraction in fractions})
    return [(k, 0) for k in sizes] + [(k, k) for k in sizes if 2 * k <= m]
