"""`audit_training`: train once with canaries among the records, score them, and turn the guesses into an empirical
lower bound on epsilon (Steinke, Nasr and Jagielski, 2023) beside the accountant's claim."""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Literal, Optional

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset

from lightning_longshield.audit.bounds import best_epsilon_lower_bound, largest_reportable_bound
from lightning_longshield.audit.canaries import (
    CANARY_KEY,
    CanaryScores,
    GradientCanaries,
    InputCanaries,
    WithCanaries,
    WithoutFillers,
    guess_candidates,
    insert_gradient_canaries,
    loss_scores,
)
from lightning_longshield.loss import causal_lm_loss

log = logging.getLogger("lightning_longshield")

CanaryType = Literal["gradient", "input"]

#: `LongShieldStrategy` arguments of the process layout, launch and bookkeeping alone, which an audit (one process, no
#: checkpoints) runs without: the DP mechanism (clipping, noise, sampling rate) does not depend on them.
LAYOUT_OPTIONS = ("context_parallel_size", "shard_over", "exchange", "overlap_communication", "communication_bucket_mb",
                  "parallel_devices", "cluster_environment", "process_group_backend", "timeout", "start_method",
                  "checkpoint_format", "async_checkpoints", "privacy_ledger")


@dataclass(frozen=True)
class AuditReport:
    """What one audited run shows: the accountant's epsilon and the empirical lower bound at ``confidence``."""

    canary_type: str
    m: int
    inserted: int
    claimed_epsilon: float
    epsilon_lower_bound: float
    confidence: float
    delta: float
    guesses: int
    correct: int
    steps: int
    scale: str
    #: ``(k, fraction of the k highest-scoring canaries that were inserted)``, k up to half the canaries.
    top_guess_accuracy: tuple[tuple[int, float], ...] = ()
    #: The most this audit could report (every guess right): a claim at or above it cannot be shown broken.
    largest_reportable_bound: float = math.inf
    #: The seed that placed the canaries (OS entropy unless given); a seed given beforehand also fixed their
    #: inclusion bits (else bits of OS entropy of their own). The run's noise and sampling are fresh either way.
    canary_seed: Optional[int] = None

    @property
    def can_refute_claim(self) -> bool:
        """Whether a bound above the claimed epsilon was reachable at this audit's size and confidence."""
        return self.largest_reportable_bound > self.claimed_epsilon

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: Optional[int] = 2) -> str:
        """The report as strict JSON: a non-finite number (the claimed epsilon of a run without noise) is ``null``."""
        return json.dumps(_finite_or_none(self.to_dict()), indent=indent, allow_nan=False)

    def plot(self, path: str) -> None:
        """The guess-accuracy curve beside chance and the most an (epsilon, 0)-DP run at the claimed epsilon allows,
        ``e^eps / (1 + e^eps)``, saved to ``path`` (needs matplotlib)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("Plotting the audit needs matplotlib: pip install matplotlib.") from None
        figure, axes = plt.subplots(figsize=(6, 4))
        ks, accuracy = zip(*self.top_guess_accuracy)
        axes.plot(ks, accuracy, marker="o", label="top-k guesses right")
        axes.axhline(0.5, color="grey", linestyle=":", label="chance")
        if math.isfinite(self.claimed_epsilon):
            ceiling = 1.0 / (1.0 + math.exp(-self.claimed_epsilon))
            axes.axhline(ceiling, color="red", linestyle="--", label=f"most at epsilon {self.claimed_epsilon:.2f}")
        axes.set(xlabel="guesses k (highest scores)", ylabel="fraction right", ylim=(0.4, 1.02),
                 title=f"{self.canary_type} canaries: lower bound {self.epsilon_lower_bound:.2f}")
        axes.legend(loc="lower left")
        figure.tight_layout()
        figure.savefig(path)
        plt.close(figure)

    def summary(self) -> str:
        kind = "white-box gradient" if self.canary_type == "gradient" else "black-box input"
        return (f"Audit ({kind} canaries, m={self.m}, {self.inserted} inserted, {self.steps} DP steps, {self.scale}):"
                f" claimed epsilon={self.claimed_epsilon:.3f} at delta={self.delta:.3g}; empirical lower bound"
                f" {self.epsilon_lower_bound:.3f} at {100 * self.confidence:.4g}% confidence ({self.correct} of"
                f" {self.guesses} guesses correct). A lower bound is evidence, not proof: it can only show a"
                " guarantee broken (lower bound above the claim), never that it holds." + self._limits())

    def _limits(self) -> str:
        """What limits this audit's reading: a claim it could not refute, or a bound at the most its size allows."""
        notes = ""
        if not self.can_refute_claim:
            notes += " " + unrefutable_claim(self.m, self.delta, self.confidence, self.claimed_epsilon,
                                             self.largest_reportable_bound)
        at_ceiling = self.epsilon_lower_bound >= self.largest_reportable_bound * (1 - 1e-6)
        if self.guesses and self.correct == self.guesses and at_ceiling:
            notes += " Every guess was right: the bound is capped by the audit's size, not measured."
        return notes


def unrefutable_claim(m: int, delta: float, confidence: float, claimed: float, ceiling: float) -> str:
    """Why an audit of ``m`` canaries could not refute ``claimed`` (its bound is at most ``ceiling``), and what would
    raise the ceiling: more canaries only while the bound's delta term (2 m delta) leaves room (at a fixed delta the
    ceiling peaks, about 5.67 near 5,000 canaries at delta 1e-5 and 95%, then falls)."""
    if math.isinf(claimed):
        return ("The claimed epsilon is infinite (a run without noise): no audit can show it broken, and the bound"
                " only shows how much the run leaks.")
    doubled = largest_reportable_bound(2 * m, delta, guess_candidates(2 * m), confidence)
    more = f"Use more canaries (twice as many could show up to {doubled:.3f}) or a lower confidence."
    fix = more if doubled > ceiling else ("More canaries would not raise it at this delta (the bound pays 2 x canaries"
                                          " x delta): use a smaller delta or a lower confidence.")
    return (f"At this size and confidence no run can show more than {ceiling:.3f}, which is not above the claim: this"
            f" audit could not detect a broken guarantee. {fix}")


def audit_training(
    module: pl.LightningModule,
    dataset: Dataset,
    *,
    batch_size: int,
    max_steps: int,
    strategy_options: Optional[Mapping[str, Any]] = None,
    canaries: int = 1000,
    canary_type: CanaryType = "gradient",
    magnitude: float = 1.0,
    confidence: float = 0.95,
    seed: Optional[int] = None,
    scale: str = "as configured",
    trainer_options: Optional[Mapping[str, Any]] = None,
) -> AuditReport:
    """Train ``module`` on ``dataset`` plus ``canaries`` canaries (each inserted with probability 1/2) with
    `LongShieldStrategy(**strategy_options)` for ``max_steps`` DP steps of expected logical batch ``batch_size``, and
    audit the run.

    ``canary_type="gradient"`` (white box): each canary's gradient is ``magnitude x max_grad_norm`` on one coordinate
    of the output layer, through a call of that layer, scored on every released update, at the run's micro-batch
    size (a model without a trainable output layer: any coordinate, at ``micro_batch_size=1``, logged).
    ``"input"`` (black box, a `CausalLMModule`): random token sequences scored by their loss on the trained model.
    Canaries are sampled, clipped and noised like every record. ``scale`` says how this run relates to the real one
    (e.g. fewer steps), and is reported. ``seed`` fixes the canaries and their inclusion bits (default: OS entropy,
    the bits apart from the canaries' placement; the report gives the placement's seed). The data hold one record
    per canary whatever the bits (an excluded canary's, dropped from the batches, trains nothing), sampled at
    ``batch_size / (N + canaries / 2)`` (the rate over the records and the canaries expected in). One process: the
    layout-only options (`LAYOUT_OPTIONS`, e.g. ``context_parallel_size``) are dropped, and those that would change
    the layout are named in the report's scale; pass ``batch_size`` as the run's expected logical batch (DataLoader
    ``batch_size`` x data-parallel size) to audit near its sampling rate. A warning says when the audit's size and
    confidence cannot reach a bound above the claim (`AuditReport.largest_reportable_bound`).
    """
    from lightning_longshield import LongShieldStrategy
    from lightning_longshield.checkpoints import forget_trained
    from lightning_longshield.progress import StepProgressBar

    check_audit_inputs(magnitude, confidence)
    if (trainer_options or {}).get("devices", 1) not in (1, [0], "1"):
        raise ValueError("An audit runs in one process (its canary scores read the whole released gradient): pass"
                         " devices=1; the guarantee audited is the same mechanism's.")
    options, dropped = _mechanism_options(strategy_options or {})
    if dropped:
        scale = f"{scale}; in one process, without {dropped} (layout only, not the DP mechanism)"
        log.info("The audit runs in one process, without %s: the layout does not change the DP mechanism.", dropped)
    own_step = module.__dict__.get("training_step")  # what the audit's wrapper replaces, put back after the run
    if getattr(module, "model", True) is None and hasattr(module, "configure_model"):
        module.configure_model()  # the canaries' coordinates are chosen among the parameters
    callbacks: list[pl.Callback] = []
    if canary_type == "gradient":
        chosen = GradientCanaries(canaries, seed=seed, magnitude=magnitude * float(options.get("max_grad_norm", 1.0)))
        chosen.place(module)
        if chosen.layer is None and options.get("micro_batch_size", 1) != 1:
            log.info("Gradient canaries audit at micro_batch_size=1: the model has no trainable output layer to"
                     " carry them, so a canary's gradient must be its micro-batch's (the micro-batch size has no"
                     " privacy effect).")
            options["micro_batch_size"] = 1
        wrap_step = functools.partial(insert_gradient_canaries, module, chosen)
        data: Dataset = WithCanaries(dataset, chosen)
        scorer = CanaryScores(chosen)
        callbacks.append(scorer)
    elif canary_type == "input":
        sample = dataset[0]
        vocab = int(getattr(getattr(module, "config", None), "vocab_size", 256))
        inputs = InputCanaries(canaries, seed=seed, seq_len=len(sample["input_ids"]), vocab_size=vocab)
        chosen = inputs
        data = WithCanaries(dataset, inputs, inputs.record)
        wrap_step = functools.partial(_ignore_canary_key, module)
    else:
        raise ValueError(f"canary_type={canary_type!r}: choose 'gradient' (white box) or 'input' (black box).")
    strategy = LongShieldStrategy(**options)
    if canary_type == "gradient" and chosen.layer is None and strategy.config.projected_norms is not None:
        raise ValueError(
            f"Gradient canaries on a model without a trainable output layer ({type(module).__name__}.model.output)"
            f" add their gradient outside any layer's call, which norms={strategy.config.norms!r} cannot estimate:"
            " audit with exact norms (norms='materialize', 'ghost' or 'mixed'; the clipping bound and the noise are"
            " the same) or with canary_type='input'."
        )
    settings: dict[str, Any] = {**dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                       enable_model_summary=False, num_sanity_val_steps=0, enable_progress_bar=True),
                                **(trainer_options or {})}
    if settings["enable_progress_bar"]:
        callbacks.append(StepProgressBar())
    settings["callbacks"] = [*callbacks, *settings.get("callbacks", [])]
    trainer = pl.Trainer(strategy=strategy, max_steps=max_steps, **settings)
    forget_trained(module)  # an earlier fit or audit never saw these canaries: the claim is this run's steps
    with _training_step_restored(module, wrapped_from=own_step):
        wrap_step()
        trainer.fit(module, DataLoader(data, batch_size=_batch_over_every_canary(batch_size, len(dataset), canaries),
                                       collate_fn=WithoutFillers(data)))
    plan = strategy.privacy_plan
    assert plan is not None
    if canary_type == "gradient":
        scores = scorer.scores.tolist()
    else:
        scores = loss_scores(module, inputs, lambda m, record: causal_lm_loss(m(record["input_ids"][None]),
                                                                              record["labels"][None]))
    candidates = guess_candidates(canaries)
    delta = plan.delta + strategy.privacy.cut_off_delta()  # the guarantee's: the noise's cut-off adds to it
    if delta >= 1:  # a guarantee that bounds nothing: no guess can show it broken
        warnings.warn(f"The noise's floating-point cut-off puts the guarantee's delta at {delta:.3g}, 1 or more: the"
                      " run has no guarantee to audit (more noise, or secure_mode=True, shrinks the cut-off).",
                      UserWarning, stacklevel=2)
        return AuditReport(canary_type, canaries, len(chosen.inserted), strategy.get_epsilon(), 0.0, confidence,
                           1.0, 0, 0, trainer.global_step, scale, top_guess_accuracy(scores, chosen.included), 0.0,
                           chosen.seed)
    best = best_epsilon_lower_bound(scores, chosen.included, delta, candidates, confidence)
    report = AuditReport(canary_type, canaries, len(chosen.inserted), strategy.get_epsilon(), best.epsilon,
                         confidence, delta, best.guesses, best.correct, trainer.global_step, scale,
                         top_guess_accuracy(scores, chosen.included),
                         largest_reportable_bound(canaries, delta, candidates, confidence), chosen.seed)
    if not report.can_refute_claim:
        warnings.warn(f"The audit of {canaries} canaries at {100 * confidence:.4g}% confidence (claimed epsilon"
                      f" {report.claimed_epsilon:.3f}): " + unrefutable_claim(canaries, delta, confidence,
                                                                             report.claimed_epsilon,
                                                                             report.largest_reportable_bound),
                      UserWarning, stacklevel=2)
    return report


def check_audit_inputs(magnitude: float, confidence: float) -> None:
    """Refuse, before any training, a canary magnitude or a confidence that cannot give a meaningful audit."""
    if not (math.isfinite(magnitude) and magnitude > 0):
        raise ValueError(f"magnitude={magnitude}: a canary's gradient norm, in units of max_grad_norm, must be a"
                         " finite number above 0 (1 is the clipping bound).")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} is outside (0, 1): write 0.95 for 95%.")


def _mechanism_options(strategy_options: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """``strategy_options`` without `LAYOUT_OPTIONS`, and those dropped that differ from `LongShieldStrategy`'s
    defaults and from one process's layout (``"context_parallel_size=2"``; empty if none)."""
    from lightning_longshield import LongShieldStrategy

    parameters = inspect.signature(LongShieldStrategy.__init__).parameters
    one_process = {key: (parameters[key].default,) for key in LAYOUT_OPTIONS if key in parameters}
    one_process["context_parallel_size"] = (None, 1)
    dropped = ", ".join(f"{key}={value!r}" for key, value in strategy_options.items()
                        if key in LAYOUT_OPTIONS and value not in one_process.get(key, ()))
    return {key: value for key, value in strategy_options.items() if key not in LAYOUT_OPTIONS}, dropped


def _finite_or_none(value: Any) -> Any:
    """``value`` with every non-finite float, in nested dicts, lists and tuples, replaced by ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(item) for item in value]
    return value


def top_guess_accuracy(scores: list[float], included: list[bool], points: int = 20) -> tuple[tuple[int, float], ...]:
    """For ``points`` values of k up to half the canaries: the fraction of the k highest scores that were inserted."""
    order = sorted(range(len(scores)), key=lambda index: -scores[index])
    half = max(1, len(scores) // 2)
    ks = sorted({max(1, round(half * (i + 1) / points)) for i in range(points)})
    return tuple((k, sum(included[index] for index in order[:k]) / k) for k in ks)


@contextmanager
def _training_step_restored(module: pl.LightningModule, wrapped_from: Any) -> Iterator[None]:
    """Run the audited fit, then give ``module`` back its own ``training_step`` (the audit wraps it), so the module
    can be trained or audited again."""
    try:
        yield
    finally:
        if wrapped_from is None:
            module.__dict__.pop("training_step", None)
        else:
            module.training_step = wrapped_from  # type: ignore[method-assign]


def _batch_over_every_canary(batch_size: int, records: int, canaries: int) -> int:
    """The expected batch over the run's records and one per canary (`WithCanaries`) that samples each at
    ``batch_size / (records + canaries / 2)``: the rate over the records and the canaries expected to be included, as
    if only those were there (at most 1)."""
    return min(records + canaries, round(batch_size * (records + canaries) / (records + canaries / 2)))


def _ignore_canary_key(module: pl.LightningModule) -> None:
    """The run's own training step, handed records without the canary index."""
    step = module.training_step

    def training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
        batch.pop(CANARY_KEY, None)
        return step(batch, *args, **kwargs)

    module.training_step = training_step  # type: ignore[method-assign]
