"""Tests of lightning_longshield and the simulate planner, grouped by subject (one folder each)."""
