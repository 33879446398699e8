"""One DP-SGD step: per-sample gradients and norms, clipping paths and kernels, checkpointing, precision."""
