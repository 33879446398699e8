"""lightning_longshield: differentially private long-context LLM training inside PyTorch Lightning.

Importing the package registers the ``"longshield"`` strategy, so ``Trainer(strategy="longshield")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_longshield.callbacks import PrivacyMonitor
from lightning_longshield.module import CausalLMModule
from lightning_longshield.preemption import PreemptionCheckpoint
from lightning_longshield.preflight import PreflightMemoryError
from lightning_longshield.strategy import LongShieldStrategy
from simulate.strategy_config import PerLayerClipping, ProjectedNorms, StrategyConfig

if "longshield" not in StrategyRegistry:
    LongShieldStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "CausalLMModule",
    "LongShieldStrategy",
    "PerLayerClipping",
    "PreemptionCheckpoint",
    "PreflightMemoryError",
    "PrivacyMonitor",
    "ProjectedNorms",
    "StrategyConfig",
]
__version__ = "0.1.0"
