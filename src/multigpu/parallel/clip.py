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

from ..errors import UsageError


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """Clip the gradients of ``model`` to ``max_norm``; return the global norm before clipping.

    Call it after the last backward of the step (after ``amp.unscale_(opt)``
    under fp16) and before ``opt.step()``; every rank must call it.

    >>> norm = mg.clip_grad_norm_(model, 1.0)
    """
    from ..spreads import refuse_stages

    # This rank's stages hold part of the model: their norm is not the model's (PP 2 gave each stage its own
    # norm, 0.330 and 0.678 where one process has 0.754), and each stage would clip by a different factor.
    refuse_stages(model, "mg.clip_grad_norm_", "use pipe.clip_grad_norm_(max_norm), the norm over every stage")
    groups = grouped(model.parameters())
    if not groups:
        return torch.tensor(0.0)
    total = group_norm(groups, norm_type, error_if_nonfinite, foreach)
    clip_groups(groups, max_norm, total, foreach)
    return total


def grouped(params) -> dict[object, list[torch.nn.Parameter]]:
    """Parameters with gradients, one group per device mesh, plus the plain tensors (key None).

    torch's norm refuses to mix DTensors and tensors (or DTensors of different meshes), which
    model parallelism gives: TP leaves the norms plain; FSDP x TP puts TP's weights on a 2-D mesh
    and the norms on a 1-D one.
    """
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    return groups


def clip_groups(groups: dict[object, list[torch.nn.Parameter]], max_norm: float, total: torch.Tensor,
                foreach: bool | None = None) -> None:
    """Scale every group's gradients by ``max_norm / total`` (if that is below 1), one group at a time."""
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach)


def group_norm(groups: dict[object, list[torch.nn.Parameter]], norm_type: float = 2.0,
               error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """The norm over every group's gradients, complete across the ranks each mesh spans."""
    from torch.distributed.tensor import DTensor

    parts = []
    for mesh, group in groups.items():
        grads = [p.grad for p in group]
        if mesh is not None and grads[0].to_local().device.type != mesh.device_type:
            # FSDP's cpu_offload: shards live on the CPU but the mesh (NCCL) on
            # the GPU, where DTensor's own reduction would send CPU tensors.
            part = norm_of_shards(grads, norm_type, error_if_nonfinite, foreach)
        else:
            part = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
            if isinstance(part, DTensor):
                part = part.full_tensor()
        parts.append(part)
    # Plain gradients are the same on every rank (DDP averaged them, or TP's replicated
    # inputs made them so): each group's norm counts once.
    return parts[0] if len(parts) == 1 else _combine(parts, norm_type)


def _combine(parts: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    device = parts[0].device
    stacked = torch.stack([p.to(device, torch.float64) for p in parts])
    if norm_type == float("inf"):
        return stacked.max().to(parts[0].dtype)
    return (stacked ** norm_type).sum().pow(1.0 / norm_type).to(parts[0].dtype)


def norm_of_shards(grads: list, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach: bool | None = None) -> torch.Tensor:
    """The global norm of DTensor gradients sharded (not replicated) over a 1-D mesh, reduced on the mesh's device.

    Each element lives on exactly one rank (FSDP's dim-0 shards; its padding
    is not part of ``to_local()``), so the p-th powers of the local norms add
    up to the p-th power of the global norm (the maxima, for p = inf).
    """
    mesh = grads[0].device_mesh
    local = torch.nn.utils.get_total_norm([g.to_local() for g in grads], norm_type, error_if_nonfinite, foreach)
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device(mesh.device_type)
    return reduce_norm(local, norm_type, mesh.get_group(), device)


def reduce_norm(local: torch.Tensor, norm_type: float, group, device: torch.device | None = None) -> torch.Tensor:
    """The norm over ``group``'s ranks from each rank's norm of elements no other rank holds (FSDP's shards,
    a pipeline's stages): the p-th powers add up (the maxima, for p = inf). Reduced in float64 on
    ``device`` (the group's, where it differs from the norm's), returned in ``local``'s dtype and device."""
    import torch.distributed as tdist

    total = local.to(device or local.device, torch.float64)
    if norm_type == float("inf"):
        tdist.all_reduce(total, op=tdist.ReduceOp.MAX, group=group)
    else:
        total = total ** norm_type
        tdist.all_reduce(total, group=group)
        total = total ** (1.0 / norm_type)
    return total.to(local.device, local.dtype)
