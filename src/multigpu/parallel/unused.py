"""Experts' weights in every rank's backward, whatever the routing sent that rank.

FSDP reduce-scatters (and DDP all-reduces) the gradients a rank's backward produced, in the order they
came: a rank whose tokens all went elsewhere (LongCat-Flash's zero-computation experts take them without
touching a weight) leaves its experts' weights without gradients, its collectives no longer pair up with
the other ranks', and gloo aborts ("Received data size doesn't match expected size": the zoo's LongCat-Flash
under CP 2, 8 tokens a rank). Adding zero times the weights' sum to the experts' output gives each weight a
gradient of exactly 0 on every rank, so every rank reduces the same tensors; the output and every other
gradient are unchanged bit for bit (x + 0 = x, g + 0 = g for finite values).
"""

from __future__ import annotations

import torch
from torch import nn


def touch_experts(model: nn.Module) -> int:
    """Hook every experts module of ``model`` (shaped as experts, ``experts._candidates``, or a class named so:
    LongCat-Flash's holds more up- than down-projections, its zero-computation experts) so each step's
    backward reaches all of its weights; the number of modules hooked."""
    from .experts import _candidates

    found = {id(m): m for _, m in _candidates(model)}
    found |= {id(m): m for m in model.modules() if type(m).__name__.endswith("Experts") and any(True for _ in m.parameters())}
    for module in found.values():
        module.register_forward_hook(_touch)
    return len(found)


def _touch(module: nn.Module, args, output):
    if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor):
        return output
    weights = [p for p in module.parameters() if p.requires_grad]
    if not weights:
        return output
    zero = torch.stack([_local(p).sum().to(output.dtype) for p in weights]).sum() * 0
    return output + zero


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p
