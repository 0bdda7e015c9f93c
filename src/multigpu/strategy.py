"""Model wrapping: ``wrap()`` picks one flat implementation per strategy.

Each strategy is one function ``(model, dist_device, **options) -> module``
with its own allowed options; none inherits from another. ``unwrap`` gives
back the user's module, and ``accumulate`` skips gradient synchronisation on
all but the last micro-batch for whichever strategy is in use.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import warnings
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import comm_hooks
from .batchnorm import prepare_batchnorm
from .errors import UsageError
from .fsdp import wrap_fsdp
from .zero import build_zero_optimizer, check_optimizer_class, is_zero1, wrap_zero1


def _world() -> tuple[int, str | None]:
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_world_size(), tdist.get_backend()
    return 1, None


def _device_of(model: nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


# --- none ---------------------------------------------------------------------

def _wrap_none(model: nn.Module) -> nn.Module:
    return model


# --- dp -----------------------------------------------------------------------

def _wrap_dp(model: nn.Module, device_ids: list[int] | None = None) -> nn.Module:
    world, _ = _world()
    if world > 1:
        raise UsageError(
            f"strategy 'dp' (nn.DataParallel) is single-process but this job has {world} processes; "
            "run it with -n 1 or use strategy 'ddp'"
        )
    warnings.warn(
        "strategy 'dp' (nn.DataParallel) is kept for comparison: one process drives all GPUs with threads, "
        "re-replicates the model every step and gathers outputs on GPU 0, so it is slower than 'ddp' "
        "(PyTorch docs recommend DistributedDataParallel); use 'ddp' for real runs",
        stacklevel=3,
    )
    return nn.DataParallel(model, device_ids=device_ids)


# --- ddp ----------------------------------------------------------------------

class _DDP(DistributedDataParallel):
    """DDP whose unused-parameter error names the parameters and the fix."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().forward(*args, **kwargs)
        except RuntimeError as err:
            if "Expected to have finished reduction" not in str(err):
                raise
            raise UsageError(_unused_message(self.module, str(err))) from None


def _unused_message(module: nn.Module, text: str) -> str:
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", text)
    unused = [names[int(i)] for i in found.group(1).split()] if found else []
    which = ", ".join(unused) if unused else "some parameters"
    return (
        f"DDP expected a gradient for every parameter but {which} got none in the previous step; "
        "use mg.wrap(model, 'ddp', find_unused_parameters=True), or make every parameter take part in the loss"
    )


def _wrap_ddp(
    model: nn.Module,
    bucket_cap_mb: float | None = None,
    static_graph: bool | None = None,
    find_unused_parameters: bool | None = None,
    gradient_as_bucket_view: bool | None = None,
    broadcast_buffers: bool | None = None,
    sync_batchnorm: bool = False,
    comm_hook: str | None = None,
    powersgd_rank: int | None = None,
    powersgd_start_iter: int | None = None,
) -> nn.Module:
    comm_hooks.validate(comm_hook, powersgd_rank, powersgd_start_iter)
    device = _device_of(model)
    model = prepare_batchnorm(model, "ddp", sync_batchnorm, device)
    # Pass only what the user set: DDP's own defaults stay DDP's, and options
    # that newer torch deprecates (broadcast_buffers) warn only when used.
    given = dict(bucket_cap_mb=bucket_cap_mb, static_graph=static_graph,
                 find_unused_parameters=find_unused_parameters,
                 gradient_as_bucket_view=gradient_as_bucket_view, broadcast_buffers=broadcast_buffers)
    kwargs: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    ddp = _DDP(model, **kwargs)
    if comm_hook is not None:
        comm_hooks.register(ddp, comm_hook, powersgd_rank, powersgd_start_iter)
    return ddp


STRATEGIES: dict[str, Callable[..., nn.Module]] = {
    "none": _wrap_none,
    "dp": _wrap_dp,
    "ddp": _wrap_ddp,
    "fsdp": wrap_fsdp,     # fsdp.py
    "zero1": wrap_zero1,   # zero.py
}

# Options that belong to another strategy: the error names the right one.
_ELSEWHERE = {
    ("fsdp", "comm_hook"): "comm hooks are DDP's; FSDP already reduces in reduce_dtype: use "
                           "mg.wrap(model, 'fsdp', reduce_dtype='bf16'), or strategy 'ddp' with comm_hook",
    ("zero1", "comm_hook"): "comm hooks are registered on plain DDP here; use strategy 'ddp' with comm_hook",
    ("ddp", "param_dtype"): "param_dtype is FSDP's mixed precision; use mg.Precision for DDP, or strategy 'fsdp'",
    ("ddp", "cpu_offload"): "cpu_offload is FSDP's; use strategy 'fsdp' with cpu_offload=True",
}


def _options(fn: Callable[..., Any]) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "model"]


def wrap(model: nn.Module, strategy: str = "ddp", **options: Any) -> nn.Module:
    """Wrap ``model`` for data-parallel training with ``strategy``.

    ``"none"`` (one process), ``"dp"`` (nn.DataParallel, for comparison),
    ``"ddp"`` (DistributedDataParallel; options ``bucket_cap_mb``,
    ``static_graph``, ``find_unused_parameters``, ``gradient_as_bucket_view``,
    ``broadcast_buffers``, ``sync_batchnorm``, ``comm_hook`` = "fp16" | "bf16"
    | "powersgd" with ``powersgd_rank``, ``powersgd_start_iter``), ``"fsdp"``
    (FSDP2 per block; ``block_classes``, ``min_block_params``,
    ``reshard_after_forward``, ``param_dtype``, ``reduce_dtype``,
    ``cpu_offload``, ``sync_batchnorm``), ``"zero1"`` (DDP + sharded
    optimizer state: build the optimizer with ``mg.optimizer``). Move the
    model to ``dist.device`` first. See docs/strategies.md.

    >>> model = mg.wrap(Net().to(dist.device), "ddp", bucket_cap_mb=50)
    >>> model = mg.wrap(Net().to(dist.device), "fsdp", block_classes=[Block], param_dtype="bf16")
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"mg.wrap expects a torch.nn.Module, got {type(model).__name__}")
    if strategy not in STRATEGIES:
        raise UsageError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    fn = STRATEGIES[strategy]
    allowed = _options(fn)
    unknown = sorted(set(options) - set(allowed))
    for name in unknown:
        if (strategy, name) in _ELSEWHERE:
            raise UsageError(f"strategy {strategy!r} has no option {name}: {_ELSEWHERE[strategy, name]}")
    if unknown:
        raise UsageError(
            f"strategy {strategy!r} has no option {', '.join(unknown)}; "
            f"its options are: {', '.join(allowed) or '(none)'}"
        )
    return fn(model, **options)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's own module: no ``module.`` (DDP/DP) or ``_orig_mod.`` (torch.compile) prefixes.

    FSDP shards the module in place, so under ``"fsdp"`` this is the module
    itself and its ``state_dict()`` holds DTensor shards: save with
    ``mg.full_state_dict(model)`` (any strategy) or torch.distributed.checkpoint.

    >>> torch.save(mg.unwrap(model).state_dict(), "model.pt")
    """
    while True:
        if isinstance(model, (DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def optimizer(model: nn.Module, optimizer_class: type, params: Any = None, **defaults: Any) -> torch.optim.Optimizer:
    """Build the optimizer for a wrapped model, for every strategy alike.

    A plain ``optimizer_class(params, **defaults)``, except under ``"zero1"``,
    where it is a ``ZeroRedundancyOptimizer`` that keeps only this rank's
    shard of the state. Under ``"fsdp"`` call it after ``wrap`` (the
    parameters are the shards). ``params`` defaults to ``model.parameters()``;
    parameter groups (a list of dicts) work too.

    >>> opt = mg.optimizer(model, torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    """
    zero = is_zero1(model)
    check_optimizer_class(optimizer_class, sharded=zero)
    params = model.parameters() if params is None else params
    if zero:
        return build_zero_optimizer(params, optimizer_class, **defaults)
    return optimizer_class(params, **defaults)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip gradient synchronisation inside the block, for whichever strategy wraps ``model``."""
    if hasattr(model, "no_sync"):  # DDP (and ZeRO-1, which is DDP underneath)
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def accumulate(model: nn.Module, micro_batches: Iterable[Any]) -> Iterator[Any]:
    """Yield micro-batches; gradients synchronise on the last one only.

    >>> for x, y in mg.accumulate(model, micro_batches):
    ...     (loss_fn(model(x), y) / plan.accum_steps).backward()
    """
    items = list(micro_batches)
    for i, item in enumerate(items):
        if i < len(items) - 1:
            with no_sync(model):
                yield item
        else:
            yield item
