"""multigpu: take a PyTorch training loop from one GPU to many, and measure whether that worked.

The user owns the loop; multigpu supplies the runtime (``init``), the batch
plan, the world-size-invariant data order, the model wrapping and the
measurements. Importing this package has no side effects.
"""

from .batch import BatchPlan, scale_lr, warmup
from .clip import clip_grad_norm_
from .data import all_reduce_sum, eval_loader, loader
from .dist import Dist, init, print0
from .errors import UsageError
from .fsdp import full_state_dict
from .precision import Precision
from .strategy import accumulate, optimizer, unwrap, wrap

__version__ = "0.1.0"

__all__ = [
    "BatchPlan",
    "Dist",
    "Precision",
    "UsageError",
    "accumulate",
    "all_reduce_sum",
    "clip_grad_norm_",
    "eval_loader",
    "full_state_dict",
    "init",
    "loader",
    "optimizer",
    "print0",
    "scale_lr",
    "unwrap",
    "warmup",
    "wrap",
]
