"""The dispatcher: the one place that chooses by strategy name.

``wrap()`` picks one flat implementation per strategy (ddp.py, dp.py, zero.py,
fsdp.py), each one function ``(model, **options) -> module`` with its own
allowed options; none inherits from another. ``strategy_of`` tells which
strategy a model was wrapped with, from the wrapper's type, for every reader
(``optimizer``, ``no_sync``, the checkpoint manifest, ``NoiseScale``); nothing
is stamped on the user's module.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..runtime.compat import wrapped
from ..errors import UsageError
from .ddp import wrap_ddp
from .dp import wrap_dp
from .fsdp import fsdp_modules, is_fsdp, wrap_fsdp
from .zero import ZeroOneDDP, build_zero_optimizer, check_optimizer_class, is_zero_optimizer, wrap_zero1


def _wrap_none(model: nn.Module) -> nn.Module:
    return model


STRATEGIES: dict[str, Callable[..., nn.Module]] = {
    "none": _wrap_none,
    "dp": wrap_dp,
    "ddp": wrap_ddp,
    "fsdp": wrap_fsdp,
    "zero1": wrap_zero1,
}

# Options that belong to another strategy: the error names the right one.
_ELSEWHERE = {
    ("fsdp", "comm_hook"): "comm hooks are DDP's; FSDP already reduces in reduce_dtype: pass reduce_dtype='bf16', "
                           "or replicate (strategy 'ddp', a Layout that only replicates) with comm_hook",
    ("zero1", "comm_hook"): "comm hooks are registered on plain DDP here; use strategy 'ddp' (zero1 off) with comm_hook",
    ("fsdp", "zero1"): "ZeRO-1 shards the optimizer state of a replicated model; FSDP shards it already",
    ("ddp", "param_dtype"): "param_dtype is FSDP's mixed precision; use mg.Precision for DDP, or shard (strategy "
                            "'fsdp', a Layout with dp_shard > 1)",
    ("ddp", "cpu_offload"): "cpu_offload is FSDP's; shard (strategy 'fsdp', a Layout with dp_shard > 1) with "
                            "cpu_offload=True",
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
    from ..spreads import refuse_stages

    refuse_stages(model, "mg.wrap", "mg.parallel.pipeline spread them already (FSDP over the data-parallel ranks "
                  "when there are several)")
    if not isinstance(model, nn.Module):
        raise UsageError(f"mg.wrap expects a torch.nn.Module, got {type(model).__name__}")
    if strategy not in STRATEGIES:
        raise UsageError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    check_options(strategy, options)
    return STRATEGIES[strategy](model, **options)


def check_options(strategy: str, options: dict[str, Any], where: str | None = None) -> None:
    """The one rule for a data-parallel wrapper's options (``mg.wrap``'s and ``mg.parallelize``'s): each
    strategy takes its own function's keywords; one that belongs to another strategy is refused with
    where it belongs. ``where``: how the caller names the strategy (default ``strategy 'ddp'``)."""
    allowed = _options(STRATEGIES[strategy])
    where = where or f"strategy {strategy!r}"
    unknown = sorted(set(options) - set(allowed))
    for name in unknown:
        if (strategy, name) in _ELSEWHERE:
            raise UsageError(f"{where} has no option {name}: {_ELSEWHERE[strategy, name]}")
    if unknown:
        raise UsageError(f"{where} has no option {', '.join(unknown)}; its options are: {', '.join(allowed) or '(none)'}")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's own module: no ``module.`` (DDP/DP) or ``_orig_mod.`` (torch.compile) prefixes.

    FSDP shards the module in place, so under ``"fsdp"`` this is the module
    itself and its ``state_dict()`` holds DTensor shards: save with
    ``mg.full_state_dict(model)`` (any strategy) or torch.distributed.checkpoint.

    >>> torch.save(mg.unwrap(model).state_dict(), "model.pt")
    """
    while (inner := wrapped(model)) is not None:
        model = inner
    return model


def strategy_of(model: nn.Module | None, optimizer: Any = None) -> str:
    """The strategy ``model`` was wrapped with: ``none``, ``dp``, ``ddp``, ``zero1`` or ``fsdp``.

    Read from the wrapper's type, so a model the user wrapped by hand
    (``DistributedDataParallel``, ``fully_shard``) is named too; a
    ``ZeroRedundancyOptimizer`` makes it ``zero1``.

    >>> mg.parallel.strategy_of(mg.wrap(net, "zero1"))
    'zero1'
    """
    if model is None:
        return "none"
    if is_zero_optimizer(optimizer):
        return "zero1"
    strategy = _wrapper_strategy(model)
    # FSDP applied below the root only (the user sharded some blocks): a scan of every module.
    return "fsdp" if strategy == "none" and fsdp_modules(model) else strategy


def _wrapper_strategy(model: nn.Module) -> str:
    """``strategy_of`` from the outermost module's type alone: a few microseconds, for the per-micro-batch
    ``no_sync`` (the scan below the root costs ~75 us on a 73-module GPT, measured)."""
    if isinstance(model, ZeroOneDDP):
        return "zero1"
    if isinstance(model, DistributedDataParallel):
        return "ddp"
    if isinstance(model, nn.DataParallel):
        return "dp"
    return "fsdp" if is_fsdp(model) else "none"


def full_state_dict(model: nn.Module, cpu: bool = True) -> dict[str, torch.Tensor]:
    """The model's state_dict with full (unsharded) tensors and no wrapper prefixes, for any strategy.

    A collective under FSDP: every rank must call it. With ``cpu=True`` the
    tensors are gathered to CPU and only rank 0 receives them (other ranks
    get ``{}``), so GPU memory never holds a second full copy.

    A ``Pipeline`` (``mg.parallel.pipeline``) or its ``pipe.model`` gives every stage's weights under one
    process's names, on every rank.

    >>> state = mg.full_state_dict(model)
    >>> if dist.is_main:
    ...     torch.save(state, "model.pt")   # loads into the plain, unwrapped model
    """
    from ..spreads import pipeline_of, refuse_stages

    if (pipe := pipeline_of(model)) is not None:  # every stage's weights, gathered from the ranks that hold them
        from .pp import gathered_state_dict

        return _plain(gathered_state_dict(pipe))
    refuse_stages(model, "mg.full_state_dict", "pass the pipeline (mg.full_state_dict(pipe)): every stage's weights")
    if not (tdist.is_available() and tdist.is_initialized()):
        return _plain({k: v.cpu() if cpu else v for k, v in unwrap(model).state_dict().items()})
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return _plain(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu)))


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with plain tensors: a weight a library wraps in a tensor subclass (torchao's float8 weights) is
    copied out, so the dict loads into the plain model and ``torch.load(weights_only=True)`` reads it."""
    def plain(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or type(v) is torch.Tensor:
            return v
        return torch.empty(v.shape, dtype=v.dtype, device=v.device).copy_(v)
    return {k: plain(v) for k, v in state.items()}


def optimizer(model: nn.Module, optimizer_class: type, params: Any = None, **defaults: Any) -> torch.optim.Optimizer:
    """Build the optimizer for a wrapped model, for every strategy alike.

    A plain ``optimizer_class(params, **defaults)``, except under ``"zero1"``,
    where it is a ``ZeroRedundancyOptimizer`` that keeps only this rank's
    shard of the state. Under ``"fsdp"`` call it after ``wrap`` (the
    parameters are the shards). ``params`` defaults to ``model.parameters()``;
    parameter groups (a list of dicts) work too.

    >>> opt = mg.optimizer(model, torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    """
    from .hf.lora import check_wrapped_whole

    check_wrapped_whole(unwrap(model), "mg.optimizer")
    zero = strategy_of(model) == "zero1"
    check_optimizer_class(optimizer_class, sharded=zero)
    params = model.parameters() if params is None else params
    if zero:
        return build_zero_optimizer(params, optimizer_class, **defaults)
    return optimizer_class(params, **defaults)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip gradient synchronisation inside the block, for whichever strategy wraps ``model``."""
    # Only the root's wrapper can skip synchronisation (DDP's no_sync, FSDP2's root switch).
    strategy = _wrapper_strategy(model)
    if strategy in ("ddp", "zero1"):
        with model.no_sync():
            yield
    elif strategy == "fsdp":
        # FSDP2 skips the reduce-scatter of every FSDP module below the root too.
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


SYNCS = ("last", "each")  # mg.accumulate's sync=: when the data-parallel gradients are reduced


def accumulate(model: nn.Module, micro_batches: Iterable[Any], sync: str = "last") -> Iterator[Any]:
    """Yield micro-batches; the gradients synchronise on the last one only (``sync="last"``) or on each.

    ``"last"``: one reduction a step; FSDP holds every block's unsharded gradient (float32, its reduce dtype)
    until it. ``"each"``: FSDP reduce-scatters every micro-batch's gradients, so only its shard of them is
    held between micro-batches (HSDP all-reduces over the replicas on the last only); what memory it saves,
    it pays in reduce-scatters, m a step instead of one. Under DDP and ZeRO-1 ``"each"`` saves nothing
    (the gradients are whole either way) and all-reduces every micro-batch. The sums are the same either way.

    >>> for x, y in mg.accumulate(model, micro_batches):
    ...     (loss_fn(model(x), y) / plan.accum_steps).backward()
    """
    from ..spreads import refuse_stages, spread_of

    refuse_stages(model, "mg.accumulate", "the pipeline runs a step's micro-batches itself: pipe.step(micro_batches)")
    if sync not in SYNCS:
        raise UsageError(f"mg.accumulate sync= is 'last' (one reduction a step) or 'each' (FSDP's gradients sharded "
                         f"between micro-batches), got {sync!r}")
    items = list(micro_batches)
    spread = spread_of(model)
    noise = None if spread is None or spread.noise is None else spread.noise()
    if sync == "each" and len(items) > 1 and noise is not None and noise._kind in ("ddp", "fsdp"):
        raise UsageError("NoiseScale reads each rank's gradient accumulated over its micro-batches, but "
                         "mg.accumulate(sync='each') reduces every micro-batch's; use sync='last' (the default) "
                         "while the noise scale is measured")
    for i, item in enumerate(items):
        last = i == len(items) - 1
        if sync == "last" and not last:
            with no_sync(model):
                yield item
        elif sync == "each" and not last and _wrapper_strategy(model) == "fsdp":
            # The reduce-scatters run; HSDP's all-reduce over the replicas waits for the last micro-batch (FSDP2
            # keeps the partial sum meanwhile).
            model.set_requires_all_reduce(False)
            try:
                yield item
            finally:
                model.set_requires_all_reduce(True)
        else:
            yield item
