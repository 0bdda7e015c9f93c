"""Batch planning and learning-rate scaling.

``BatchPlan`` is the one place where global batch, world size, per-rank
micro-batch and gradient accumulation meet:
``global_batch == world_size * micro_batch * accum_steps``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as tdist

from .errors import UsageError
from .runtime.values import divisors, is_positive_int, positive_int

LR_RULES = ("linear", "sqrt", "none")

# What happens to the batch when a recipe tuned on one worker runs on N:
# keep-global keeps the global batch (each worker takes 1/N of it, the same
# updates as one worker); scale-global keeps each worker's batch (the global
# batch grows N-fold, and the LR and step counts follow it).
POLICIES = ("keep-global", "scale-global")


@dataclass(frozen=True)
class BatchPlan:
    """How one global batch is split over data-parallel ranks and accumulation steps.

    ``world_size`` is the number of data-parallel ranks: the processes, unless
    model parallelism groups several processes into one data-parallel rank.
    ``dp_rank`` is this process's data-parallel rank; left out, it is the
    process's rank (``dp_rank_of(dist)``). ``micro_batch=None`` takes the
    whole rank share in one micro-batch, or the largest divisor of the share
    that is <= ``max_micro_batch``.

    >>> plan = mg.BatchPlan(global_batch=512, world_size=4, micro_batch=64)
    >>> plan.accum_steps
    2
    """

    global_batch: int
    world_size: int
    micro_batch: int | None = None
    max_micro_batch: int | None = None
    dp_rank: int | None = None
    accum_steps: int = field(init=False)

    def __post_init__(self) -> None:
        g, w, m = self.global_batch, self.world_size, self.micro_batch
        for name, value in (("global_batch", g), ("world_size", w)):
            positive_int(value, name)
        for name, value in (("micro_batch", m), ("max_micro_batch", self.max_micro_batch)):
            if value is not None and not is_positive_int(value):
                raise UsageError(f"{name} must be a positive integer or None, got {value!r}")
        if self.dp_rank is not None and not (isinstance(self.dp_rank, int) and 0 <= self.dp_rank < w):
            raise UsageError(f"dp_rank must be an integer in 0..{w - 1} (world_size {w}), got {self.dp_rank!r}")
        if g % w:
            lo, hi = (g // w) * w, (g // w + 1) * w
            near_w = [d for d in divisors(g) if d != w]
            alt = f"use global_batch={lo or hi} or {hi}" if lo else f"use global_batch={hi}"
            # world_size counts data-parallel ranks, which are the processes only without model parallelism
            _refuse_split(g, f"world_size {w} (data-parallel ranks)",
                          f"{alt}, or {' or '.join(map(str, _closest(near_w, w, 2)))} data-parallel ranks")
        share = g // w
        if m is None:
            cap = self.max_micro_batch or share
            m = max(d for d in divisors(share) if d <= cap)
            object.__setattr__(self, "micro_batch", m)
        elif share % m:
            unit = w * m
            lo, hi = (g // unit) * unit, (g // unit + 1) * unit
            fits = [d for d in divisors(share) if d <= m]
            alt_g = f"global_batch={lo} or {hi}" if lo else f"global_batch={hi}"
            _refuse_split(g, f"world_size {w} x micro_batch {m} = {unit}", f"use {alt_g} or micro_batch={max(fits)}")
        object.__setattr__(self, "accum_steps", share // m)

    def fitting(self, max_micro_batch: int) -> "BatchPlan":
        """The same global batch with the largest micro-batch <= ``max_micro_batch`` that divides the rank share.

        >>> mg.BatchPlan(96, 2).fitting(20).micro_batch   # share 48: 16 x 3 accumulation
        16
        """
        share = self.rank_batch
        micro = max(d for d in divisors(share) if d <= max(1, max_micro_batch))
        return replace(self, micro_batch=micro, max_micro_batch=None)

    def dp_rank_of(self, dist) -> int:
        """This process's data-parallel rank: ``dp_rank``, or the rank of ``dist`` when the plan spans its world."""
        if self.dp_rank is not None:
            return self.dp_rank
        if self.world_size != dist.world_size:
            raise UsageError(
                f"the batch plan is for world_size {self.world_size} but this job has {dist.world_size} processes; "
                f"build it with mg.BatchPlan(..., world_size=dist.world_size)"
            )
        return dist.rank

    def rank_slice(self, dp_rank: int) -> slice:
        """Where data-parallel rank ``dp_rank``'s contiguous share sits in every global batch."""
        share = self.rank_batch
        return slice(dp_rank * share, (dp_rank + 1) * share)

    @property
    def rank_batch(self) -> int:
        """Samples one rank processes per optimizer step (micro_batch x accum_steps)."""
        return self.micro_batch * self.accum_steps

    def steps_per_epoch(self, dataset_size: int) -> int:
        """Optimizer steps in one epoch (the incomplete last global batch is dropped)."""
        return dataset_size // self.global_batch

    def summary(self, **extra) -> str:
        """A boxed, multi-line description for rank 0 to print at start. Under model parallelism (a plan over
        fewer data-parallel ranks than the job has processes) it names both: the world and the data-parallel size.

        >>> mg.print0(plan.summary(lr=0.4, precision="bf16", strategy="ddp", backend="gloo"))
        """
        world = tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else self.world_size
        if world == self.world_size:
            rows = [("world size", self.world_size), ("micro-batch / rank", self.micro_batch)]
        else:
            each = f" ({world // self.world_size} processes each)" if world % self.world_size == 0 else ""
            rows = [("world size", world), ("data-parallel size", f"{self.world_size}{each}"),
                    ("micro-batch / dp rank", self.micro_batch)]
        rows += [("accumulation", self.accum_steps), ("global batch", self.global_batch)]
        rows += [(k.replace("_", " "), _fmt(v)) for k, v in extra.items() if v is not None]
        width = max(len(k) for k, _ in rows)
        body = [f"| {k:<{width}} : {v}" for k, v in rows]
        line = "+" + "-" * (max(len(b) for b in body) + 1)
        return "\n".join([line, *body, line])


def check_splits(global_batch: int, groups: list[tuple[str, int]], *, why: str = "", flag: str = "--global-batch",
                 fix: str | None = None) -> None:
    """BatchPlan's first rule for several runs at once (verify, study, tune, the planner): each run's data-parallel
    ranks must split ``global_batch`` evenly. ``groups``: (the run in words, its data-parallel ranks), e.g.
    ("2 workers", 2). One line names the first run that does not, and the global batches every run splits.

    >>> check_splits(10, [("1 worker", 1), ("4 workers", 4)])
    Traceback (most recent call last):
    UsageError: global batch 10 does not split over 4 workers; use --global-batch 8 or 12 (a multiple of 4)
    """
    bad = next((what for what, dp in groups if global_batch % dp), None)
    if bad is None:
        return
    step = math.lcm(*(dp for _, dp in groups))
    near = sorted({m for m in (global_batch // step * step, global_batch // step * step + step) if m > 0})
    _refuse_split(global_batch, bad + why, fix or f"use {flag} {' or '.join(map(str, near))} (a multiple of {step})")


def _refuse_split(global_batch: int, over: str, fix: str) -> None:
    """The one line of every batch that does not split (BatchPlan, ``check_splits``, the forecast's layouts)."""
    raise UsageError(f"global batch {global_batch} does not split over {over}; {fix}")


def policy_batch(policy: str, batch: int, workers: int, per_worker: int | None = None) -> int:
    """The global batch on ``workers`` ranks of a recipe tuned at ``batch`` on one.

    ``per_worker`` is each worker's batch under ``scale-global`` (default ``batch``).

    >>> policy_batch("keep-global", 128, 8), policy_batch("scale-global", 128, 8)
    (128, 1024)
    """
    if policy not in POLICIES:
        raise UsageError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    return batch if policy == "keep-global" else workers * (per_worker or batch)


def same_samples_steps(steps: int | None, base_batch: int, batch: int) -> int | None:
    """Steps at ``batch`` that see as many samples as ``steps`` at ``base_batch`` (at least 1 if there were any).

    >>> same_samples_steps(10000, 128, 1024)
    1250
    """
    if steps is None:
        return None
    return 0 if steps == 0 else max(1, -(-steps * base_batch // batch))  # exact ceiling


def _fmt(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _closest(candidates: list[int], target: int, k: int) -> list[int]:
    return sorted(sorted(candidates, key=lambda d: (abs(d - target), d))[:k])


def scale_lr(lr: float, base_batch: int, batch: int, rule: str = "linear") -> float:
    """Scale a learning rate tuned at ``base_batch`` to ``batch``.

    ``"linear"`` for SGD (Goyal et al. 2017), ``"sqrt"`` for Adam-type
    optimisers (Hoffer et al. 2017; Malladi et al. 2022), ``"none"`` keeps it.

    >>> mg.scale_lr(0.1, base_batch=256, batch=8192)
    3.2
    """
    if rule not in LR_RULES:
        raise UsageError(f"unknown LR scaling rule {rule!r}; expected one of {', '.join(LR_RULES)}")
    if base_batch < 1 or batch < 1:
        raise UsageError(f"batch sizes must be positive, got base_batch={base_batch}, batch={batch}")
    if lr <= 0:
        raise UsageError(f"learning rate must be positive, got {lr}")
    k = batch / base_batch
    return lr * {"linear": k, "sqrt": math.sqrt(k), "none": 1.0}[rule]


def warmup(optimizer: torch.optim.Optimizer, steps: int, start_lr: float | None = None):
    """Gradual linear warmup (Goyal et al. 2017): from ``start_lr`` to the optimizer's LR.

    Returns PyTorch's own ``LinearLR`` scheduler; call ``.step()`` after each
    ``optimizer.step()``. ``start_lr`` defaults to 1/steps of the target, as
    ``LinearLR`` does; pass the unscaled base LR to follow Goyal et al.

    >>> sched = mg.warmup(opt, steps=100, start_lr=0.1)   # opt's lr is 0.4 after scaling
    """
    if steps < 1:
        raise UsageError(f"warmup steps must be >= 1, got {steps}")
    target = optimizer.param_groups[0]["lr"]
    factor = 1.0 / steps if start_lr is None else start_lr / target
    if not 0 < factor <= 1:
        raise UsageError(f"warmup start_lr {start_lr} must be in (0, {target}] (the optimizer's LR)")
    return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=factor, end_factor=1.0, total_iters=steps)
