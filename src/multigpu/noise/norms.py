"""Where NoiseScale reads squared gradient norms, and when.

Timing comes from the autograd engine, not from a communication hook. The
first gradient of a backward (a post-accumulate-grad hook; under FSDP the
first reduce-scatter) queues a callback; the engine runs queued callbacks in
order once the graph is done, and runs callbacks queued *by a callback* after
those (torch/csrc/autograd/engine.cpp, ``GraphTask::exec_post_processing``:
"more callbacks may be added in between callback calls"). So:

* ``before`` runs before DDP's ``finalize_backward``, which DDP queues when
  its last gradient is ready (a parameter's own hooks run before DDP's hook
  on it): ``p.grad`` still holds this rank's gradient (DDP reduces copies in
  its buckets when ``gradient_as_bucket_view=False``);
* ``after``, queued by ``before``, runs after DDP's finalize and FSDP's root
  post-backward callback: ``p.grad`` holds the averaged gradient (or its
  shard), before any user code (unscale, clipping) touches it.

DDP keeps its C++ all-reduce or whichever comm hook the user registered: a
Python comm hook alone costs more than the whole measurement (measured in
benchmarks/noise_overhead.py). Under FSDP2 the rank gradients exist only
inside the reduce-scatter, so ``ReduceScatterNorms`` wraps it (FSDP's public
``set_custom_reduce_scatter``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.distributed as tdist

from ..runtime.compat import foreach_norms
from ..errors import UsageError


def norm_parts(tensors: list[torch.Tensor], weights: list[float] | None = None) -> list[torch.Tensor]:
    """The tensors' L2 norms (fp32 scalars): the sum of their squares is the squared norm of all.

    ``weights``: a factor per norm (the square root of the share of the squared
    norm this rank counts, layout.py), or None for all 1.

    One fused norm call (``compat.foreach_norms``: what ``clip_grad_norm_`` runs; the
    public ``get_total_norm`` wraps it in ~15 µs of Python per call), accumulated in fp32
    whatever the dtype (fp16 norms overflow). Stacking, squaring and summing
    wait for ``sum_sq``, which does it for many steps in one go: every tensor
    op costs host time, measured against steps of a few milliseconds.
    """
    if not tensors:
        return [torch.zeros((), dtype=torch.float32)]
    return foreach_norms(tensors, weights)


def block_norms(flat: torch.Tensor, blocks: list[int] | None, weights: list[float] | None,
                shards: int) -> list[torch.Tensor]:
    """Weighted norms of the column blocks of a reduce-scatter input (``shards x sum(blocks)``, layout.py);
    the whole input's norm when every block counts alike (``blocks`` None, one weight or none)."""
    if blocks is None:
        return norm_parts([flat], weights)
    width = sum(blocks)
    if flat.numel() != shards * width:
        raise UsageError(f"NoiseScale expected an FSDP2 reduce-scatter input of {shards} x {width} elements, got "
                         f"{flat.numel()}: a parameter of this module had no gradient in this backward (unused this "
                         "step), so the tensor-parallel shares cannot be placed; use every parameter each step, or "
                         "leave the model unattached and call noise.observe(...) each step")
    return norm_parts(list(flat.view(-1, width).split(blocks, dim=1)), weights)


def sum_sq(parts: list[list[torch.Tensor]]) -> torch.Tensor:
    """``[sum(t^2 for t in p) for p in parts]`` in float64, as one vector."""
    lengths = [len(p) for p in parts]
    flat = torch.stack([t for p in parts for t in p]).double().square()
    if len(set(lengths)) == 1:
        return flat.view(len(parts), -1).sum(1)
    return torch.stack([chunk.sum() for chunk in flat.split(lengths)])


def loss_scale(scaler: Any, device: torch.device) -> torch.Tensor | None:
    """The loss scale of the backward in progress (None without a scaler)."""
    if scaler is not None and not hasattr(scaler, "get_scale"):
        scaler = getattr(scaler, "scaler", None)  # an mg.Precision: its GradScaler, or None below fp16
    if scaler is None:
        return None
    # GradScaler keeps its scale in a device tensor: reading it avoids the host
    # sync of get_scale(); it must be read now, before scaler.update().
    t = getattr(scaler, "_scale", None)
    if isinstance(t, torch.Tensor):
        return t.detach().to(device=device, dtype=torch.float64).reshape(())
    return torch.tensor(float(scaler.get_scale()), device=device, dtype=torch.float64)


def local_tensors(grads: Iterator[torch.Tensor | None]) -> list[torch.Tensor]:
    """The gradients present, as plain tensors: a DTensor's local part.

    A partial DTensor (the gradient of a norm's weight under sequence parallelism
    stays ``Partial(sum)`` in ``p.grad``) is summed over its ranks first: its local
    part is not a piece of the gradient. One small all-reduce each, on every rank
    alike (the same parameters in the same order).
    """
    out = []
    for g in grads:
        if g is None:
            continue
        placements = getattr(g, "placements", None)
        if placements is None:
            out.append(g)
            continue
        if any(p.is_partial() for p in placements):
            from torch.distributed.tensor import Replicate

            g = g.redistribute(placements=[Replicate() if p.is_partial() else p for p in placements])
        out.append(g.to_local())
    return out


def queue_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward has finished (after those queued before)."""
    from ..runtime.compat import queue_backward_callback

    queue_backward_callback(fn)


class ReduceScatterNorms:
    """An FSDP2 reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) that shows ``on_input`` each input.

    The input is the flat, zero-padded concatenation of this rank's unsharded
    gradients of one parameter group: its squared norm is the group's share
    of ``|g_i|^2`` (under tensor parallelism, weighted per column block). Duck-typed on FSDP's ``ReduceScatter`` interface
    (``allocate`` + call), whose class lives in a private module; the
    reduction itself is the public ``reduce_scatter_tensor``, as FSDP's default.
    """

    def __init__(self, on_input: Callable[..., None], blocks: list[int] | None = None,
                 weights: list[float] | None = None) -> None:
        self.on_input = on_input
        self.blocks, self.weights = blocks, weights  # this module's layout (layout.py), None without TP

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self.on_input(input_tensor, op, self.blocks, self.weights, group.size())
        return _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


# torch 2.13 renamed reduce_scatter_tensor (deprecated there) to reduce_scatter_single.
_reduce_scatter = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor


def is_plain_sum(op: Any) -> bool:
    """FSDP passes a plain SUM only when it pre-divided the input by a factor it does not pass on."""
    return op == tdist.ReduceOp.SUM
