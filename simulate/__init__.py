"""Analytic memory, communication and throughput model for LongShield runs (no torch required).

>>> from simulate import plan, max_seq_len
>>> p = plan(model="llama3.1-8b", gpus=4, method="v2", mbs=1, seq_len=16384)
>>> p.fits, round(p.peak_memory_gib), max_seq_len(model="llama3.2-1b", gpus=4, method="v3").config.seq_len
(True, 71, 1048576)
"""

from simulate.config import METHODS, RunConfig, make_config, plan_strategy
from simulate.memory import MemoryBreakdown, estimate_memory
from simulate.planner import Plan, compare, evaluate, max_seq_len, plan, recommend
from simulate.specs import GPU_PRESETS, MODEL_PRESETS, GPUSpec, ModelSpec, get_gpu_spec, get_model_spec
from simulate.throughput import StepTime, estimate_step_time

__all__ = [
    "GPU_PRESETS", "METHODS", "MODEL_PRESETS", "GPUSpec", "MemoryBreakdown", "ModelSpec", "Plan", "RunConfig",
    "StepTime", "compare", "estimate_memory", "estimate_step_time", "evaluate", "get_gpu_spec", "get_model_spec",
    "make_config", "max_seq_len", "plan", "plan_strategy", "recommend",
]
