"""The router's load-balancing loss over the batch's tokens, not one rank's: equal to one process's on any layout.

A transformers mixture of experts adds ``router_aux_loss_coef x load_balancing_loss_func(router_logits,
...)`` to its loss when ``output_router_logits`` is set. That loss is a product of two means over the
tokens (the share of assignments each expert got, times its mean routing probability), so each
data-parallel rank's own tokens give another number than the batch's, and averaging the ranks' gradients
does not repair it. A forward hook on the model (PyTorch's extension point; the family's function is not
touched) takes the output's ``router_logits`` and ``aux_loss``, runs the family's own function on every
data-parallel rank's router logits (gathered, in data-parallel rank order: the batch's order), and puts
that value in ``aux_loss`` and in place of the rank's own in ``loss``: ``loss + coef x (global - own)``,
whose gradient through the rank's own term is exactly zero (``coef - coef``). The gather's backward sums
what each rank's copy of the loss sends back, dp times the one gradient, and the data-parallel mean of the
gradients divides it again: one process's gradient.

The hook first runs the family's function on the rank's own logits with the numbers it read off the
model (experts, experts per token, the mask): a result other than the model's own ``aux_loss`` means
this family calls it otherwise, and it is refused in one line rather than trained on another loss.

What one forward sees is one micro-batch: under gradient accumulation the loss is the micro-batch's (over
every rank's share of it), as on one process that accumulates the same micro-batches.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch
from torch import nn

from ...errors import UsageError

FUNCTION = "load_balancing_loss_func"  # the module-level name every transformers MoE family calls it by


def _function(model: nn.Module) -> Any:
    return getattr(sys.modules.get(type(model).__module__), FUNCTION, None)


def has_router_loss(model: nn.Module) -> bool:
    """Whether ``model``'s family adds a router load-balancing loss of the router logits (its modeling module
    defines one taking ``gate_logits``: 33 families of transformers 5.24; Switch's takes probabilities)."""
    function = _function(model)
    return function is not None and "gate_logits" in inspect.signature(function).parameters


def over_ranks(model: nn.Module, group: Any) -> None:
    """Make ``model``'s router loss the loss over ``group``'s tokens (the data-parallel ranks) in every
    forward's output."""
    # The numbers the family passes are read once; the family's own value is checked against them at the first
    # forward (its calling convention does not change between forwards: a check per step is work for nothing).
    hook = functools.partial(_global, _function(model), inspect.signature(model.forward), group, _counts(model), [])
    model.register_forward_hook(hook, with_kwargs=True)


def _counts(model: nn.Module) -> tuple[Any, Any, Any]:
    """(experts, experts per token, loss coefficient) as the family's forward passes them: its own
    attributes, else its text config's (the multimodal families)."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config

    def read(*names: str) -> Any:
        for name in names:
            for owner in (model, text, config):
                if getattr(owner, name, None) is not None:
                    return getattr(owner, name)
        return None

    return (read("num_experts", "num_local_experts"), read("num_experts_per_tok", "top_k"),
            read("router_aux_loss_coef"))


def _global(function: Any, signature: inspect.Signature, group: Any, counts: tuple, checked: list,
            model: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    logits, own = getattr(output, "router_logits", None), getattr(output, "aux_loss", None)
    name = type(model).__name__
    if isinstance(output, tuple) and getattr(getattr(model, "config", None), "output_router_logits", False):
        raise UsageError(f"{name}'s router loss is made the batch's from its output's aux_loss, but its forward "
                         "returned a tuple (return_dict=False); leave return_dict on")
    if own is None or not isinstance(logits, tuple) or not logits:
        return output
    mask = signature.bind_partial(*args, **kwargs).arguments.get("attention_mask")
    experts, top_k, coef = counts
    if not checked:
        _check_call(function, name, logits, counts, mask, own)
        checked.append(True)
    batch = batch_loss(function, logits, experts, top_k, mask, group).to(own)
    if getattr(output, "loss", None) is not None:
        output.loss = output.loss + coef * (batch - own).to(output.loss.device)
    output.aux_loss = batch
    return output


def _check_call(function: Any, name: str, logits: tuple, counts: tuple, mask: Any, own: torch.Tensor) -> None:
    """Refuse a family whose own router loss is not ``function(logits, experts, top_k, mask)`` of the numbers
    read off the model: made the batch's from those, it would train another loss."""
    experts, top_k, coef = counts
    with torch.no_grad():
        try:
            mine = function(logits, experts, top_k, mask)
        except Exception:  # noqa: BLE001 - called otherwise: refused below
            mine = None
    if mine is None or coef is None or not torch.allclose(mine.to(own), own.detach(), rtol=1e-6, atol=0):
        raise UsageError(f"{name} computes its router load-balancing loss otherwise than "
                         f"{FUNCTION}(router_logits, {experts}, {top_k}, attention_mask), so it cannot be made the "
                         "batch's over the data-parallel ranks; set output_router_logits=False, or use one "
                         "data-parallel rank")


def batch_loss(function: Any, logits: tuple, experts: Any, top_k: Any, mask: Any, group: Any) -> torch.Tensor:
    """The family's ``function`` on every rank of ``group``'s router ``logits`` (a tensor of (tokens,
    experts) per layer) and ``mask``, gathered in rank order: the batch's router loss, on each rank."""
    layers = len(logits)
    rows = _gather(torch.stack(logits), group, grad=True)  # per rank: (layers, tokens, experts)
    gathered = tuple(torch.cat([r[i] for r in rows]) for i in range(layers))
    if mask is not None:
        mask = torch.cat(_gather(mask, group, grad=False))
    return function(gathered, experts, top_k, mask)


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
