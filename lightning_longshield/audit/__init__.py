"""Privacy auditing: empirical epsilon lower bounds from one training run (Steinke, Nasr and Jagielski, 2023)."""

from lightning_longshield.audit.bounds import (
    AuditResult,
    audit_p_value,
    best_epsilon_lower_bound,
    binomial_upper_tail,
    count_correct_guesses,
    epsilon_lower_bound,
)
from lightning_longshield.audit.canaries import GradientCanaries, InputCanaries
from lightning_longshield.audit.run import AuditReport, audit_training

__all__ = [
    "AuditReport",
    "AuditResult",
    "GradientCanaries",
    "InputCanaries",
    "audit_training",
    "audit_p_value",
    "best_epsilon_lower_bound",
    "binomial_upper_tail",
    "count_correct_guesses",
    "epsilon_lower_bound",
]
