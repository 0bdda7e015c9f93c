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

from ..errors import UsageError


def norm_parts(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors' L2 norms (fp32 scalars): the sum of their squares is the squared norm of all.

    One ``torch._foreach_norm`` call (what ``clip_grad_norm_`` runs; the public
    ``get_total_norm`` wraps it in ~15 µs of Python per call), accumulated in fp32
    whatever the dtype (fp16 norms overflow). Stacking, squaring and summing
    wait for ``sum_sq``, which does it for many steps in one go: every tensor
    op costs host time, measured against steps of a few milliseconds.
    """
    if not tensors:
        return [torch.zeros((), dtype=torch.float32)]
    return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))


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


def shard_replicas(params: list[torch.Tensor]) -> int:
    """How many ranks hold each FSDP2 shard: 1 on a 1-D mesh, the replicate degree under HSDP.

    A (replicate, shard) mesh places parameters ``(Replicate(), Shard(0))``. Other 2-D layouts
    (FSDP x tensor parallel) split what each rank's reduce-scatter input holds between its
    tensor-parallel peers, replicated parameters in full on each: refused, with the way out.
    """
    from torch.distributed.tensor import Replicate, Shard

    replicas = set()
    for p in params:
        mesh, placements = p.device_mesh, p.placements
        if mesh.ndim == 1:
            replicas.add(1)
        elif mesh.ndim == 2 and isinstance(placements[0], Replicate) and isinstance(placements[1], Shard):
            if mesh.size(1) == 1:
                raise UsageError("NoiseScale reads the rank gradients in FSDP2's reduce-scatter, which FSDP skips "
                                 "when each shard group has one rank (a replicate x 1 mesh is plain replication); "
                                 "use mg.wrap(model, 'ddp') for that, or shard over 2+ ranks")
            replicas.add(mesh.size(0))
        else:
            raise UsageError(f"NoiseScale reads FSDP2 and HSDP, but this model's parameters are placed "
                             f"{tuple(placements)} on a {mesh.ndim}-D mesh (tensor parallelism); leave it unattached "
                             "and call noise.observe(local_sq, total_sq) each step with the norms of each "
                             "data-parallel rank's full gradient and of the averaged one")
    if len(replicas) != 1:
        raise UsageError(f"NoiseScale found FSDP2 shards replicated {sorted(replicas)} times in one model; "
                         "shard every module over the same mesh, or call noise.observe(...) each step")
    return replicas.pop()


def local_tensors(grads: Iterator[torch.Tensor | None]) -> list[torch.Tensor]:
    """The gradients present, as plain tensors (a DTensor shard: its local part)."""
    out = []
    for g in grads:
        if g is None:
            continue
        to_local = getattr(g, "to_local", None)  # DTensor (FSDP2): this rank's shard
        out.append(to_local() if to_local is not None else g)
    return out


def queue_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward has finished (after those queued before)."""
    from ..compat import queue_backward_callback

    queue_backward_callback(fn)


class ReduceScatterNorms:
    """An FSDP2 reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) that shows ``on_input`` each input.

    The input is the flat, zero-padded concatenation of this rank's unsharded
    gradients of one parameter group: its squared norm is the group's share
    of ``|g_i|^2``. Duck-typed on FSDP's ``ReduceScatter`` interface
    (``allocate`` + call), whose class lives in a private module; the
    reduction itself is the public ``reduce_scatter_tensor``, as FSDP's default.
    """

    def __init__(self, on_input: Callable[[torch.Tensor, Any], None]) -> None:
        self.on_input = on_input

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self.on_input(input_tensor, op)
        return _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


# torch 2.13 renamed reduce_scatter_tensor (deprecated there) to reduce_scatter_single.
_reduce_scatter = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor


def is_plain_sum(op: Any) -> bool:
    """FSDP passes a plain SUM only when it pre-divided the input by a factor it does not pass on."""
    return op == tdist.ReduceOp.SUM
