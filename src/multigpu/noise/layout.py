"""How much of each gradient's squared norm a rank counts, so one sum over all ranks gives NoiseScale's two norms.

NoiseScale adds per-rank numbers over every rank in one all-reduce. For that
sum to be ``sum_d |g_d|^2`` (``d`` over the data-parallel ranks) and
``|G|^2``, each tensor counts once per set of ranks holding the same numbers:

* a rank gradient (DDP's before the reduction, FSDP's reduce-scatter input, a
  micro-batch's): a tensor-parallel shard is this rank's alone (share 1); a
  parameter replicated over the ``tp`` peers is on all of them (share 1/tp);
* the averaged gradient (``p.grad`` after the reduction): the same shares,
  divided again by the ranks that hold the same data-parallel piece: every
  rank under DDP, HSDP's replicas under FSDP.

The shares are kept as square roots, factors on the norms (``norms.norm_parts``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import UsageError

_OBSERVE = ("leave it unattached and call noise.observe(local_sq, total_sq) each step with the norms of each "
            "data-parallel rank's full gradient and of the averaged one")


@dataclass
class Layout:
    """The shares of one attached model; weights are None where every tensor counts alike (see ``total_share``)."""

    tp: int = 1
    replicas: int = 1
    local: list[float] | None = None      # per parameter (NoiseScale._params order): rank-gradient norm factors
    total: list[float] | None = None      # per parameter: averaged-gradient norm factors
    total_share: float = 1.0              # the averaged gradient's share when ``total`` is None
    blocks: list[tuple[list[int] | None, list[float] | None]] = field(default_factory=list)  # FSDP, per module


def tp_degree(layout, actual: int, world: int, model: Any = None) -> int:
    """The tensor-parallel ranks per data-parallel rank: the ``Layout``'s own degree, given or the one
    ``mg.parallelize`` spread ``model`` by; else world / the plan's ranks (0 when they do not divide), a
    guess that reads pipeline stages as TP."""
    from ..parallel.layout import Layout
    from ..spreads import spread_of

    spread = spread_of(model) if layout is None and model is not None else None
    layout = layout if spread is None else spread.layout
    if layout is None:
        return actual // world if actual % world == 0 else 0

    if not isinstance(layout, Layout):
        raise UsageError(f"NoiseScale.attach(layout=) takes the mg.parallel.Layout the model was spread by, "
                         f"got {type(layout).__name__}")
    layout = layout.resolve(actual)
    if layout.pp > 1:
        raise UsageError(f"NoiseScale does not measure pipeline stages (pp {layout.pp}): each stage's ranks hold a "
                         f"part of the model's gradient; {_OBSERVE}")
    if layout.dp_size != world:
        raise UsageError(f"NoiseScale's plan is for {world} data-parallel ranks but the layout has {layout.dp_size} "
                         f"({layout.dp_replicate} x {layout.dp_shard}); build the plan with layout.plan(...)")
    return layout.tp


def tp_split(p: torch.Tensor, dp_ndim: int) -> tuple[int, bool]:
    """(tensor-parallel degree, whether ``p`` is split over it) for a parameter whose first ``dp_ndim``
    mesh dimensions are data parallel; a plain tensor is (1, False)."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return 1, False
    degree = math.prod(mesh.size(i) for i in range(dp_ndim, mesh.ndim))
    return degree, any(not pl.is_replicate() for pl in p.placements[dp_ndim:])


def _share(p: torch.Tensor, dp_ndim: int, tp: int, name: str) -> float:
    degree, split = tp_split(p, dp_ndim)
    if degree not in (1, tp):
        raise UsageError(f"NoiseScale found parameter {name} spread over {degree} tensor-parallel ranks, but the "
                         f"job has {tp} per data-parallel rank (world / plan.world_size); build the plan over the "
                         f"data-parallel ranks (layout.plan(...)) or {_OBSERVE}")
    return 1.0 if split else 1.0 / tp


def _check_tp(degrees: list[int], tp: int, world: str) -> None:
    """``tp`` is world / data-parallel ranks: some parameter must really be spread over that many."""
    if tp > 1 and tp not in degrees:
        raise UsageError(f"NoiseScale's plan has {world} but no parameter is spread over {tp} tensor-parallel ranks "
                         "(pipeline stages, or a plan over too few ranks?); build the plan over the data-parallel "
                         f"ranks of a data x tensor-parallel layout (layout.plan(...)), or {_OBSERVE}")


def _roots(shares: list[float]) -> list[float] | None:
    """Norm factors for these shares; None when every share is 1."""
    return None if all(s == 1.0 for s in shares) else [math.sqrt(s) for s in shares]


def _uniform(shares: list[float]) -> tuple[list[float] | None, float]:
    """Averaged-gradient factors: None and the common share when all are alike (one factor for the sum)."""
    if len(set(shares)) <= 1:
        return None, shares[0] if shares else 1.0
    return [math.sqrt(s) for s in shares], 1.0


def _merge(blocks: list[int], shares: list[float]) -> tuple[list[int] | None, list[float] | None]:
    """Neighbouring column blocks with the same share as one block (fewer norms per reduce-scatter)."""
    if len(set(shares)) <= 1:
        return None, None if not shares or shares[0] == 1.0 else [math.sqrt(shares[0])]
    merged: list[list] = []
    for block, share in zip(blocks, shares):
        if merged and merged[-1][1] == share:
            merged[-1][0] += block
        else:
            merged.append([block, share])
    return [b for b, _ in merged], [math.sqrt(s) for _, s in merged]


def replicated(world: int) -> Layout:
    """DDP: the rank gradients whole, the averaged one the same on every rank."""
    return Layout(total_share=1.0 / world)


def tensor_parallel(named: list[tuple[str, torch.Tensor]], tp: int) -> Layout:
    """One data-parallel rank over ``tp`` tensor-parallel ranks (micro-batches give the small batch)."""
    _check_tp([tp_split(p, 0)[0] for _, p in named], tp, "one data-parallel rank")
    shares = [_share(p, 0, tp, name) for name, p in named]
    total, share = _uniform(shares)
    return Layout(tp=tp, local=_roots(shares), total=total, total_share=share)


def fsdp(modules: list[torch.nn.Module], named: list[tuple[str, torch.Tensor]], tp: int) -> Layout:
    """FSDP2 and HSDP, each optionally over tensor parallelism, from FSDP's own record of its reduce-scatter."""
    from ..runtime.compat import fsdp_reduce_layout

    names = {id(p): name for name, p in named}
    dp_ndim: dict[int, int] = {}
    replicas: set[int] = set()
    per_module = []
    for m in modules:
        blocks, shares = [], []
        for p, block, ndim in fsdp_reduce_layout(m):
            dp_ndim[id(p)] = ndim
            if ndim == 2 and p.device_mesh.size(1) == 1:
                raise UsageError("NoiseScale reads the rank gradients in FSDP2's reduce-scatter, which FSDP skips "
                                 "when each shard group has one rank (a replicate x 1 mesh is plain replication); "
                                 "use mg.wrap(model, 'ddp') for that, or shard over 2+ ranks")
            replicas.add(p.device_mesh.size(0) if ndim == 2 else 1)
            if not p.requires_grad:
                continue  # frozen: never in the reduce-scatter input
            blocks.append(block)
            shares.append(_share(p, ndim, tp, names.get(id(p), "?")))
        per_module.append(_merge(blocks, shares))
    if len(replicas) != 1:
        raise UsageError(f"NoiseScale found FSDP2 shards replicated {sorted(replicas)} times in one model; "
                         "shard every module over the same mesh, or call noise.observe(...) each step")
    outside = [name for name, p in named if id(p) not in dp_ndim]
    if outside:
        raise UsageError(f"NoiseScale under FSDP2 needs every trained parameter in a fully_shard module, but "
                         f"{', '.join(outside[:3])} is outside them; shard the root too (mg.wrap(model, 'fsdp')) or {_OBSERVE}")
    rep = replicas.pop()
    _check_tp([tp_split(p, dp_ndim[id(p)])[0] for _, p in named], tp, "data-parallel ranks of a larger world")
    shares = [_share(p, dp_ndim[id(p)], tp, name) / rep for name, p in named]
    total, share = _uniform(shares)
    return Layout(tp=tp, replicas=rep, total=total, total_share=share, blocks=per_module)
