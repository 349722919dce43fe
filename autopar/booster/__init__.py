"""The Booster API: ``Booster(plugin=AutoParallelPlugin(...)).boost(model, optimizer, ...)``.

See :mod:`autopar.booster.booster` for the training loop and :class:`AutoParallelPlugin` for
the options. Torch is imported when this package is, not by ``import autopar``.
"""

from autopar.booster.booster import Booster
from autopar.booster.gemini import GeminiPlugin
from autopar.booster.hybrid import HybridParallelPlugin
from autopar.booster.low_level_zero import LowLevelZeroPlugin
from autopar.booster.mixed_precision import FP16TorchMixedPrecision
from autopar.booster.moe_hybrid import MoeHybridParallelPlugin
from autopar.booster.optimizer import BoostedOptimizer
from autopar.booster.plugin import AutoParallelPlugin
from autopar.booster.torch_plugins import TorchDDPPlugin, TorchFSDPPlugin

__all__ = ["Booster", "AutoParallelPlugin", "BoostedOptimizer", "FP16TorchMixedPrecision", "GeminiPlugin",
           "HybridParallelPlugin", "LowLevelZeroPlugin", "MoeHybridParallelPlugin", "TorchDDPPlugin", "TorchFSDPPlugin"]
