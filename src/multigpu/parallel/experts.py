"""Expert parallelism: each rank holds experts/ep of every MoE layer's experts, and the routed tokens travel to them.

The ``ep`` degree borrows its ranks from the data-parallel shard degree (torchtitan's ``dp_shard = efsdp x
ep``; here efsdp is 1: ``ep = dp_shard``), so a layout keeps its world and global batch. What it spreads
is transformers 5's experts modules (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...): one module per MoE layer
holding every expert's weights as 3-D parameters whose first dimension is the expert (``gate_up_proj``
``(E, 2F, D)``, ``down_proj`` ``(E, D, F)``), called as ``experts(hidden (T, D), top_k_index (T, K),
top_k_weights (T, K))``. The router and everything else stay as the layout spreads them (FSDP over the
dense parameters; the experts are left out of FSDP, ``ignored_params``).

Dropless dispatch, on PyTorch's own collectives (functional ``all_to_all_single``, so autograd flows):

1. the (token, slot) pairs sorted by expert (stable), the counts per expert exchanged;
2. the rows sent to the rank that holds their expert (uneven splits, zero included), there;
3. the experts module's own forward (its configured implementation: eager loop, batched or grouped GEMM)
   run on the rows received, with this rank's slice of its weights and each row's local expert;
4. the rows sent back, weighted by their routing scores and summed per token in expert order, as the
   module itself sums them.

So every token meets the same expert weights in the same order as on one process. The weights are DTensors
``Shard(0)`` on the expert-parallel mesh: ``mg.clip_grad_norm_`` and DCP see the whole expert set. Their
gradient collects every rank's tokens through the all-to-all's backward and is divided by the data-parallel
size, as FSDP divides the dense parameters' (each rank's loss is its share's mean).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ..errors import UsageError


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules of ``model``: an ``int`` ``num_experts`` and own parameters that all have that many
    experts first, 3-D weights among them (transformers 5's fused experts, with 2-D biases in some; a router's
    2-D weight alone is not one)."""
    found = []
    for name, module in model.named_modules():
        n = getattr(module, "num_experts", None)
        params = list(module.parameters(recurse=False))
        if (isinstance(n, int) and n > 0 and params and all(p.dim() >= 2 and p.shape[0] == n for p in params)
                and any(p.dim() == 3 for p in params)):
            found.append((name, module))
    return found


def check(model: nn.Module, layout: Any) -> list[tuple[str, nn.Module]]:
    """The experts ``layout.ep`` spreads, or a one-line refusal of what it cannot."""
    name = type(model).__name__
    found = expert_modules(model)
    if not found:
        raise UsageError(f"expert parallelism (ep={layout.ep}) spreads the experts of a mixture-of-experts model, but "
                         f"{name} has no experts module (3-D expert weights and num_experts); use ep=1")
    counts = sorted({m.num_experts for _, m in found})
    if any(n % layout.ep for n in counts):
        fits = [d for d in range(1, layout.ep + 1) if all(n % d == 0 for n in counts)]
        raise UsageError(f"ep={layout.ep} does not divide the {', '.join(map(str, counts))} experts of {name}; use "
                         f"ep={max(fits)}")
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        raise UsageError(f"{name} adds the router's load-balancing loss (output_router_logits=True), which under ep "
                         "would be each rank's tokens' loss, not the batch's; set output_router_logits=False, or ep=1")
    return found


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``factor`` (1 / the data-parallel size, as FSDP averages)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


class _Local:
    """The experts module as its own forward sees it on this rank: its attributes, with this rank's slice of
    its weights and its number of local experts."""

    def __init__(self, module: nn.Module, local: dict[str, Any]) -> None:
        self.__dict__.update(_module=module, _local=local)

    def __getattr__(self, name: str) -> Any:
        local = self.__dict__["_local"]
        return local[name] if name in local else getattr(self.__dict__["_module"], name)


def apply(found: list[tuple[str, nn.Module]], layout: Any, mesh: Any) -> list[nn.Parameter]:
    """Spread the experts modules ``found`` (``check``'s) over ``mesh`` (the expert-parallel ranks): each rank
    keeps its slice of every module's weights (a DTensor ``Shard(0)``) and runs the dispatch above. Returns
    the expert parameters (for FSDP to leave out)."""
    from torch.distributed.tensor import DTensor, Shard

    ep, rank = mesh.size(), mesh.get_local_rank()
    params = []
    for _, module in found:
        local = module.num_experts // ep
        for pname, p in list(module.named_parameters(recurse=False)):
            shard = p.detach()[rank * local:(rank + 1) * local].clone()
            new = nn.Parameter(DTensor.from_local(shard, mesh, [Shard(0)], run_check=False), p.requires_grad)
            setattr(module, pname, new)
            params.append(new)
        module.forward = functools.partial(_forward, module, type(module).forward, mesh.get_group(), ep, local,
                                           1.0 / layout.dp_size)
    return params


def _forward(module: nn.Module, forward: Any, group: Any, ep: int, local: int, grad_scale: float,
             hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

    n_experts = ep * local
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)            # the (token, slot) pairs in expert order
    token = order // k
    counts = torch.bincount(flat, minlength=n_experts)  # rows per expert, this rank's tokens
    received = all_to_all_single(counts, None, None, group).wait()  # (ep, local): from each rank, per local expert
    send, recv = counts.view(ep, local).sum(1).tolist(), received.view(ep, local).sum(1).tolist()
    rows = all_to_all_single_autograd(hidden[token], recv, send, group)
    ids = torch.arange(local, device=flat.device).repeat(ep).repeat_interleave(received)  # each row's local expert
    weights = {n: _ScaleGrad.apply(p.to_local(), grad_scale) for n, p in module.named_parameters(recurse=False)}
    out = forward(_Local(module, {**weights, "num_experts": local}), rows, ids[:, None],
                  torch.ones(len(ids), 1, dtype=top_k_weights.dtype, device=rows.device))
    if len(ids) == 0:
        # No token for this rank's experts. Their gradient is zeros, as on one process (not None), and the
        # output still hangs on the rows received, so this rank's backward runs the dispatch's all-to-all as
        # the others' do (without, the ranks' collectives no longer pair up: a hang).
        out = out + (rows.sum() + sum(w.sum() for w in weights.values())) * 0
    back = all_to_all_single_autograd(out, send, recv, group)
    scores = top_k_weights.reshape(-1)[order]
    return torch.zeros_like(hidden).index_add_(0, token, (back * scores[:, None]).to(hidden.dtype))
