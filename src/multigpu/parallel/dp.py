"""Strategy ``"dp"``: ``nn.DataParallel``, kept to compare against, never to train with.

One process drives every GPU with threads, re-replicates the model each step
and gathers the outputs on GPU 0; PyTorch's own docs recommend
DistributedDataParallel instead.
"""

from __future__ import annotations

import warnings

import torch.distributed as tdist
from torch import nn

from ..errors import UsageError


def wrap_dp(model: nn.Module, device_ids: list[int] | None = None) -> nn.Module:
    world = tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1
    if world > 1:
        raise UsageError(
            f"strategy 'dp' (nn.DataParallel) is single-process but this job has {world} processes; "
            "run it with -n 1 or use strategy 'ddp'"
        )
    warnings.warn(
        "strategy 'dp' (nn.DataParallel) is kept for comparison: one process drives all GPUs with threads, "
        "re-replicates the model every step and gathers outputs on GPU 0, so it is slower than 'ddp' "
        "(PyTorch docs recommend DistributedDataParallel); use 'ddp' for real runs",
        stacklevel=3,
    )
    return nn.DataParallel(model, device_ids=device_ids)
