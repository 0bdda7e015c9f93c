"""Gradient clipping that sees the global gradient under every strategy.

Under none/dp/ddp/zero1 every rank holds the full, already all-reduced
gradient, so ``torch.nn.utils.clip_grad_norm_`` is right as it is. Under FSDP
each rank holds a shard: a local norm would be the norm of 1/N of the
gradient, and ranks would clip by different factors. The gradients there are
DTensors, so the norm is computed with PyTorch's own ``get_total_norm`` (a
DTensor with a pending reduction) and completed with ``full_tensor()`` (one
all-reduce), as torchtitan does.
"""

from __future__ import annotations

import torch
from torch import nn


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """Clip the gradients of ``model`` to ``max_norm``; return the global norm before clipping.

    Call it after the last backward of the step (after ``amp.unscale_(opt)``
    under fp16) and before ``opt.step()``; every rank must call it.

    >>> norm = mg.clip_grad_norm_(model, 1.0)
    """
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return torch.tensor(0.0)
    total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    from torch.distributed.tensor import DTensor

    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total
