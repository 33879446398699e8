"""Privacy auditing: empirical epsilon lower bounds from one training run (Steinke, Nasr and Jagielski, 2023)."""

from lightning_longshield.audit.bounds import (
    AuditResult,
    audit_p_value,
    best_epsilon_lower_bound,
    binomial_upper_tail,
    count_correct_guesses,
    epsilon_lower_bound,
)

__all__ = [
    "AuditResult",
    "audit_p_value",
    "best_epsilon_lower_bound",
    "binomial_upper_tail",
    "count_correct_guesses",
    "epsilon_lower_bound",
]
