"""`PrivacySession`: one strategy's privacy lifecycle, from the user's arguments to the budget stop and checkpoints.

What it owns: the validated arguments, the accountant, the plan resolved when training starts (noise calibration,
delta, sampling rate), the secret randomness of each fit (noise generator, Poisson stream), the budget (how many
more private releases it allows) and what a checkpoint keeps of it (the plan and the accountant's history, never
a secret). The strategy calls it at fixed points of a fit; nothing here touches models or processes.
"""

from __future__ import annotations

import math
import os
import secrets
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, TypeVar

import torch

from lightning_longshield.privacy.accountant import PrivacyAccountant
from lightning_longshield.privacy.cut_off import NoiseTail, cut_off_delta
from lightning_longshield.privacy.ledger import (
    LedgerEntry,
    PrivacyLedger,
    cost_order,
    missing_indices,
    read_ledgers,
    steps_after,
    steps_beside,
)
from lightning_longshield.privacy.model_randomness import StepRandomness
from lightning_longshield.privacy.noise import GaussianNoise
from lightning_longshield.privacy.plan import PlanMessage, PrivacyArguments, PrivacyPlan, resolve_plan
from lightning_longshield.privacy.randomized.accountant import RandomizedClippingAccountant
from lightning_longshield.privacy.randomized.estimator import accountant_envelope
from lightning_longshield.privacy.randomness import KEY_BYTES, SecretKey
from lightning_longshield.privacy.rank_zero import rank_zero_info, rank_zero_warn
from simulate.strategy_config import ProjectedNorms

T = TypeVar("T")
#: The most steps a budget is searched over when training has no step limit (2^40: far beyond any run).
MOST_UNPLANNED_STEPS = 2**40

#: Fractions of delta beyond which what the noise's cut-off adds is warned about as training starts, and stated
#: in the printed guarantee.
CUT_OFF_WARNING = 0.1
CUT_OFF_MENTIONED = 1e-3


#: What one sample is, where the data module does not say (``describe_privacy_unit``).
DEFAULT_PRIVACY_UNIT = "one training sample"


def privacy_unit_of(datamodule: object) -> str:
    """The unit the guarantee protects, in words: the data module's ``describe_privacy_unit()`` where it has one."""
    describe = getattr(datamodule, "describe_privacy_unit", None)
    return describe() if callable(describe) else DEFAULT_PRIVACY_UNIT


class PrivacySession:
    """The privacy state of a strategy across fits: plan, accountant, secret randomness, budget, checkpoint state.

    Lifecycle: `open_fit` draws fresh secret randomness for a fit; `record_training_data` notes the dataset size and
    the DataLoader's batch size; `start_training` resolves the plan and the budget (returns whether the budget is
    already spent); `check_release_allowed` guards each release and `released` counts it down (returns whether
    training must stop); `state_dict` / `load_state_dict` carry the plan and history through checkpoints, and
    `open_ledger` / `resume_from_ledger` keep every step that ran in a `PrivacyLedger` that outlives the process.
    """

    def __init__(
        self,
        arguments: PrivacyArguments,
        secure_mode: bool = False,
        noise_seed: Optional[int] = None,
        poisson_sampling: bool = True,
        projected_norms: Optional[ProjectedNorms] = None,
    ) -> None:
        """``projected_norms``: randomized clipping, accounted by its own accountant (`RandomizedClippingAccountant`,
        with the estimator's envelope)."""
        arguments.validate()
        if secure_mode and noise_seed is not None:
            raise ValueError(
                "secure_mode=True draws the noise and the sampling from OS entropy; remove noise_seed (reproducible"
                " noise is for tests) or set secure_mode=False."
            )
        if noise_seed is not None:
            rank_zero_warn(
                "noise_seed is set: the noise, the Poisson sampling and the DP steps' dropout are reproducible from"
                " this seed. The privacy guarantee holds only while the seed stays secret: anyone who knows it can"
                " subtract the noise and see which samples each step used. Two runs with one seed draw the same noise"
                " at each step, so even with the seed secret their releases together cancel it. Use it for tests,"
                " never for a release."
            )
        self.arguments = arguments
        self.secure_mode = secure_mode
        self.noise_seed = noise_seed
        self.poisson_sampling = poisson_sampling
        self.randomized = projected_norms is not None
        self.accountant = PrivacyAccountant(arguments.accountant)
        if projected_norms is not None:
            if arguments.accountant != "prv":
                raise ValueError(f"norms={projected_norms!r} has its own accountant (privacy-loss"
                                 f" distributions, like 'prv'); accountant={arguments.accountant!r} cannot account"
                                 " it. Use accountant='prv'.")
            envelope = accountant_envelope(projected_norms.estimator, projected_norms.projection_dim)
            self.accountant = RandomizedClippingAccountant(envelope.estimator, envelope.projections)
        self.plan: Optional[PrivacyPlan] = None
        self._fit_data: Optional[tuple[int, int]] = None  # this fit's (dataset size, batch size), once its data is seen
        self.noise: Optional[GaussianNoise] = None
        self.sampling: Optional[SecretKey] = None
        self.projection_key: Optional[SecretKey] = None
        self.step_randomness: Optional[StepRandomness] = None  # the global generators' keys in DP steps (dropout)
        self.dataset_size: Optional[int] = None
        self.dataloader_batch_size: Optional[int] = None
        self.split_digest: Optional[str] = None  # the training dataset's, where it has one (`record_training_data`)
        self.steps_left_in_budget: Optional[int] = None
        self._restored_plan: Optional[dict[str, Any]] = None
        self._planned_end = 0
        self.run_id: Optional[str] = None  # names this run's lines in the ledger; not a secret
        self._new_run_id: Optional[str] = None  # the id a run that opens its first ledger takes (from rank 0)
        self.identity = uuid.uuid4().hex  # names this session on the modules it trained (`checkpoints.mark_trained`)
        self.ledger: Optional[PrivacyLedger] = None
        self.ledger_path: Optional[str] = None  # where this run's ledger is (from a checkpoint, or once opened)
        self.ledger_since: Optional[int] = None  # the first step index that ledger records for this run
        self.ledger_marked = False  # that ledger holds a line where this run opened it at ledger_since
        self.without_lines: set[int] = set()  # step indices accounted by a resume that no ledger line names
        self.damaged_counted = 0  # damaged ledger lines a resume counted as steps
        self.beside_counted = 0  # ledger lines beside the checkpoint's own (same index) a resume counted
        self.rolled_back_steps = 0  # steps that ran after the checkpoint a run resumed from
        self.accounting_incomplete = False  # a resume found the run's ledger missing: steps may be uncounted
        # How steps before this fit ran (checkpoint and ledger): without Poisson sampling, or from a noise_seed.
        self.earlier_without_poisson = False
        self.earlier_reproducible = False
        self.earlier_tails: set[NoiseTail] = set()  # the noise sources of steps before this session (checkpoints)

    @property
    def max_grad_norm(self) -> float:
        return self.arguments.max_grad_norm

    # ------------------------------------------------------------------ a fit's secret randomness

    @property
    def poisson_key(self) -> Optional[SecretKey]:
        """The key of this fit's Poisson masks; ``None`` with ``poisson_sampling=False`` (or before `open_fit`)."""
        return self.sampling if self.poisson_sampling else None

    @property
    def reproducible(self) -> bool:
        """Whether the noise and the sampling come from ``noise_seed`` (a key that can be derived again)."""
        return self.noise_seed is not None

    def open_fit(self, device: torch.device, stream: tuple[int, ...], broadcast: Callable[[T], T]) -> None:
        """Fresh secret randomness for a fit: this process's noise generator and the key of its global generators in
        DP steps (`StepRandomness`: dropout), the Poisson masks' key and (randomized clipping) the projections' key.

        Draws are keyed by the DP step, so with ``noise_seed`` a resumed or second fit of this session continues the
        streams instead of replaying them; another session with the same seed (a new strategy, a sweep) starts them
        again from its own step 0, and draws the same noise. ``stream`` (data-parallel rank, context-parallel rank)
        separates the processes' noise; ``broadcast`` (from rank 0) gives every process the same Poisson masks and
        projections, and the run id that a ledger this run opens will name.
        """
        if self.noise_seed is not None:
            seeded = SecretKey.from_seed(self.noise_seed)
            shared, noise_key = seeded.derive("shared"), seeded.derive("noise")
            model_key = seeded.derive("model", *stream)
        else:
            shared, noise_key = SecretKey(broadcast(secrets.token_bytes(KEY_BYTES))), None
            model_key = SecretKey.fresh()
        self.step_randomness = StepRandomness(model_key, device)
        self._new_run_id = broadcast(uuid.uuid4().hex)  # rank 0's: every rank names a new ledger's run alike
        self.sampling = shared.derive("sampling")
        if self.noise is not None and self.accountant.steps:  # an earlier fit's steps drew from it
            self.earlier_tails.add(self.noise.tail)
        self.noise = GaussianNoise(device, noise_key, stream, self.secure_mode)
        self._fit_data = None
        if self.randomized:  # one key for all processes: a sequence's shards are projected alike
            self.projection_key = shared.derive("projection")

    def record_training_data(self, dataset_size: int, batch_size: Optional[int],
                             split_digest: Optional[str] = None) -> None:
        """Note the training set's size, the DataLoader's batch size (the expected logical batch per DP group) and
        the dataset's ``split_digest`` where it has one (which records train: compared at a resume)."""
        if dataset_size == 0:
            raise ValueError("The training dataset is empty; DP-SGD needs at least one sample.")
        if batch_size is None:
            raise ValueError(
                "The training DataLoader must set batch_size: it is the expected logical (privacy) batch per"
                " data-parallel group. A custom batch_sampler is replaced by Poisson sampling."
            )
        if self._fit_data is not None and self._fit_data != (dataset_size, batch_size):
            raise ValueError(
                "The training DataLoader changed during fit (reload_dataloaders_every_n_epochs, or a train_dataloader"
                " that returns another one): its dataset size and batch_size set the Poisson sampling rate and the"
                " expected logical batch that the noise and the accountant were planned with. Keep both fixed within a"
                " fit; start a new fit for other data."
            )
        self._fit_data = (dataset_size, batch_size)
        self.dataset_size, self.dataloader_batch_size = dataset_size, batch_size
        self.split_digest = split_digest

    # ------------------------------------------------------------------ plan and budget

    def start_training(self, global_step: int, planned_steps: float, data_parallel_size: int) -> bool:
        """Resolve the plan for ``planned_steps`` more steps and the budget; returns whether training must stop now.

        A restored checkpoint's noise multiplier and delta replace the arguments, so a resumed run keeps the
        mechanism it was accounted with; of two targets, the lower applies. A later fit of the same session continues
        its earlier fit's plan the same way (a default delta from its own, perhaps smaller, dataset would state the
        earlier steps at a larger delta). Information goes to the log, what the user should change is warned.
        """
        if self.dataset_size is None or self.dataloader_batch_size is None:
            raise ValueError("LongShieldStrategy needs a training DataLoader with a sized dataset.")
        earlier = self._restored_plan
        if earlier is None and self.plan is not None and self.accountant.steps:
            earlier = self.plan.state_dict()
        self.plan, messages = resolve_plan(
            self.arguments,
            dataset_size=self.dataset_size,
            expected_batch_size=self.dataloader_batch_size * data_parallel_size,
            planned_steps=planned_steps,
            accountant=self.accountant,
            restored=earlier,
            training_digest=self.split_digest,
        )
        if not self.poisson_sampling:
            messages.append(PlanMessage(
                "poisson_sampling=False: logical batches come from the DataLoader, but the accountant assumes"
                " Poisson sampling, so the reported epsilon is not a formal guarantee.",
                True,
            ))
        for message in messages:
            (rank_zero_warn if message.warn else rank_zero_info)(message.text)
        rank_zero_info(f"LongShield DP-SGD: {self.plan.describe()}, max_grad_norm={self.max_grad_norm:g}.")
        self._planned_end = global_step + planned_steps
        self.steps_left_in_budget = self._budgeted_steps(planned_steps)
        self._warn_cut_off(planned_steps if math.isfinite(planned_steps) else self.steps_left_in_budget)
        if self.steps_left_in_budget == 0:
            if planned_steps > 0:  # else nothing is planned (a resume at its last step): not the budget's doing
                self._warn_no_step_fits()
            return True
        if self.steps_left_in_budget is not None and not math.isfinite(planned_steps):
            rank_zero_info(f"The privacy budget allows {self.steps_left_in_budget} steps (no step limit is set);"
                           " training will stop there.")
        elif self.steps_left_in_budget is not None and self.steps_left_in_budget < planned_steps:
            rank_zero_warn(
                f"The privacy budget allows {self.steps_left_in_budget} of the {planned_steps} planned steps;"
                " training will stop there."
            )
        elif self.steps_left_in_budget is not None:
            rank_zero_info(f"The privacy budget (target epsilon) covers all {planned_steps} planned steps.")
        return False

    def cut_off_delta(self, planned_steps: float = 0) -> float:
        """What the noise's floating-point cut-off adds to delta (`privacy.cut_off`) over the steps taken, each at its
        own noise multiplier and sampling rate (the accountant's history), and ``planned_steps`` more at the plan's.
        Each step is costed with the worst of the noise sources the run has used (this fit's and, from its
        checkpoints, earlier fits' on other devices): which steps each drew is not recorded."""
        if self.noise is None:
            return 0.0
        runs = list(self.accountant.history)
        if planned_steps and self.plan is not None:
            runs.append((self.plan.noise_multiplier, self.plan.sample_rate, planned_steps))
        return min(1.0, sum(max(cut_off_delta(tail, sigma, rate, steps) for tail in self.noise_tails)
                            for sigma, rate, steps in runs if sigma > 0))

    @property
    def noise_tails(self) -> set[NoiseTail]:
        """The noise sources the run's steps drew from: earlier fits' (`earlier_tails`) and this fit's."""
        return self.earlier_tails | ({self.noise.tail} if self.noise is not None else set())

    def _warn_cut_off(self, steps: Optional[float]) -> None:
        plan = self.plan
        assert plan is not None and self.noise is not None
        extra = self.cut_off_delta(steps or 0)
        if extra > CUT_OFF_WARNING * plan.delta:
            rank_zero_warn(
                f"At noise_multiplier={plan.noise_multiplier:.3g} the noise's floating-point cut-off"
                f" ({self.noise.tail.cut_off:.2f} standard deviations) adds up to {extra:.2g} to delta={plan.delta:.3g}"
                " over the run (lightning_longshield.privacy.cut_off): the printed guarantee will include it. Use"
                " more noise, or secure_mode=True (its tails reach 12.1 standard deviations)."
            )

    def _warn_no_step_fits(self) -> None:
        """The budget covers not even the next step: say what that step would spend, and, before any step, what to
        change."""
        plan = self.plan
        assert plan is not None
        after_one = self.accountant.epsilon_after(1, plan.noise_multiplier, plan.sample_rate, plan.delta)
        if self.accountant.steps:
            self._warn_stop(f"the privacy budget is spent: the next step would bring epsilon to {after_one:.4g}")
            return
        rank_zero_warn(
            f"Stopping DP training before its first step: the first step alone would spend epsilon={after_one:.4g} >"
            f" target_epsilon={plan.target_epsilon:g} (noise_multiplier={plan.noise_multiplier:g}, sampling rate q="
            f"{plan.sample_rate:.3g}, delta={plan.delta:.3g}). Add noise (a larger noise_multiplier, or only"
            " target_epsilon to calibrate it), allow a larger budget (target_epsilon), or lower the sampling rate"
            " (a smaller batch_size, or more data)."
        )

    def _budgeted_steps(self, planned_steps: float) -> Optional[int]:
        plan = self.plan
        assert plan is not None
        if plan.target_epsilon is None:
            return None
        if plan.planned_steps is None:  # no step limit: a limit the budget is sure to end before
            limit = 1
            while limit < MOST_UNPLANNED_STEPS and self.accountant.epsilon_after(
                    limit, plan.noise_multiplier, plan.sample_rate, plan.delta) <= plan.target_epsilon:
                limit *= 2
        else:
            limit = int(planned_steps)
        return self.accountant.steps_within_budget(
            plan.target_epsilon, plan.noise_multiplier, plan.sample_rate, plan.delta, limit
        )

    # ------------------------------------------------------------------ the ledger

    def open_ledger(self, path: str | os.PathLike, writer: bool) -> None:
        """Record this run's steps in the ledger at ``path`` from now on (``writer``: this process writes it; one
        process does)."""
        self.run_id = self.run_id or self._new_run_id or uuid.uuid4().hex
        path = os.fspath(os.path.abspath(path))
        new = path != self.ledger_path or self.ledger_since is None
        previous = self.ledger_path if new and self.ledger_path is not None else None
        if writer and previous is not None and os.path.exists(previous):
            # Where a checkpoint that names the old ledger is resumed, its reading follows this line to the new one.
            moving = PrivacyLedger(previous, self.run_id)
            moving.record_move(path, self.accountant.steps)
            moving.close()
        if new:  # a new ledger: it records the steps from now on, from a first line that says so
            self.ledger_since, self.ledger_marked = self.accountant.steps, True
        self.ledger_path = path
        if self.ledger is not None and (self.ledger.path != Path(path) or self.ledger.run_id != self.run_id):
            self.close_ledger()  # opened for another run or file (a save before a checkpoint of another was loaded)
        if writer and self.ledger is None:
            self.ledger = PrivacyLedger(self.ledger_path, self.run_id, opened_at=self.ledger_since if new else None)
            if previous is not None:  # and a resume from a checkpoint that names this one follows it back
                self.ledger.record_move(previous, self.accountant.steps, "moved_from")

    def record_release(self) -> None:
        """Write the next step to the ledger (fsynced) before it releases anything."""
        plan = self.plan
        assert plan is not None
        if self.ledger is not None:
            self.ledger.record(self.accountant.steps, plan.noise_multiplier, plan.sample_rate,
                               poisson=self.poisson_sampling, reproducible=self.reproducible)

    def resume_from_ledger(self, path: Optional[str | os.PathLike], broadcast: Callable[[T], T]) -> None:
        """After `load_state_dict`: add to the accountant every step that the ledger at ``path`` and the one the
        checkpoint names (and those the run moved on to from them) record for this run beyond the checkpoint's, read
        on rank 0 (``broadcast``)."""
        if self.run_id is None:
            return  # a checkpoint from before the ledger
        path = os.fspath(path) if path is not None else self.ledger_path
        own = self.ledger_path  # the checkpoint's
        checkpoint_steps = self.accountant.steps
        problem: Optional[str] = None
        entries: list[LedgerEntry] = []
        beside: list[LedgerEntry] = []
        lost, damaged = 0, self.damaged_counted
        if path is not None:
            try:
                reading, files = read_ledgers([name for name in (path, own) if name is not None], self.run_id)
                path = " and ".join(files)
                entries = steps_after(reading.entries, checkpoint_steps)
                # Damaged lines and lines beside the checkpoint's own that an earlier resume in the checkpoint's
                # history counted are in its accountant already: only more of them are new.
                damaged = max(reading.damaged, self.damaged_counted)
                lost = missing_indices(entries, checkpoint_steps) + damaged - self.damaged_counted
                beside = _most_costly(steps_beside(reading.entries, self.ledger_since, checkpoint_steps,
                                                   self.without_lines), self.beside_counted)
                unrecorded = self._steps_not_in(reading.entries, checkpoint_steps)
                if unrecorded:
                    problem = (f"The privacy ledger {path} lacks {unrecorded} of this run's steps before the checkpoint"
                               " (replaced or truncated)")
                elif self.ledger_marked and self.ledger_since not in reading.opened_at:
                    problem = (f"The privacy ledger {path} lacks the line where this run opened it at step"
                               f" {self.ledger_since} (replaced or truncated)")
            except FileNotFoundError:
                named = self.ledger_path  # the checkpoint's, where privacy_ledger names another
                problem = f"The privacy ledger {path} is missing" + (
                    f" (the checkpoint names {named})" if named is not None and named != os.path.abspath(path)
                    else "")
        entries, beside, lost, damaged, problem = broadcast((entries, beside, lost, damaged, problem))
        self.damaged_counted, self.beside_counted = damaged, self.beside_counted + len(beside)
        with_lines = {entry.index for entry in entries}
        if problem is not None:
            rank_zero_warn(
                f"{problem}: epsilon counts the checkpoint's {checkpoint_steps} steps and what the ledger holds, and"
                " any other step that ran after the checkpoint before the run stopped is not counted: the printed"
                " guarantee says so from now on. Resume with the run's ledger in place"
                " (LongShieldStrategy(privacy_ledger=...) names where it is). This run keeps a new ledger."
            )
            self.ledger_path = None  # where the run's ledger was may not exist here: a new one from now on
            self.accounting_incomplete = True
        if lost:
            rank_zero_warn(
                f"The privacy ledger {path} has {lost} damaged lines or gaps among this run's steps after the"
                f" checkpoint of step {checkpoint_steps}: each is counted as a step of this run, with its least noise"
                " and highest sampling rate (epsilon may be over-stated, never under-stated)."
            )
            entries = entries + [_worst_step(entries, self._restored_plan)] * lost
        if beside:
            rank_zero_warn(
                f"The privacy ledger {path} records {len(beside)} steps of this run beside the checkpoint's own:"
                " another attempt resumed from an earlier checkpoint ran them at the same time (two jobs from one"
                " checkpoint). They are accounted."
            )
            entries = entries + beside
        # The positions these steps take in the run's accounting that no line of the ledger names (stand-ins for
        # damaged lines and gaps, steps that ran beside the checkpoint): never a sign of a truncated ledger later.
        self.without_lines |= set(range(checkpoint_steps, checkpoint_steps + len(entries))) - with_lines
        for entry in entries:
            self.accountant.step(entry.noise_multiplier, entry.sample_rate)
            self.earlier_without_poisson |= not entry.poisson
            self.earlier_reproducible |= entry.reproducible
        self.rolled_back_steps += len(entries)
        if entries:
            rank_zero_info(
                f"Privacy ledger {path}: {len(entries)} steps ran after the checkpoint (which had accounted"
                f" {checkpoint_steps} DP steps, rolled-back ones included, at its trainer step) and were rolled back by"
                f" this resume; they are accounted: {self.accountant.steps} steps so far."
            )

    def _steps_not_in(self, recorded: list[LedgerEntry], checkpoint_steps: int) -> int:
        """How many of the step indices the run's ledger holds before the checkpoint (from ``ledger_since``, when it
        was opened) are not among ``recorded``."""
        if self.ledger_since is None:
            return 0  # a checkpoint from before `ledger_since` was kept: nothing to check against
        expected = set(range(self.ledger_since, checkpoint_steps)) - self.without_lines
        return len(expected - {entry.index for entry in recorded})

    def close_ledger(self) -> None:
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None

    def check_release_allowed(self) -> None:
        """Refuse a release the budget does not cover (the strategy stops before it; this is the last guard)."""
        if self.steps_left_in_budget == 0:
            raise RuntimeError("The privacy budget is spent; refusing to release another private gradient.")

    def released(self, global_step: int) -> bool:
        """Count one private release at ``global_step``; returns whether the budget now stops training."""
        if self.steps_left_in_budget is None:
            return False
        self.steps_left_in_budget -= 1
        if self.steps_left_in_budget > 0:
            return False
        # Only a stop that cuts the plan short is news; a run whose last planned step uses the budget just ends.
        if global_step + 1 < self._planned_end:
            self._warn_stop("one more step would exceed the privacy budget")
        return True

    def _warn_stop(self, reason: str) -> None:
        plan = self.plan
        assert plan is not None
        rank_zero_warn(
            f"Stopping DP training: {reason} (epsilon={self.get_epsilon():.3f} of target {plan.target_epsilon},"
            f" delta={plan.delta:.3g}, after {self.accountant.steps} DP steps)."
        )

    def get_epsilon(self, delta: Optional[float] = None) -> float:
        """Epsilon spent so far at ``delta`` (default: the plan's delta, or a restored checkpoint's where no step has
        trained since)."""
        if delta is None:
            if self.plan is not None:
                delta = self.plan.delta
            elif self._restored_plan is not None:
                delta = float(self._restored_plan["delta"])
            else:
                raise ValueError("No delta yet: pass delta=..., or call after training has started.")
        return self.accountant.get_epsilon(delta)

    def describe_guarantee(self, privacy_unit: str = DEFAULT_PRIVACY_UNIT) -> str:
        """The guarantee spent so far, in one sentence naming what it protects (``privacy_unit``)."""
        plan = self.plan
        if plan is None:
            raise ValueError("No guarantee yet: training has not started.")
        rolled_back = (f", of which {self.rolled_back_steps} were rolled back by a resume"
                       if self.rolled_back_steps else "")
        fixed_batches = ("poisson_sampling=False" if not self.poisson_sampling else
                         "poisson_sampling=False before a resume")
        claim = (f"Privacy guarantee: (epsilon={self.get_epsilon():.3f}, delta={plan.delta:.3g})-DP"
                 if self.poisson_sampling and not self.earlier_without_poisson else
                 f"Privacy figure, NOT a guarantee of this run ({fixed_batches}: its fixed batches get no"
                 f" amplification by sampling, which the figure assumes): epsilon={self.get_epsilon():.3f},"
                 f" delta={plan.delta:.3g}")
        extra = self.cut_off_delta()
        if extra > CUT_OFF_MENTIONED * plan.delta:
            claim += (f" (delta plus up to {extra:.2g} for the noise's floating-point cut-off: more noise or"
                      " secure_mode=True shrinks it)")
        if self.accounting_incomplete:
            claim += (" (a lower bound: at a resume this run's privacy ledger was missing or lacked steps, so steps"
                      " that ran after a checkpoint may be uncounted)")
        return (f"{claim} after {self.accountant.steps} steps run{rolled_back} ({self._describe_mechanisms()});"
                f" privacy unit: {privacy_unit}. {self.describe_randomness()}")

    def _describe_mechanisms(self) -> str:
        """The noise multipliers and sampling rates the steps ran with: the plan's, or, where a resume changed them,
        how many steps ran with each (the epsilon is of that history, not of the last plan's alone)."""
        plan = self.plan
        assert plan is not None
        current = (f"noise_multiplier={plan.noise_multiplier:.3f}, sampling rate q={plan.sample_rate:.3g} ="
                   f" {plan.expected_batch_size}/{plan.dataset_size} samples")
        steps: dict[tuple[float, float], int] = {}
        for sigma, rate, count in self.accountant.history:
            steps[(sigma, rate)] = steps.get((sigma, rate), 0) + count
        if set(steps) <= {(plan.noise_multiplier, plan.sample_rate)}:
            return current
        ran = ", ".join(f"{count} at noise_multiplier={sigma:.3f}, q={rate:.3g}"
                        for (sigma, rate), count in steps.items())
        return f"steps by mechanism: {ran}; now {current}"

    def describe_randomness(self) -> str:
        """What the mechanism's randomness is, and how much of it is cryptographic."""
        key = "noise_seed" if self.noise_seed is not None else "256 OS-entropy bits"
        sampling = (f"Poisson sampling: SHAKE-256 keyed by {key} (cryptographic)" if self.poisson_sampling
                    else "sampling: the DataLoader's own batches (not Poisson; epsilon is not a formal guarantee)")
        if self.secure_mode:
            noise = ("noise: ChaCha20 keyed per tensor by 256 OS-entropy bits (cryptographic stream; Gaussians"
                     " four-draw hardened, not proven against floating-point attacks)")
        elif self.noise_seed is not None:
            noise = "noise: reproducible from noise_seed (private only while that seed is secret)"
        elif self.noise is not None and self.noise.keystream:
            noise = ("noise: AES-256-CTR keystreams keyed by 256 OS-entropy bits (cryptographic stream; Gaussians by"
                     " Box-Muller, not hardened against floating-point attacks: secure_mode=True hardens them)")
        else:
            noise = ("noise: Philox generators keyed by 256 OS-entropy bits (hardened, not cryptographic;"
                     " secure_mode=True for a cryptographic stream)")
        projections = ""
        if self.randomized:
            on_cpu = self.noise is None or self.noise.device.type == "cpu"
            state = "MT19937 generators (all 624 state words" if on_cpu else "Philox generators (seed and offset"
            projections = (f"; norm projections: {state} keyed by {key} through SHAKE-256; not a cryptographic"
                           " stream)")
        earlier = ("; before a resume: noise and sampling reproducible from a noise_seed (private only while that"
                   " seed is secret)" if self.earlier_reproducible and self.noise_seed is None else "")
        return f"Randomness: {sampling}; {noise}{projections}{earlier}."

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> Optional[dict[str, Any]]:
        """What a resumed run needs: the plan and the accountant's history. Never the noise's or the sampler's
        secrets: a resumed run draws fresh ones. ``None`` before a fit has started training or restored a checkpoint.

        A checkpoint restored by a fit that then trained no step (resumed at its last step, where Lightning skips
        training) gives its own state back, so a save then keeps the weights' DP history."""
        trained = self.noise is not None and self.plan is not None
        if trained:
            plan = self.plan.state_dict()  # type: ignore[union-attr]
        elif self._restored_plan is not None:
            plan = self._restored_plan
        else:
            return None
        return {"plan": plan, "accountant": self.accountant.state_dict(), "run_id": self.run_id,
                "ledger": self.ledger_path, "ledger_since": self.ledger_since, "ledger_marked": self.ledger_marked,
                "without_lines": sorted(self.without_lines), "damaged_counted": self.damaged_counted,
                "beside_counted": self.beside_counted,
                "rolled_back_steps": self.rolled_back_steps, "accounting_incomplete": self.accounting_incomplete,
                "ran_without_poisson": self.earlier_without_poisson or (trained and not self.poisson_sampling),
                "ran_reproducibly": self.earlier_reproducible or (trained and self.noise_seed is not None),
                "noise_tails": sorted(list(tail) for tail in (self.noise_tails if trained else self.earlier_tails))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the checkpoint's accounting; its plan fixes the mechanism when training starts."""
        self.close_ledger()  # this session's ledger, if open, records another run's steps
        self.accountant.load_state_dict(state["accountant"])
        self.plan = None  # an earlier fit's plan, with the restored history, is no state a save may write
        self._restored_plan = state["plan"]
        self.run_id = state.get("run_id")
        self.ledger_path = state.get("ledger")
        self.ledger_since = state.get("ledger_since")
        self.ledger_marked = state.get("ledger_marked", False)
        self.without_lines = set(state.get("without_lines", ()))
        self.damaged_counted = state.get("damaged_counted", 0)
        self.beside_counted = state.get("beside_counted", 0)
        self.rolled_back_steps = state.get("rolled_back_steps", 0)
        self.accounting_incomplete = state.get("accounting_incomplete", False)
        self.earlier_without_poisson = state.get("ran_without_poisson", False)
        self.earlier_reproducible = state.get("ran_reproducibly", False)
        self.earlier_tails = {NoiseTail(int(terms), float(cut_off)) for terms, cut_off in state.get("noise_tails", ())}

    def load_finished_fit(self, state: dict[str, Any], noise_device: torch.device | str) -> None:
        """Take over a fit that ran in other processes from its rank 0's `state_dict` (Lightning's spawn and fork
        launchers bring it back): the plan, the accountant's history, epsilon, the guarantee and a checkpoint's privacy
        state read here as there, and a next fit continues the accounting as a resume from that state would.

        No secret of the fit comes along (``state`` is what a checkpoint holds). The noise here only says how the fit
        drew (on ``noise_device``, which the guarantee describes): it has a fresh key of its own, draws nothing, and
        the next fit replaces it.
        """
        self.load_state_dict(state)
        self.plan = PrivacyPlan(**state["plan"])
        self.noise = GaussianNoise(noise_device, secure_mode=self.secure_mode)


def _most_costly(lines: list[LedgerEntry], counted: int) -> list[LedgerEntry]:
    """All but ``counted`` of ``lines``, the most costly kept (least noise, highest sampling rate first): the lines an
    earlier resume counted are not known one by one, so the new ones are taken to cost at least as much."""
    ordered = sorted(lines, key=cost_order)
    return ordered[:max(0, len(lines) - counted)]


def _worst_step(entries: list[LedgerEntry], restored_plan: Optional[dict[str, Any]]) -> LedgerEntry:
    """A step with the least noise and the highest sampling rate among the run's recorded ones and its checkpoint's
    plan: what a lost ledger line is counted as."""
    steps = list(entries)
    if restored_plan is not None:
        steps.append(LedgerEntry(-1, float(restored_plan["noise_multiplier"]), float(restored_plan["sample_rate"])))
    return LedgerEntry(-1, min(step.noise_multiplier for step in steps), max(step.sample_rate for step in steps),
                       poisson=all(step.poisson for step in steps),
                       reproducible=any(step.reproducible for step in steps))
