"""The router's load-balancing loss over the batch's tokens, not one rank's: equal to one process's on any layout.

A transformers mixture of experts adds ``router_aux_loss_coef x load_balancing_loss_func(router_logits,
...)`` to its loss when ``output_router_logits`` is set. That loss is a product of two means over the
tokens (the share of assignments each expert got, times its mean routing probability), so each
data-parallel rank's own tokens give another number than the batch's, and averaging the ranks' gradients
does not repair it. Here the family's own function runs on every data-parallel rank's router logits
(gathered, in data-parallel rank order: the batch's order), so each rank computes one process's value. The
gather's backward sums what each rank's copy of the loss sends back, dp times the one gradient, and the
data-parallel mean of the gradients divides it again: one process's gradient.

What one forward sees is one micro-batch: under gradient accumulation the loss is the micro-batch's (over
every rank's share of it), as on one process that accumulates the same micro-batches.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from typing import Any

import torch
from torch import nn

FUNCTION = "load_balancing_loss_func"  # the module-level name every transformers MoE family calls it by
_GROUP: contextvars.ContextVar = contextvars.ContextVar("multigpu_router_group", default=None)


def has_router_loss(model: nn.Module) -> bool:
    """Whether ``model``'s family adds a router load-balancing loss of the router logits (its modeling module
    defines one taking ``gate_logits``: 33 families of transformers 5.24; Switch's takes probabilities)."""
    function = getattr(sys.modules.get(type(model).__module__), FUNCTION, None)
    function = getattr(function, "_multigpu_original", function)  # the family's own, once wrapped
    return function is not None and "gate_logits" in inspect.signature(function).parameters


def over_ranks(model: nn.Module, group: Any) -> None:
    """Make ``model``'s router loss the loss over ``group``'s tokens (the data-parallel ranks) while it runs
    forward. The family's function is wrapped once per process; outside a spread model's forward (a
    one-process model beside it, another model) it is the function itself."""
    module = sys.modules[type(model).__module__]
    original = getattr(module, FUNCTION)
    if not getattr(original, "_multigpu_global", False):
        wrapped = functools.partial(_global, original, inspect.signature(original))
        wrapped._multigpu_global, wrapped._multigpu_original = True, original
        setattr(module, FUNCTION, wrapped)
    tokens: list = []

    def enter(*_):
        tokens.append(_GROUP.set(group))

    def leave(*_):
        _GROUP.reset(tokens.pop())

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)


def _global(original: Any, signature: inspect.Signature, *args: Any, **kwargs: Any) -> Any:
    group = _GROUP.get()
    bound = signature.bind(*args, **kwargs)
    gate_logits, mask = bound.arguments.get("gate_logits"), bound.arguments.get("attention_mask")
    if group is None or not isinstance(gate_logits, tuple) or not gate_logits:
        return original(*args, **kwargs)
    layers = len(gate_logits)
    rows = _gather(torch.stack(gate_logits), group, grad=True)  # per rank: (layers, tokens, experts)
    bound.arguments["gate_logits"] = tuple(torch.cat([r[i] for r in rows]) for i in range(layers))
    if mask is not None:
        bound.arguments["attention_mask"] = torch.cat(_gather(mask, group, grad=False))
    return original(*bound.args, **bound.kwargs)


def _gather(x: torch.Tensor, group: Any, grad: bool) -> list[torch.Tensor]:
    """Every rank's ``x``, in rank order; dimension 1 (tokens; rows of a mask) may differ by rank."""
    import torch.distributed as tdist

    dim = 1 if grad else 0
    n = torch.tensor([x.shape[dim]], device=x.device)
    sizes = [torch.zeros_like(n) for _ in range(tdist.get_world_size(group))]
    tdist.all_gather(sizes, n, group=group)
    sizes = [int(s) for s in sizes]
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, max(sizes) - x.shape[dim]]
    padded = torch.nn.functional.pad(x, pad)
    parts = _AllGather.apply(padded, group) if grad else _all_gather(padded, group)
    return [p.narrow(dim, 0, s) for p, s in zip(parts, sizes)]


def _all_gather(x: torch.Tensor, group: Any) -> list[torch.Tensor]:
    import torch.distributed as tdist

    parts = [torch.empty_like(x) for _ in range(tdist.get_world_size(group))]
    tdist.all_gather(parts, x.contiguous(), group=group)
    return parts


class _AllGather(torch.autograd.Function):
    """Every rank's tensor; the backward sums each part's gradient over the ranks and keeps this rank's.
    (torch.distributed.nn's all_gather cannot: on gloo its backward scatters by group rank as if global.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any):
        import torch.distributed as tdist

        ctx.group, ctx.rank = group, tdist.get_rank(group)
        return tuple(_all_gather(x, group))

    @staticmethod
    def backward(ctx, *grads):
        import torch.distributed as tdist

        total = torch.stack(grads).contiguous()
        tdist.all_reduce(total, group=ctx.group)
        return total[ctx.rank], None
