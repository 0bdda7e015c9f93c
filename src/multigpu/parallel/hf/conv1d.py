"""Tensor parallelism for transformers' ``Conv1D`` (GPT-2's projections): a Linear stored transposed.

``transformers.pytorch_utils.Conv1D`` keeps its weight as (in, out) and computes
``addmm(bias, x, weight)``, so PyTorch's ``ColwiseParallel`` / ``RowwiseParallel``
(written for nn.Linear's (out, in)) would shard the wrong dimension. These two
``ParallelStyle``\\ s shard it with DTensor parameters and run the forward on the
local shards, with PyTorch's own collectives (DTensor redistributes; nothing
hand-written):

- ``Conv1DColwise(parts)``: weight ``Shard(1)``, bias ``Shard(0)``; with ``parts > 1``
  (a fused projection: GPT-2's ``c_attn`` holds q, k and v side by side) the weight is
  ``_StridedShard(1, split_factor=parts)``, so rank r holds ``[q_r, k_r, v_r]`` and
  ``full_tensor()`` (state dicts, DCP checkpoints) gives back one process's
  ``[q, k, v]``; the fused bias stays Replicate and each rank takes its parts in the
  forward (a redistribute to the same strided placement; why: ``placements``). The input enters as a Replicate DTensor taken back with
  ``to_local(grad_placements=[Partial()])``: its gradient is all-reduced in the backward.
- ``Conv1DRowwise()``: weight ``Shard(0)``, bias ``Replicate``; the local matmul is
  a Partial DTensor redistributed to Replicate (one all-reduce), the bias added once after.

``divide_split_sizes`` then tells the owning attention that its fused output is
``1/tp`` as wide (GPT2Attention splits it by ``split_size``; its head views use -1).
transformers' own ``PackedColwiseParallel`` (``transformers/distributed/tensor_parallel.py``)
uses the same placement for packed weights.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from ...errors import UsageError
from ...runtime import compat


def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (by name, so asking does not import transformers): weight (nx, nf), bias (nf,)."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.ndim == 2
            and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _replicated_input(x: torch.Tensor, mesh: Any) -> torch.Tensor:
    """``x`` (the same on every TP rank) as a local tensor whose gradient is summed over the TP ranks:
    each rank's weight shard gives only its share of the input's gradient."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if isinstance(x, DTensor):
        x = x.redistribute(mesh, [Replicate()]) if x.placements != (Replicate(),) else x
    else:
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return x.to_local(grad_placements=[Partial()])


def _colwise_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    weight, bias = _local(module.weight), module.bias
    if module._tp_parts > 1:
        # The fused bias is kept whole on every TP rank and this rank's [q_r, k_r, v_r] taken here (a local
        # chunk; its gradient is all-gathered back in the backward): see Conv1DColwise.placements for why.
        bias = bias.redistribute(module._tp_mesh, [compat.strided_shard(0, module._tp_parts)])
    bias = _local(bias)
    x = _replicated_input(x, module._tp_mesh)
    out = torch.addmm(bias, x.reshape(-1, x.size(-1)), weight)
    return out.view(*x.shape[:-1], weight.size(1))


def _rowwise_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = module._tp_mesh
    x = _local(x)  # this rank's slice of the input features, the column-wise output before it
    weight = _local(module.weight)
    partial = (x.reshape(-1, x.size(-1)) @ weight).view(*x.shape[:-1], weight.size(1))
    out = DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()])
    return out.to_local() + _local(module.bias)


class _Conv1DStyle(ParallelStyle):
    forward: Any = None

    def placements(self) -> tuple[Any, Any]:
        raise NotImplementedError

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import distribute_tensor

        if not is_conv1d(module):
            raise UsageError(f"{type(self).__name__} shards transformers' Conv1D (weight (in, out)), got a "
                             f"{type(module).__name__}; use ColwiseParallel / RowwiseParallel for nn.Linear")
        for name, placement in zip(("weight", "bias"), self.placements()):
            param = getattr(module, name)
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(param.data, device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))
        # The forward itself is replaced (Conv1D's reshapes to the full self.nf): on the instance, so the module,
        # its class and its parameter names stay what one process has.
        object.__setattr__(module, "_tp_mesh", device_mesh)
        object.__setattr__(module, "_tp_parts", getattr(self, "parts", 1))
        module.forward = types.MethodType(type(self).forward, module)
        return module


class Conv1DColwise(_Conv1DStyle):
    """Column-wise TP for a Conv1D; ``parts``: how many equal projections it fuses (GPT-2's c_attn: 3).

    >>> parallelize_module(block, tp_mesh, {"attn.c_attn": Conv1DColwise(parts=3), "attn.c_proj": Conv1DRowwise()})
    """

    forward = _colwise_forward

    def __init__(self, parts: int = 1) -> None:
        super().__init__()
        self.parts = parts
        self.label = f"Conv1DColwise x{parts}" if parts > 1 else "Conv1DColwise"

    def placements(self) -> tuple[Any, Any]:
        from torch.distributed.tensor import Replicate, Shard

        if self.parts == 1:
            return Shard(1), Shard(0)
        # The fused bias stays Replicate: as _StridedShard(0, parts) FSDP would cut each TP rank's
        # [q_r, k_r, v_r] in dp_shard pieces across the parts' boundaries (3 parts in 2 pieces), a layout
        # no DTensor placement describes; FSDP2 on torch 2.13 still labels it (_StridedShard(0, sf=tp),
        # _StridedShard(0, sf=3)) and full_tensor() (state dicts, DCP checkpoints) then mixes q, k and v
        # (measured: 6.5e-3 off one process's bias under FSDP 2 x TP 2, the training itself exact).
        # The weight's parts lie along dim 1 and FSDP shards dim 0, so it keeps the strided placement.
        return compat.strided_shard(1, self.parts), Replicate()


class Conv1DRowwise(_Conv1DStyle):
    """Row-wise TP for a Conv1D (its input: the column-wise output before it, split by features)."""

    forward = _rowwise_forward
    label = "Conv1DRowwise"

    def placements(self) -> tuple[Any, Any]:
        from torch.distributed.tensor import Replicate, Shard

        return Shard(0), Replicate()


def fused_parts(parent: nn.Module, name: str, module: nn.Module) -> tuple[int, str]:
    """(3, "") when ``module`` (a Conv1D named ``name`` in ``parent``) fuses 3 equal projections that
    ``parent.split_size`` cuts apart (GPT-2's c_attn), else (0, why not)."""
    if not is_conv1d(module):
        return 0, f"a fused {type(module).__name__} (several projections in one weight) multigpu cannot split"
    split = getattr(parent, "split_size", None)
    if not isinstance(split, int) or split <= 0:
        return 0, (f"a fused Conv1D of {module.nf} outputs whose parent {type(parent).__name__} has no split_size "
                   "to cut it by")
    if module.nf != 3 * split:
        return 0, (f"a fused Conv1D of {module.nf} outputs that split_size {split} does not cut into 3 equal parts "
                   "(q, k, v of unequal widths, as grouped-query attention has), so tp cannot split it equally")
    return 3, ""


def check(model: nn.Module, name: str, style: _Conv1DStyle, tp: int) -> None:
    """Refuse a Conv1D style on ``name`` it cannot shard by ``tp``, in one line naming the module."""
    module = model.get_submodule(name)
    kind = "column-wise" if isinstance(style, Conv1DColwise) else "row-wise"
    if not is_conv1d(module):
        raise UsageError(f"tensor-parallel plan shards {name} {kind} with {type(style).__name__}, but it is a "
                         f"{type(module).__name__}, not transformers' Conv1D; use ColwiseParallel / RowwiseParallel "
                         "for nn.Linear, or drop it from the plan")
    if isinstance(style, Conv1DRowwise):
        size, what = module.nx, "input features"
    else:
        parts = style.parts
        if parts > 1:
            owner, _, leaf = name.rpartition(".")
            got, why = fused_parts(model.get_submodule(owner), leaf, module)
            if got != parts:
                raise UsageError(f"tensor-parallel plan shards {name} as {parts} fused projections, but it is "
                                 f"{why or f'a fusion of {got}'}; use tp=1 for this model, or drop {name} from the plan")
        size, what = module.nf // parts, "output features" + (f" per fused part ({module.nf} / {parts})" if parts > 1 else "")
    if size % tp:
        raise UsageError(f"tensor-parallel degree {tp} does not divide {name}'s {what} {size} ({kind}); "
                         f"use a tp that divides {size}, or drop {name} from the plan")


def divide_split_sizes(model: nn.Module, styles: dict[str, Any], tp: int) -> list[str]:
    """Tell each fused Conv1D's owner (GPT2Attention) that its local output is 1/tp as wide; the owners' names.

    GPT2Attention.forward splits c_attn's output by ``self.split_size`` and views heads with -1, so that
    one number is all that changes. It is divided only while it still equals the full part width
    (``check`` made sure it did): a value already divided (the same model spread twice) or one the
    model set itself to something else must not be divided again, which would mis-split q, k and v
    without an error.
    """
    owners = []
    for name, style in styles.items():
        if isinstance(style, Conv1DColwise) and style.parts > 1:
            owner_name = name.rpartition(".")[0]
            owner = model.get_submodule(owner_name)
            module = model.get_submodule(name)
            full = module.nf // style.parts  # nf stays the one-process width (only the forward was replaced)
            if owner.split_size == full:
                owner.split_size = full // tp
                owners.append(owner_name)
    return owners
