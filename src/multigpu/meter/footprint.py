"""Per-rank bytes of training state: parameters, gradients, optimizer state.

Counted from the tensors' storage (each storage once), so sharded strategies
show what they really keep: an FSDP parameter counts its local shard
(``DTensor.to_local()``, including FSDP's padding), a ZeRO-1 optimizer only
the state of the parameters this rank steps. Buffers the strategies keep
besides these (DDP's gradient buckets, FSDP's transient all-gather buffers)
are not included: they are transient or implementation-defined, and the
CUDA allocator (``mg`` meters) sees them.

``LiveActivations`` counts the other half of training memory on any device:
the peak storage bytes of the tensors autograd saves for the backward
(``multigpu tune`` compares its prediction with it on CPU, where no allocator
keeps a peak). A storage counts once per saved tensor that refers to it, so
an input saved by several ops counts several times: an upper bound.
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


class LiveActivations:
    """Peak bytes autograd holds for the backward (saved tensors that are not parameters), live:
    each saved tensor is wrapped, and its bytes leave the count when autograd frees the wrapper."""

    def __init__(self, params) -> None:
        self.params = {_local(p).untyped_storage().data_ptr() for p in params}
        self.live = self.peak = 0

    def hooks(self):
        """The context inside which autograd's saved tensors are counted."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        if _local(t).untyped_storage().data_ptr() in self.params:
            return t  # a weight saved for its gradient: held anyway
        return _Held(t, self)

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, _Held) else h


class _Held:
    __slots__ = ("t", "n", "owner")

    def __init__(self, t: torch.Tensor, owner: LiveActivations) -> None:
        self.t, self.n, self.owner = t, _local(t).untyped_storage().nbytes(), owner
        owner.live += self.n
        owner.peak = max(owner.peak, owner.live)

    def __del__(self) -> None:
        self.owner.live -= self.n
