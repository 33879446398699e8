"""Analytic memory, communication and throughput model for LongShield runs (no torch required)."""
