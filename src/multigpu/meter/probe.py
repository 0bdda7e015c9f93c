"""What ``multigpu verify`` reads from each run, recorded by the StepMeter under ``MULTIGPU_VERIFY=1``.

    <run dir>/verify/initial.pt   the full model state when the meter starts (rank 0; needs model=)
    <run dir>/verify/final.pt     ... and when it closes
    <run dir>/verify/probe.json   per step, a digest of the samples all ranks trained on (sum over
                                  ranks: the same whatever the split), unsynced BatchNorm modules, the
                                  ranks whose plain parameters started elsewhere than rank 0's, and in
                                  verify's floor run the steps whose samples it reordered and the
                                  gradients it rounded once more

The losses come from metrics.jsonl (the meter logs every step under verify).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from ..errors import UsageError
from ..runtime.contract import VERIFY_DIR, verify_floor_requested

# The unit roundoff of each dtype a StepMeter reports: the largest relative error of one rounding to it.
ROUNDOFF = {"fp32": 2.0 ** -24, "tf32": 2.0 ** -11, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8,
            "fp8": 2.0 ** -4}  # fp8: e4m3, what float8 training rounds weights and inputs to (3 mantissa bits)


def digest(batch: Any) -> float:
    """An order-free checksum of the samples in ``batch`` (tensors, nested in lists, tuples, dicts).

    Per sample, its values weighted by position; summed over samples, so the
    shares of several ranks add up to the digest of the whole global batch.
    """
    if torch.is_tensor(batch):
        if batch.dim() == 0 or batch.numel() == 0:
            return 0.0
        flat = batch.detach().to("cpu", torch.float64).reshape(batch.shape[0], -1)
        weights = 1.0 + torch.sin(torch.arange(flat.shape[1], dtype=torch.float64))
        return float((flat @ weights).sum())
    if isinstance(batch, dict):
        return sum(digest(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(digest(v) for v in batch)
    return 0.0


def _order(n: int, device: torch.device) -> torch.Tensor:
    """A fixed permutation of ``n`` samples, never the identity (``n`` > 1). Random, not reversed or rotated: a
    pairwise (tree) sum of a reversed or half-rotated row pairs the same values and rounds the same."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(n))
    if bool((order == torch.arange(n)).all()):
        order = order.roll(1)
    return order.to(device)


def reorder(batch: Any) -> tuple[Any, int]:
    """``batch`` with every tensor's samples (its first dimension) in another order, and how many tensors moved.

    One permutation per length, so the inputs, targets and weights of one micro-batch stay paired. For a
    script that treats each sample on its own (BatchNorm included: the same samples, the same statistics) the
    training is the same up to the order of float sums: verify's floor run measures what that order moves."""
    if torch.is_tensor(batch):
        if batch.dim() == 0 or batch.shape[0] < 2:
            return batch, 0
        return batch.index_select(0, _order(batch.shape[0], batch.device)), 1
    if isinstance(batch, dict):
        done = {k: reorder(v) for k, v in batch.items()}
        return type(batch)({k: v for k, (v, _) in done.items()}), sum(n for _, n in done.values())
    if isinstance(batch, (list, tuple)):
        done = [reorder(v) for v in batch]
        items = [v for v, _ in done]
        kind = type(batch)
        rebuilt = kind(*items) if hasattr(batch, "_fields") else items if kind is list else tuple(items) \
            if kind is tuple else kind(items)
        return rebuilt, sum(n for _, n in done)
    return batch, 0


def unsynced_batchnorm(model: nn.Module) -> list[str]:
    from ..runtime.compat import batchnorm_base
    from ..parallel.batchnorm import GlooSyncBatchNorm  # sync_batchnorm=True's layer on CPU
    from ..parallel.wrap import unwrap

    return [name for name, m in unwrap(model).named_modules()
            if isinstance(m, batchnorm_base()) and not isinstance(m, (nn.SyncBatchNorm, GlooSyncBatchNorm))]


def cp_documents(model: nn.Module | None) -> bool:
    """Whether ``model`` took packed documents (position_ids restarting) under context parallelism."""
    from ..spreads import spread_of

    spread = None if model is None else spread_of(model)
    return bool(spread is not None and spread.context is not None and spread.context.packed)


def rng_states() -> list:
    """The state of torch's generators a step may draw from: the CPU's, and each CUDA device's once CUDA is up."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


def plain_state_digest(model: nn.Module) -> list[float]:
    """Per plain (not sharded) floating tensor of the model's state, a digest; the ranks' lists are equal
    when they start from the same parameters (sharded DTensors differ by design and are left out)."""
    from torch.distributed.tensor import DTensor

    from ..parallel.wrap import unwrap

    return [digest(t.reshape(1, -1)) for t in unwrap(model).state_dict().values()
            if torch.is_tensor(t) and not isinstance(t, DTensor) and t.is_floating_point()]


def is_pipeline(model: Any) -> bool:
    """A ``mg.parallel.pipeline`` (or its ``pipe.model``, or a stage): its schedule's backward runs autograd.grad per stage, which refuses hooks
    on the graph (the meter's gradient-ready hooks, the module tracker of the FLOP count's FlopCounterMode),
    and its ranks hold different stages (so no comparison of their starts)."""
    from ..spreads import stages

    return model is not None and stages(model) > 1


def dp_rank(plan: Any, dist: Any) -> int | None:
    """The plan's data-parallel rank of this process (None: the plan does not say; the probe takes the rank)."""
    if plan is None or dist is None or not hasattr(plan, "dp_rank_of"):
        return None
    try:
        return plan.dp_rank_of(dist)
    except UsageError:  # a plan for another world: the meter's own checks report it
        return None


class Probe:
    """Records the run for ``multigpu verify``; every call that gathers is collective."""

    def __init__(self, model: Any, log_dir: str, rank: int, world_size: int, dp_rank: int | None = None,
                 dtype: str = "fp32") -> None:
        self.model, self.rank, self.world = model, rank, world_size
        # Tensor-parallel peers and pipeline stages of one data-parallel rank train on the same samples:
        # only the first rank of each data-parallel rank adds them to the step's digest.
        self.dp_rank = rank if dp_rank is None else dp_rank
        self.dir = os.path.join(log_dir, VERIFY_DIR)
        self.digests: list[float] = []
        # Whether a step drew from torch's generators (dropout, a router's sampling, random augmentation in the
        # loop): each rank draws its own, so a layout differs from one process by design; their state at the
        # step's start.
        self.draws, self._rng = False, None
        if rank == 0:
            os.makedirs(self.dir, exist_ok=True)
        self._save_model("initial")
        # A pipeline's ranks hold different stages by design: their starts are not comparable.
        self.module = None if is_pipeline(model) else model
        self.start = plain_state_digest(self.module) if self.module is not None else []
        # verify's floor run: each step's samples in another order and each gradient rounded once more
        self.floor = verify_floor_requested()
        self.reordered = self.rounded = 0  # steps whose samples this rank reordered; gradients it rounded
        if self.floor and self.module is not None:
            self._round_gradients(ROUNDOFF.get(dtype, ROUNDOFF["fp32"]))

    def batch(self, batch: Any) -> Any:
        """Record the step's samples; the batch the script trains on (reordered in verify's floor run)."""
        if self.floor:
            batch, moved = reorder(batch)
            self.reordered += moved > 0
        self.digests.append(digest(batch))
        self._step_starts()
        return batch

    def _step_starts(self) -> bool:
        """Note whether the step that ends here drew random numbers; keep the generators' state for the next."""
        now = rng_states()
        if self._rng is not None and any(not torch.equal(a, b) for a, b in zip(self._rng, now)):
            self.draws = True
        self._rng = now
        return self.draws

    def finish(self) -> None:
        self._save_model("final")
        mine = {"digests": self.digests, "draws": self._step_starts(), "batchnorm": unsynced_batchnorm(self.module) if self.module is not None else [],
                "start": self.start, "dp_rank": self.dp_rank, "cp_documents": cp_documents(self.module),
                "reordered": self.reordered, "rounded": self.rounded}
        every = [mine]
        if self.world > 1 and tdist.is_initialized():
            every = [None] * self.world
            tdist.all_gather_object(every, mine)
        if self.rank == 0:
            steps = min(len(r["digests"]) for r in every)
            firsts = list({r["dp_rank"]: r for r in reversed(every)}.values())  # the lowest rank of each dp rank
            rec = {"world_size": self.world, "model": self.model is not None,
                   "digests": [math.fsum(r["digests"][i] for r in firsts) for i in range(steps)],
                   "batchnorm": every[0]["batchnorm"] if self.world > 1 else [],
                   "draws": any(r["draws"] for r in every),  # a step drew random numbers on some rank
                   "cp_documents": any(r["cp_documents"] for r in every),  # packed documents under cp
                   # Ranks whose unsynced parameters started elsewhere than rank 0's (a per-rank seed that
                   # no wrapper broadcast over): rank 0's initial.pt alone would not show it.
                   "rank_starts": [r for r in range(1, len(every))
                                   if self.module is not None and every[r]["start"] != every[0]["start"]],
                   # verify's floor run: the steps every rank reordered (a batch of no tensors cannot be), and
                   # the gradients rank 0 rounded once more (none: no model=, a pipeline, sharded parameters)
                   "floor": {"reordered": min(r["reordered"] for r in every), "rounded": self.rounded}
                   if self.floor else None}
            with open(os.path.join(self.dir, "probe.json"), "w") as fp:
                json.dump(rec, fp)

    def _round_gradients(self, roundoff: float) -> None:
        """Each gradient, as autograd hands it over (before accumulation and any data-parallel reduction),
        times 1 + e with e uniform in +-``roundoff``: one more rounding in the dtype, as a rank's own share of
        a gradient gets on N ranks. Sharded (DTensor) parameters are left alone."""
        from torch.distributed.tensor import DTensor

        from ..parallel.wrap import unwrap

        gens: dict[torch.device, torch.Generator] = {}

        def hook(grad: torch.Tensor) -> torch.Tensor:
            gen = gens.setdefault(grad.device, torch.Generator(grad.device).manual_seed(0))
            noise = torch.rand(grad.shape, generator=gen, device=grad.device, dtype=torch.float32)
            self.rounded += 1
            return (grad.float() * (1 + roundoff * (2 * noise - 1))).to(grad.dtype)

        for param in unwrap(self.module).parameters():
            if param.requires_grad and not isinstance(param, DTensor):
                param.register_hook(hook)

    def _save_model(self, name: str) -> None:
        if self.model is None:
            return
        from ..parallel.wrap import full_state_dict

        state = full_state_dict(self.model)  # collective under FSDP
        if self.rank == 0:
            torch.save(state, os.path.join(self.dir, f"{name}.pt"))
