"""Privacy arguments: validation at construction and resolution into a concrete plan at the start of training."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, Optional

from lightning_longshield.privacy.accountant import ACCOUNTANTS, PrivacyAccountant

DEFAULT_TARGET_EPSILON = 8.0


#: The smallest ``max_grad_norm`` taken: squares of fp32 values below 2^-63 lose relative precision (subnormal), so
#: the clipping margin covers a norm's rounding only for bounds far above that (`PrivacyArguments.validate`).
SMALLEST_MAX_GRAD_NORM = 1e-6


@dataclass(frozen=True)
class PrivacyArguments:
    """What the user asked for; `validate` rejects impossible or conflicting combinations up front."""

    noise_multiplier: Optional[float]
    target_epsilon: Optional[float]
    target_delta: Optional[float]
    max_grad_norm: float
    accountant: str

    def validate(self) -> None:
        if not 0 < self.max_grad_norm < math.inf:
            raise ValueError(f"max_grad_norm must be > 0 and finite, got {self.max_grad_norm}.")
        if self.max_grad_norm < SMALLEST_MAX_GRAD_NORM:
            raise ValueError(
                f"max_grad_norm={self.max_grad_norm:g} is below {SMALLEST_MAX_GRAD_NORM:g}: the norms are formed from"
                " fp32 squares, whose rounding is relative only above fp32's smallest normal values, so the clipping"
                " bound holds within its margin only for bounds far above what underflows (about 1e-12 at 10^10"
                " parameters). Scale the loss instead (the learning rate absorbs it)."
            )
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant={self.accountant!r} is not supported; choose one of {ACCOUNTANTS}.")
        if self.noise_multiplier is not None and not 0 <= self.noise_multiplier < math.inf:
            raise ValueError(f"noise_multiplier must be >= 0 and finite, got {self.noise_multiplier}.")
        if self.target_epsilon == math.inf:
            raise ValueError(
                "target_epsilon=inf is no privacy budget: use noise_multiplier=0.0 for a non-private run, or a finite"
                " target_epsilon."
            )
        if self.target_epsilon is not None and not 0 < self.target_epsilon < math.inf:
            raise ValueError(
                f"target_epsilon must be > 0 and finite, got {self.target_epsilon}: pass a positive budget such"
                " as target_epsilon=8.0, or noise_multiplier=0.0 for a non-private run."
            )
        if self.target_delta is not None and not 0 < self.target_delta < 1:
            raise ValueError(f"target_delta must be in (0, 1), got {self.target_delta}.")
        if self.noise_multiplier == 0 and self.target_epsilon is not None:
            raise ValueError(
                f"noise_multiplier=0 spends infinite epsilon, which conflicts with target_epsilon="
                f"{self.target_epsilon}. Drop target_epsilon for a non-private run, or drop noise_multiplier to"
                " calibrate the noise to the target."
            )


class PlanMessage(NamedTuple):
    """A message about the plan: a warning (``warn``: the user should change something, or a guarantee does not
    hold) or a plain log line."""

    text: str
    warn: bool


@dataclass(frozen=True)
class PrivacyPlan:
    """The resolved mechanism: sigma, delta, sampling rate, the budget (if any) and the planned steps."""

    noise_multiplier: float
    delta: float
    sample_rate: float
    expected_batch_size: int
    dataset_size: int
    planned_steps: Optional[int]  # None: no step limit (max_steps and max_epochs unset); a budget may end it
    target_epsilon: Optional[float]
    #: The training dataset's ``split_digest`` where it has one (`LocalTextDataModule`): which records train.
    training_digest: Optional[str] = None

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        budget = f"target epsilon {self.target_epsilon:g}" if self.target_epsilon is not None else "no budget"
        return (
            f"noise_multiplier={self.noise_multiplier:.4f}, delta={self.delta:.3g}, sampling rate q="
            f"{self.sample_rate:.4g} (expected logical batch {self.expected_batch_size} of {self.dataset_size}"
            f" samples), {'no step limit' if self.planned_steps is None else f'{self.planned_steps} planned steps'},"
            f" {budget}"
        )


def resolve_plan(
    arguments: PrivacyArguments,
    dataset_size: int,
    expected_batch_size: int,
    planned_steps: float,
    accountant: PrivacyAccountant,
    restored: Optional[Mapping[str, Any]] = None,
    training_digest: Optional[str] = None,
) -> tuple[PrivacyPlan, list[PlanMessage]]:
    """Turn the arguments into a plan for ``planned_steps`` more steps (``inf``: no step limit); returns the plan and
    messages to log.

    With only a target epsilon the noise is calibrated so that the accountant's history plus ``planned_steps``
    steps spend at most the target. With both, the target is a budget that training stops at. ``restored``: the
    plan of the checkpoint a run resumes (`PrivacyPlan.state_dict`), whose noise multiplier, target and delta are
    kept, so that the checkpoint's accounted steps and the next ones compose under one mechanism.
    ``training_digest``: the training dataset's ``split_digest``, compared with the checkpoint's.
    """
    messages: list[PlanMessage] = []
    sample_rate = expected_batch_size / dataset_size
    if not 0 < sample_rate <= 1:
        raise ValueError(
            f"The sampling rate is {sample_rate:.4g} (expected logical batch {expected_batch_size} / dataset size"
            f" {dataset_size}) but must be in (0, 1]: lower the DataLoader's batch_size or the data-parallel size, or"
            " add data."
        )
    if restored is not None:
        noise_multiplier, target_epsilon, delta = _kept_from_checkpoint(arguments, restored, messages)
        if restored.get("dataset_size") not in (None, dataset_size):
            messages.append(PlanMessage(
                f"Resuming a checkpoint whose run trained on {restored['dataset_size']} records with {dataset_size}:"
                " each step is accounted at its own sampling rate and epsilon counts all of them (a bound for a record"
                " of either set). Check that the training data is meant to differ.",
                True,
            ))
        elif restored.get("expected_batch_size") not in (None, expected_batch_size):
            messages.append(PlanMessage(
                f"Resuming a checkpoint whose run sampled an expected logical batch of"
                f" {restored['expected_batch_size']} with {expected_batch_size} (batch_size or data-parallel size"
                f" changed): the sampling rate goes from {restored['sample_rate']:.3g} to {sample_rate:.3g}; each step"
                " is accounted at its own rate and epsilon counts all of them.",
                True,
            ))
        if None not in (restored.get("training_digest"), training_digest) and \
                restored["training_digest"] != training_digest:
            messages.append(PlanMessage(
                "Resuming a checkpoint whose run trained on another split of its documents (the data files, seed,"
                " val_fraction or max_documents changed): documents held out for validation now may have been"
                " trained on before, and their validation loss would be released outside the privacy guarantee."
                " Resume with the data module's settings of the checkpoint's run, or validate on public val_files.",
                True,
            ))
    else:
        noise_multiplier, target_epsilon, delta = (
            arguments.noise_multiplier, arguments.target_epsilon, arguments.target_delta
        )
        if delta is None:
            delta = 1.0 / (10 * dataset_size)
            messages.append(PlanMessage(f"target_delta not set: using 1 / (10 x dataset size) = {delta:.3g}.", False))
        if noise_multiplier is None and target_epsilon is None:
            target_epsilon = DEFAULT_TARGET_EPSILON
            messages.append(PlanMessage(
                f"Neither noise_multiplier nor target_epsilon was given: calibrating the noise to the default"
                f" target_epsilon={DEFAULT_TARGET_EPSILON:g}. Pass target_epsilon=... to choose the privacy level.",
                True,
            ))
        if noise_multiplier is not None and target_epsilon is not None:
            messages.append(PlanMessage(
                f"noise_multiplier={noise_multiplier:g} and target_epsilon={target_epsilon:g} are both set: the noise"
                " is the given noise_multiplier (not calibrated), and target_epsilon is a budget: training stops"
                " before a step would exceed it. Pass only target_epsilon to calibrate the noise to the planned steps"
                " instead.",
                False,
            ))
    if delta >= 1.0 / dataset_size:
        raise ValueError(
            f"target_delta={delta:g} is not below 1 / dataset size = {1 / dataset_size:.3g}: such a guarantee allows"
            " releasing a whole sample. Lower target_delta (default 1 / (10 x dataset size))."
        )
    if noise_multiplier is None:
        assert target_epsilon is not None
        if not math.isfinite(planned_steps) or planned_steps <= 0:
            raise ValueError("Calibrating noise to target_epsilon needs a finite plan: set max_steps or max_epochs.")
        if accountant.steps:
            raise ValueError(
                "Cannot calibrate the noise to target_epsilon for a run that has already taken DP steps (a checkpoint"
                " without a recorded noise multiplier, or another fit with the same strategy): pass noise_multiplier"
                " explicitly; the accountant keeps the steps taken, and target_epsilon still stops the run."
            )
        noise_multiplier = accountant.calibrate_noise_multiplier(target_epsilon, delta, sample_rate, planned_steps)
    if noise_multiplier == 0:
        messages.append(PlanMessage("noise_multiplier=0: this run is NOT differentially private (epsilon is infinite).",
                                    True))
    plan = PrivacyPlan(
        noise_multiplier=float(noise_multiplier),
        delta=delta,
        sample_rate=sample_rate,
        expected_batch_size=expected_batch_size,
        dataset_size=dataset_size,
        planned_steps=int(planned_steps) if math.isfinite(planned_steps) else None,
        target_epsilon=target_epsilon,
        training_digest=training_digest,
    )
    return plan, messages


def _kept_from_checkpoint(
    arguments: PrivacyArguments, restored: Mapping[str, Any], messages: list[PlanMessage]
) -> tuple[float, Optional[float], float]:
    """The checkpoint's noise multiplier and delta, the tighter of its target epsilon and the one passed now (a
    lower budget changes no accounted step), and the larger of its noise multiplier and one passed now (never less
    noise than asked for: the accountant composes steps of either); a warning names each other value the user passed
    that differs from the checkpoint's (values the user did not pass are not mentioned)."""
    kept = {"noise_multiplier": restored["noise_multiplier"], "target_epsilon": restored["target_epsilon"],
            "target_delta": restored["delta"]}
    given = {"noise_multiplier": arguments.noise_multiplier, "target_epsilon": arguments.target_epsilon,
             "target_delta": arguments.target_delta}
    applied_before = len(messages)
    tighter = given["target_epsilon"] is not None and (kept["target_epsilon"] is None
                                                       or given["target_epsilon"] < kept["target_epsilon"])
    if tighter:
        messages.append(PlanMessage(
            f"Resuming a checkpoint with target_epsilon={given['target_epsilon']:g} (the checkpoint's run:"
            f" {_shown(kept['target_epsilon'])}): the tighter budget applies from now on.",
            False,
        ))
        kept["target_epsilon"] = given["target_epsilon"]
    if given["target_delta"] is not None and given["target_delta"] < kept["target_delta"]:
        messages.append(PlanMessage(
            f"Resuming a checkpoint with target_delta={given['target_delta']:g} (the checkpoint's run:"
            f" {kept['target_delta']:g}): the smaller delta applies (epsilon is computed over every step at it).",
            False,
        ))
        kept["target_delta"] = given["target_delta"]
    if given["noise_multiplier"] is not None and given["noise_multiplier"] > kept["noise_multiplier"]:
        earlier = kept["noise_multiplier"]
        messages.append(PlanMessage(
            f"Resuming a checkpoint with noise_multiplier={given['noise_multiplier']:g} (the checkpoint's run:"
            f" {earlier:g}): the larger noise applies from now on; epsilon composes the steps of both."
            + (" The checkpoint's steps had no noise, so epsilon stays infinite: if they did not train on this data,"
               " start a new run from the weights instead." if earlier == 0 else ""),
            earlier == 0,
        ))
        kept["noise_multiplier"] = given["noise_multiplier"]
    differ = [f"{name}={value:g} (the checkpoint's run: {_shown(kept[name])})" for name, value in given.items()
              if value is not None and value != kept[name]]
    if differ:
        messages.append(PlanMessage(
            f"Resuming a checkpoint with {', '.join(differ)}: the resumed run keeps the checkpoint's noise_multiplier"
            " and delta unless the value given now is larger (noise) or smaller (delta), so that its accounted steps"
            " and the next ones compose under one mechanism, and the lower of the two target_epsilon values. Start a"
            " new run (without ckpt_path) to change them otherwise.",
            True,
        ))
    elif len(messages) == applied_before:  # nothing given now applies either
        messages.append(PlanMessage(
            "Resuming a checkpoint: its noise_multiplier, target_epsilon and delta are kept (accounted steps and the"
            " next ones compose under one mechanism).",
            False,
        ))
    return float(kept["noise_multiplier"]), kept["target_epsilon"], float(kept["target_delta"])


def _shown(value: Optional[float]) -> str:
    return "not set" if value is None else f"{value:g}"
