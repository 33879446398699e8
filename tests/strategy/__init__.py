"""The strategy in Lightning: registration, input errors, checkpoints and resume."""
