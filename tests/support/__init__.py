"""Modules the tests share: model and data builders, the multi-process runner, subprocess workers and probes."""
