"""Which samples a process evaluates under a layout, and whether its sums count: each data-parallel rank once.

Model parallelism groups processes into one data-parallel rank: its
tensor-parallel peers compute the same outputs from the same samples, and of
its pipeline stages only the one with the last stage holds outputs. So every
process reads its data-parallel rank's share, and one process per
data-parallel rank counts: tensor-parallel peer 0 on the rank that holds the
last stage. ``mg.all_reduce_sum`` sums over the world with the others'
numbers left out, so every rank gets the dataset-level figure. Context-parallel
peers each hold a share of every sequence's tokens: they all count, so
per-token sums add up (docs/context.md).

The share comes from the ``Layout`` (``Layout.data_share``) or the model
``mg.parallelize`` spread (the Layout it was spread by, kept here, not on the
model). Without one, the layout this process spread a model by last
(``mg.parallelize`` records its share, so ``mg.parallelize(model, layout)``
followed by ``mg.eval_loader(val, dist, b)`` needs nothing more); without
one, every process is a data-parallel rank.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch.distributed as tdist

from ..dist import at_teardown
from ..errors import UsageError

# The Layout each model mg.parallelize returned was spread by, so what uses the model later (NoiseScale,
# mg.eval_loader) reads its degrees instead of inferring them from the world and the plan. Kept beside the
# model, not on it: nothing is stamped on the user's module, and a model that is dropped is forgotten.
_SPREAD: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def remember(model: Any, layout: Any) -> None:
    """``model`` was spread by ``layout`` (a resolved ``Layout``)."""
    _SPREAD[model] = layout


def spread_by(model: Any) -> Any:
    """The ``Layout`` ``mg.parallelize`` spread ``model`` by, or None."""
    try:
        return _SPREAD.get(model)
    except TypeError:  # not weak-referenceable: not a module mg.parallelize returned
        return None


@dataclass(frozen=True)
class DataShare:
    """One process's part in evaluation: its data-parallel rank of ``dp_size``, whether its per-sample sums
    count, the pipeline degree, and the layout's label for messages."""

    dp_rank: int
    dp_size: int
    counts: bool = True
    pp: int = 1
    layout: str = "data parallel"


_recorded: tuple[int, int, DataShare] | None = None  # (rank, world size, share) of this process's last layout


def record(share: DataShare, rank: int, world_size: int) -> None:
    """Remember ``share`` as this process's (``mg.parallelize`` spread a model by it, or ``mg.eval_loader`` was told it):
    only for the process group's own rank and world (a ``Dist`` made up in one process stands for no job)."""
    global _recorded
    if not (tdist.is_available() and tdist.is_initialized()) or (tdist.get_rank(), tdist.get_world_size()) != (
            rank, world_size):
        return
    if _recorded is None:
        at_teardown(forget)  # a later mg.init block in this process is another job
    _recorded = (rank, world_size, share)


def forget() -> None:
    global _recorded
    _recorded = None


def recorded(rank: int, world_size: int) -> DataShare | None:
    """This process's recorded share, if it was recorded for this rank of this world."""
    if _recorded is None or _recorded[:2] != (rank, world_size):
        return None
    return _recorded[2]


def share_of(layout: Any, dist: Any) -> DataShare:
    """The share of ``dist``'s rank under ``layout``: a ``Layout``, the model ``mg.parallelize`` returned, or
    None (the recorded share, else every process a data-parallel rank)."""
    if layout is None:
        return recorded(dist.rank, dist.world_size) or DataShare(dist.rank, dist.world_size)
    carried = spread_by(layout)
    if carried is not None:
        layout = carried  # a pipeline stage's too: the pipeline's Layout, whose schedule places the last stage
    if not callable(getattr(layout, "data_share", None)):
        raise UsageError(f"layout= takes the mg.parallel.Layout the model was spread by, or the model "
                         f"mg.parallelize returned, got {type(layout).__name__}; leave it out when every process "
                         "is a data-parallel rank (DDP, FSDP)")
    return layout.data_share(dist.rank, dist.world_size)
