"""multigpu: take a PyTorch training loop from one GPU to many, and measure whether that worked.

The user owns the loop; multigpu supplies the runtime (``init``), the batch
plan, the world-size-invariant data order, the model wrapping and the
measurements. Importing this package has no side effects.
"""

from .batch import BatchPlan, scale_lr, warmup
from .data import TokenShards, all_reduce_sum, eval_loader, loader, stream_eval_loader, stream_loader
from .dist import Dist, init, print0
from .errors import UsageError
from .finder import MicroBatchSearch, SequenceSearch, find_batch_requested, find_micro_batch, find_sequence_length
from .runtime.fingerprint import fingerprint
from .loss import token_divisor
from .meter import StepMeter, profile
from .noise import NoiseScale
from .parallel import accumulate, clip_grad_norm_, context_share, full_state_dict, optimizer, parallelize, unwrap, wrap
from .parallel.fault_tolerant import fault_tolerant
from .parallel.flags import layout_from_args
from .planner import ScaledRecipe, scale_recipe
from .precision import Precision

__version__ = "0.1.0"

__all__ = [
    "BatchPlan",
    "Checkpointer",
    "Dist",
    "MicroBatchSearch",
    "SequenceSearch",
    "NoiseScale",
    "Precision",
    "ScaledRecipe",
    "StepMeter",
    "TokenShards",
    "UsageError",
    "accumulate",
    "all_reduce_sum",
    "clip_grad_norm_",
    "context_share",
    "eval_loader",
    "fault_tolerant",
    "find_batch_requested",
    "find_micro_batch",
    "find_sequence_length",
    "fingerprint",
    "from_pretrained",
    "full_state_dict",
    "init",
    "layout_from_args",
    "loader",
    "optimizer",
    "parallelize",
    "print0",
    "save_pretrained",
    "profile",
    "scale_lr",
    "scale_recipe",
    "stream_eval_loader",
    "stream_loader",
    "token_divisor",
    "unwrap",
    "warmup",
    "wrap",
]


def __getattr__(name: str):
    # Checkpointer pulls in torch.distributed.checkpoint (about a second of
    # imports); load it on first use so `import multigpu` stays light.
    if name == "Checkpointer":
        from .checkpoint import Checkpointer

        return Checkpointer
    if name in ("from_pretrained", "save_pretrained"):
        from . import pretrained

        return getattr(pretrained, name)
    raise AttributeError(f"module 'multigpu' has no attribute {name!r}")
