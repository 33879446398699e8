"""Multi-process runs: context parallelism, data-parallel groups, the spawn launcher."""
