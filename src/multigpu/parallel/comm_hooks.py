"""DDP gradient compression: PyTorch's ``ddp_comm_hooks``, chosen by name.

``"fp16"`` / ``"bf16"`` cast each gradient bucket to 16 bits for the
all-reduce (half the bytes; fp16 keeps more mantissa, bf16 more range).
``"powersgd"`` sends a rank-``powersgd_rank`` approximation of each gradient
matrix (Vogels et al. 2019) with error feedback, after ``powersgd_start_iter``
plain all-reduce steps. The hooks trade accuracy for bandwidth: they pay off
when the all-reduce, not the compute, bounds the step (slow inter-node links),
and cost time when it does not (see docs/strategies.md for measurements).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations
# as real objects (dist.GradBucket, Future[Tensor]), not strings.
from dataclasses import dataclass

import torch
import torch.distributed as tdist
from torch import nn

from ..errors import UsageError
from ..spreads import remember, spread_of

HOOKS = ("fp16", "bf16", "powersgd")

@dataclass(frozen=True)
class Compression:
    """What a DDP comm hook saved: elements (or bytes, for 16-bit casts) in, out and their ratio."""

    hook: str
    ratio: float  # before / after; 1.0 means nothing was compressed (yet)
    before: int
    after: int
    unit: str  # "elements" (PowerSGD) or "bytes per element" (fp16/bf16)


def validate(comm_hook: str | None, powersgd_rank: int | None, powersgd_start_iter: int | None) -> None:
    if comm_hook is not None and comm_hook not in HOOKS:
        raise UsageError(f"unknown comm_hook {comm_hook!r}; expected one of {', '.join(HOOKS)}")
    if comm_hook != "powersgd" and (powersgd_rank is not None or powersgd_start_iter is not None):
        raise UsageError(f"powersgd_rank/powersgd_start_iter apply to comm_hook='powersgd' but comm_hook is {comm_hook!r}; "
                         "add comm_hook='powersgd' or drop them")
    if powersgd_rank is not None and (not isinstance(powersgd_rank, int) or powersgd_rank < 1):
        raise UsageError(f"powersgd_rank must be an int >= 1 (1-4 is typical), got {powersgd_rank!r}")
    # PowerSGD's error feedback needs two plain all-reduce steps first (DDP
    # rebuilds its buckets after the first), so PyTorch requires > 1.
    if powersgd_start_iter is not None and (not isinstance(powersgd_start_iter, int) or powersgd_start_iter < 2):
        raise UsageError(f"powersgd_start_iter must be an int >= 2, got {powersgd_start_iter!r}; "
                         "PowerSGD needs two plain all-reduce steps before it can start")


def _gloo_bf16_compress_hook(process_group: tdist.ProcessGroup, bucket: tdist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(process_group, bucket)


def _serialised_powersgd_hook(state: object, bucket: tdist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD, finishing one bucket before DDP hands over the next (gloo only).

    PowerSGD chains three all-reduces per bucket through future callbacks.
    With several buckets those callbacks run whenever the previous all-reduce
    finishes, so two ranks can issue bucket 0's second all-reduce and bucket
    1's first in different orders; NCCL tolerates that less visibly, gloo
    aborts (``gloo::EnforceNotMet``, seen here with two buckets; PyTorch
    #58467 found PowerSGD failing on gloo). Waiting keeps every rank's
    collectives in bucket order, at the price of overlap, which a CPU run
    does not have much of anyway.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    fut = powersgd.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


def register(ddp: nn.Module, comm_hook: str, powersgd_rank: int | None = None,
             powersgd_start_iter: int | None = None) -> None:
    """Register the named hook on a DistributedDataParallel module."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if comm_hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        state = None
    elif comm_hook == "bf16":
        bf16_hook = default_hooks.bf16_compress_hook
        if tdist.get_backend() == "gloo":
            # DDP refuses a hook *named* bf16_compress_hook unless NCCL >= 2.10
            # is present (older NCCL lacks bf16); gloo all-reduces bf16 fine,
            # so on gloo the same hook is registered under another name.
            bf16_hook = _gloo_bf16_compress_hook
        ddp.register_comm_hook(None, bf16_hook)
        state = None
    else:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        # PyTorch's defaults: rank 1, start after 1,000 steps (its docs suggest
        # ~10% of training); error feedback and warm start on.
        state = powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=1 if powersgd_rank is None else powersgd_rank,
            start_powerSGD_iter=1_000 if powersgd_start_iter is None else powersgd_start_iter,
        )
        hook = powersgd.powerSGD_hook
        if tdist.get_backend() == "gloo":
            hook = _serialised_powersgd_hook
        ddp.register_comm_hook(state, hook)
    remember(ddp, comm_hook=(comm_hook, state))  # the model's record (spreads.py), for compression()


def compression(model: nn.Module) -> Compression | None:
    """The compression achieved by ``model``'s comm hook so far (None without a hook).

    >>> model = mg.wrap(net, "ddp", comm_hook="powersgd", powersgd_start_iter=10)
    >>> ...train...
    >>> compression(model)
    Compression(hook='powersgd', ratio=12.4, before=..., after=..., unit='elements')
    """
    spread = spread_of(model)
    if spread is None or spread.comm_hook is None:
        return None
    name, state = spread.comm_hook
    if name in ("fp16", "bf16"):
        size = next(model.parameters()).element_size()  # the gradients' dtype is the parameters'
        return Compression(name, size / 2, size, 2, "bytes per element")
    ratio, before, after = state.compression_stats()
    if after == 0:  # still in the plain all-reduce phase
        return Compression(name, 1.0, 0, 0, "elements")
    return Compression(name, float(ratio), int(before), int(after), "elements")
