"""Privacy accounting: the history of DP steps, epsilon spent (cached), and how many more steps fit a budget."""

from __future__ import annotations

from typing import Any

from opacus.accountants import IAccountant, create_accountant

from lightning_longshield.privacy.epsilon import calibrate_noise_multiplier, epsilon

ACCOUNTANTS = ("prv", "rdp")


class PrivacyAccountant:
    """Records one ``(noise_multiplier, sample_rate)`` step per DP step and answers what it cost.

    Opacus's accountant keeps the history; epsilon comes from `privacy.epsilon` (Opacus's RDP, or its PRV with a
    bounded grid, so any history answers in about a second) and is cached per history. Also handles the
    non-private corner (noise 0 means epsilon is infinite) and answers "how many more steps fit in a budget" for
    the stop-at-budget logic.
    """

    def __init__(self, mechanism: str = "prv") -> None:
        if mechanism not in ACCOUNTANTS:
            raise ValueError(f"accountant={mechanism!r} is not supported; choose one of {ACCOUNTANTS}.")
        self.mechanism = mechanism
        self._accountant: IAccountant = create_accountant(mechanism)
        self._cache: dict[tuple[Any, float], float] = {}

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """Opacus history: ``(noise_multiplier, sample_rate, num_steps)`` runs."""
        return self._accountant.history

    @property
    def steps(self) -> int:
        return sum(steps for _, _, steps in self.history)

    def step(self, noise_multiplier: float, sample_rate: float) -> None:
        self._accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)

    def get_epsilon(self, delta: float) -> float:
        """Epsilon spent so far at ``delta`` (0 before any step, infinite if any step had no noise)."""
        return self._epsilon_of(list(self.history), delta)

    def _epsilon_of(self, history: list[tuple[float, float, int]], delta: float) -> float:
        key = (tuple(history), delta)
        if key not in self._cache:
            self._cache[key] = self._compute_epsilon(history, delta)
        return self._cache[key]

    def _compute_epsilon(self, history: list[tuple[float, float, int]], delta: float) -> float:
        return epsilon(history, delta, self.mechanism)

    def calibrate_noise_multiplier(self, target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
        """The noise multiplier whose ``steps`` steps at ``sample_rate`` spend at most ``target_epsilon``."""
        return calibrate_noise_multiplier(target_epsilon, delta, sample_rate, steps, self.mechanism)

    def epsilon_after(self, extra_steps: int, noise_multiplier: float, sample_rate: float, delta: float) -> float:
        """Epsilon if ``extra_steps`` more steps with these parameters were taken."""
        history = list(self.history)
        if extra_steps > 0 and history and history[-1][:2] == (noise_multiplier, sample_rate):
            history[-1] = (noise_multiplier, sample_rate, history[-1][2] + extra_steps)  # as `step` will record them
        elif extra_steps > 0:
            history.append((noise_multiplier, sample_rate, extra_steps))
        return self._epsilon_of(history, delta)

    def steps_within_budget(
        self, target_epsilon: float, noise_multiplier: float, sample_rate: float, delta: float, limit: int
    ) -> int:
        """The largest ``k <= limit`` such that ``k`` more steps keep epsilon at or below ``target_epsilon``."""

        def fits(k: int) -> bool:
            return self.epsilon_after(k, noise_multiplier, sample_rate, delta) <= target_epsilon

        if not fits(0):
            return 0
        if fits(limit):
            return limit
        low, high = 0, limit  # fits(low) and not fits(high)
        if self.mechanism == "prv":
            # The PRV answer is at most the RDP one, so the RDP boundary (free to find) is a feasible start.
            rdp = PrivacyAccountant("rdp")
            rdp.load_state_dict({"mechanism": "rdp", "history": self.history})
            low = rdp.steps_within_budget(target_epsilon, noise_multiplier, sample_rate, delta, limit)
            step = max(1, low // 4)
            while low + step < high and fits(low + step):  # gallop up to a bracket, then bisect it
                low, step = low + step, 2 * step
            high = min(high, low + step)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low

    def state_dict(self) -> dict[str, Any]:
        return {"mechanism": self.mechanism, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["mechanism"] != self.mechanism:
            raise ValueError(
                f"The checkpoint was accounted with {state['mechanism']!r} but this run uses {self.mechanism!r};"
                f" {resume_hint(state)}"
            )
        self._accountant.history = [tuple(entry) for entry in state["history"]]


def resume_hint(state: dict[str, Any]) -> str:
    """The strategy arguments that resume a checkpoint whose accountant state is ``state``."""
    if state.get("mechanism") == "randomized-prv":
        estimator, projections = state.get("estimator"), state.get("projections")
        if estimator == "hutch++":  # the envelope's Hutch++ counts the residual projections, k - k // 3 of k
            estimator = "hutchpp"
            projections = next(k for k in range(projections, 2 * projections + 2) if k - k // 3 == projections)
        return (f"resume with the norms it was trained with: norms=ProjectedNorms({estimator!r},"
                f" projection_dim={projections}).")
    return f"resume with exact norms (norms='materialize', 'ghost' or 'mixed') and accountant={state['mechanism']!r}."
