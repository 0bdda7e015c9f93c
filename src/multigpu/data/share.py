"""Which samples a process evaluates under a layout, and whether its sums count: each data-parallel rank once.

Model parallelism groups processes into one data-parallel rank: its
tensor-parallel peers compute the same outputs from the same samples, and of
its pipeline stages only the one with the last stage holds outputs. So every
process reads its data-parallel rank's share, and one process per
data-parallel rank counts: tensor-parallel peer 0 on the rank that holds the
last stage. ``mg.all_reduce_sum`` sums over the world with the others'
numbers left out, so every rank gets the dataset-level figure.

The share comes from the ``Layout`` (``Layout.data_share``), a ``Mesh``, or
the model ``mg.parallelize`` spread (it carries its Layout). Without one, the
mesh this process built last (every ``Mesh`` records its share, so
``mg.parallelize(model, layout)`` followed by ``mg.eval_loader(val, dist, b)``
needs nothing more); without a mesh, every process is a data-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as tdist

from ..dist import at_teardown
from ..errors import UsageError

# mg.parallelize leaves the Layout on the model it returns, so what uses the model later (NoiseScale,
# mg.eval_loader) reads its degrees instead of inferring them from the world and the plan.
LAYOUT_ATTR = "_multigpu_layout"


@dataclass(frozen=True)
class DataShare:
    """One process's part in evaluation: its data-parallel rank of ``dp_size``, whether its per-sample sums
    count (None: unknown, a pipeline mesh that does not say which rank holds the last stage), the pipeline
    degree, and the layout in words for messages."""

    dp_rank: int
    dp_size: int
    counts: bool | None = True
    pp: int = 1
    layout: str = "data parallel"


def describe(shape: Any) -> str:
    """A mesh shape in words: its degrees above 1 (``pp 2 x dp_shard 2 x tp 2``)."""
    parts = [f"{name} {getattr(shape, name)}" for name in ("pp", "dp_replicate", "dp_shard", "tp")
             if getattr(shape, name) > 1]
    return " x ".join(parts) or "one process"


_recorded: tuple[int, int, DataShare] | None = None  # (rank, world size, share) of this process's last mesh


def record(share: DataShare, rank: int, world_size: int) -> None:
    """Remember ``share`` as this process's (a mesh was built, or ``mg.eval_loader`` was told the layout):
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
    """The share of ``dist``'s rank under ``layout``: a ``Layout``, a ``Mesh``, the model ``mg.parallelize``
    returned, or None (the recorded share, else every process a data-parallel rank)."""
    if layout is None:
        return recorded(dist.rank, dist.world_size) or DataShare(dist.rank, dist.world_size)
    carried = getattr(layout, LAYOUT_ATTR, None)
    if carried is not None:
        if carried.shape(dist.world_size).pp > 1:  # a pipeline stage's model: spread by the mesh, schedule unknown
            raise UsageError("the model is a pipeline stage, whose Layout does not say which rank holds the last "
                             "stage; pass layout= the mg.parallel.Layout the pipeline was built by")
        layout = carried
    if not callable(getattr(layout, "data_share", None)):
        raise UsageError(f"layout= takes the mg.parallel.Layout or Mesh the model was spread by, or the model "
                         f"mg.parallelize returned, got {type(layout).__name__}; leave it out when every process "
                         "is a data-parallel rank (DDP, FSDP)")
    return layout.data_share(dist.rank, dist.world_size)
