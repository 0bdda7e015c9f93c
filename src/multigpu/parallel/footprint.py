"""Per-rank bytes of training state: parameters, gradients, optimizer state.

Counted from the tensors' storage (each storage once), so sharded strategies
show what they really keep: an FSDP parameter counts its local shard
(``DTensor.to_local()``, including FSDP's padding), a ZeRO-1 optimizer only
the state of the parameters this rank steps. Buffers the strategies keep
besides these (DDP's gradient buckets, FSDP's transient all-gather buffers)
are not included: they are transient or implementation-defined, and the
CUDA allocator (``mg`` meters) sees them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return asdict(self) | {"total": self.total}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _storage_bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        storage = _local(t).untyped_storage()
        key = (storage.device, storage.data_ptr())
        if key not in seen and storage.nbytes() > 0:
            seen.add(key)
            total += storage.nbytes()
    return total


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> StateBytes:
    """This rank's parameter, gradient and optimizer-state bytes.

    >>> state_bytes(model, opt).as_dict()
    {'params': 1056768, 'grads': 1056768, 'optimizer': 2113540, 'total': 4227076}
    """
    seen: set = set()
    params = list(model.parameters())
    p = _storage_bytes(params, seen)
    g = _storage_bytes([q.grad for q in params if q.grad is not None], seen)
    o = 0
    if optimizer is not None:
        # ZeroRedundancyOptimizer keeps this rank's state in its inner optimizer.
        inner = getattr(optimizer, "optim", optimizer)
        o = _storage_bytes([v for s in inner.state.values() for v in s.values()], seen)
    return StateBytes(p, g, o)
