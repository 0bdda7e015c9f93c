"""Gradient noise scale during training, from gradients data parallelism already has.

``NoiseScale`` (scale.py) measures; formulas.py holds the estimates and the
efficiency/gain formulas the planner shares; norms.py reads the squared
gradient norms where DDP, FSDP and accumulation leave them.
"""

from .formulas import efficiency, estimate, gain, steps_factor
from .scale import NoiseScale

__all__ = ["NoiseScale", "estimate", "efficiency", "gain", "steps_factor"]
