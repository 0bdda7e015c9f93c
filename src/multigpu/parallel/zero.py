"""Strategy ``"zero1"``: DDP plus ``ZeroRedundancyOptimizer`` (ZeRO stage 1).

Gradients are all-reduced by DDP exactly as under ``"ddp"``; the optimizer
state (Adam's two moments: 2x the parameters in fp32) is split across ranks.
Each rank steps only its shard of the parameters, then broadcasts the updated
shard. Since ZeRO-1 lives in the optimizer, the strategy has two halves:
``mg.wrap(model, "zero1")`` and ``mg.optimizer(model, torch.optim.AdamW, ...)``,
which builds the sharded optimizer for a zero1 model and a plain one for every
other strategy, so the training script is the same for all of them.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import torch
from torch import nn

from ..errors import UsageError
from .ddp import DDP, build_ddp

# Optimizers whose step needs every parameter at once, so stepping shards
# independently changes the algorithm: L-BFGS re-evaluates the whole loss in
# its line search through a closure (each rank would search on its own
# shard's direction) and keeps one flat history over all parameters.
UNSHARDABLE = {
    torch.optim.LBFGS: "its line search and history span all parameters at once",
}


class ZeroOneDDP(DDP):
    """DDP whose optimizer ``mg.optimizer`` shards: the type is how ``strategy_of`` tells zero1 from ddp."""


def wrap_zero1(
    model: nn.Module,
    bucket_cap_mb: float | None = None,
    static_graph: bool | None = None,
    find_unused_parameters: bool | None = None,
    gradient_as_bucket_view: bool | None = None,
    sync_batchnorm: bool = False,
) -> nn.Module:
    """DDP over ``model``, of the type for which ``mg.optimizer`` shards the optimizer state."""
    return build_ddp(model, "zero1", ZeroOneDDP, sync_batchnorm=sync_batchnorm, bucket_cap_mb=bucket_cap_mb,
                     static_graph=static_graph, find_unused_parameters=find_unused_parameters,
                     gradient_as_bucket_view=gradient_as_bucket_view)


def is_zero_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a ``ZeroRedundancyOptimizer``."""
    return optimizer is not None and isinstance(optimizer, _zero_class())


@functools.cache
def _zero_class() -> type:
    # Imported once: `from torch.distributed.optim import ...` costs ~185 us per call (measured),
    # and no_sync asks strategy_of on every micro-batch.
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer


def check_optimizer_class(optimizer_class: Any, sharded: bool) -> None:
    if isinstance(optimizer_class, torch.optim.Optimizer):
        raise UsageError(
            f"mg.optimizer expects an optimizer class, got an instance of {type(optimizer_class).__name__}; "
            f"pass the class and its arguments: mg.optimizer(model, torch.optim.{type(optimizer_class).__name__}, lr=...)"
        )
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise UsageError(f"mg.optimizer expects a torch.optim.Optimizer subclass such as torch.optim.AdamW, "
                         f"got {optimizer_class!r}")
    if sharded:
        for cls, why in UNSHARDABLE.items():
            if issubclass(optimizer_class, cls):
                raise UsageError(
                    f"strategy 'zero1' cannot shard {optimizer_class.__name__}: {why}; "
                    "use strategy 'ddp' (or 'fsdp') with it, or a per-parameter optimizer such as torch.optim.AdamW"
                )


def build_zero_optimizer(params: Iterable[Any], optimizer_class: type, **defaults: Any) -> torch.optim.Optimizer:
    ZeroRedundancyOptimizer = _zero_class()

    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **defaults)
