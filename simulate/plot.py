"""Peak memory vs sequence length per method, as a PNG (matplotlib is imported only here, only when called)."""

from __future__ import annotations

from pathlib import Path

from simulate import calibration
from simulate.config import METHODS
from simulate.memory import estimate_memory
from simulate.planner import candidate_seq_lens, probe_config


def plot_memory_vs_seq_len(path: str | Path, model: str, gpus: int | float | str, methods: tuple[str, ...],
                           mbs: int = 1, cp: int | None = None, gpu: str = "h100", precision: str = "bf16-mixed",
                           min_seq_len: int = 1024, max_seq_len: int = 262144) -> Path:
    """Write the plot to ``path``, creating missing folders, and return it. One line per method; dashed lines at the
    GPU's capacity and at the most TorchTitan can report before the run OOMs (capacity minus the memory outside the
    allocator)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("Plotting needs matplotlib: pip install 'lightning-longshield[plot]'.") from err

    if not methods:
        raise ValueError("Give at least one method to plot.")
    fig, ax = plt.subplots(figsize=(8, 5))
    for method in methods:
        method_cp = cp if METHODS[method].context_parallel else None
        probe = probe_config(model=model, gpus=gpus, method=method, mbs=mbs, cp=method_cp, gpu=gpu,
                             precision=precision)
        lengths = [t for t in candidate_seq_lens(probe.cp_size) if min_seq_len <= t <= max_seq_len]
        peaks = [estimate_memory(probe.replace(seq_len=t)).peak_gib for t in lengths]
        ax.plot(lengths, peaks, marker="o", label=f"{method} (CP {probe.cp_size})")
    capacity = probe.gpu.memory_gib
    usable = capacity - calibration.CUDA_CONTEXT_GIB - calibration.NCCL_BUFFERS_GIB
    ax.axhline(capacity, color="red", linestyle="--", label=f"GPU capacity {capacity:.1f} GiB")
    ax.axhline(usable, color="orange", linestyle=":", label=f"reserved-memory limit {usable:.1f} GiB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel("peak reserved memory per GPU (GiB)")
    ax.set_title(f"{model}, {probe.inputs()['gpus']} x {gpu}, MBS {mbs}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=120, bbox_inches="tight")
    except OSError as err:
        raise ValueError(f"Cannot write the plot to {str(out)!r} ({err.strerror or err}); pick another --out.") from err
    finally:
        plt.close(fig)
    return out

