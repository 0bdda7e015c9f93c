"""multigpu: take a PyTorch training loop from one GPU to many, and measure whether that worked.

The user owns the loop; multigpu supplies the runtime (``init``), the batch
plan, the world-size-invariant data order, the model wrapping and the
measurements. Importing this package has no side effects.
"""

from .batch import BatchPlan, scale_lr, warmup
from .dist import Dist, init, print0
from .errors import UsageError
from .noise import NoiseScale
from .planner import ScaledRecipe, scale_recipe

__version__ = "0.1.0"

__all__ = [
    "BatchPlan",
    "Dist",
    "NoiseScale",
    "ScaledRecipe",
    "UsageError",
    "init",
    "print0",
    "scale_lr",
    "scale_recipe",
    "warmup",
]
