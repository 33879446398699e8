"""Memory: traced steps and the pre-flight check against real torch steps and modules."""
