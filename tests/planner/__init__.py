"""The torch-free planner (simulate/): memory, throughput, CLI and the paper's tables."""
