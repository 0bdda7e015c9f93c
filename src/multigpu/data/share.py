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
``mg.parallelize`` spread (the Layout its record holds: ``spreads.py``).
Without one, the layout this process spread a model by last
(``mg.parallelize`` records its share, so ``mg.parallelize(model, layout)``
followed by ``mg.eval_loader(val, dist, b)`` needs nothing more); without
one, every process is a data-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UsageError


@dataclass(frozen=True)
class DataShare:
    """One process's part in evaluation: its data-parallel rank of ``dp_size``, whether its per-sample sums
    count, the pipeline degree, and the layout's label for messages."""

    dp_rank: int
    dp_size: int
    counts: bool = True
    pp: int = 1
    layout: str = "data parallel"


def share_of(layout: Any, dist: Any) -> DataShare:
    """The share of ``dist``'s rank under ``layout``: a ``Layout``, the model ``mg.parallelize`` returned, or
    None (the recorded share, else every process a data-parallel rank)."""
    from ..spreads import process_share, spread_of

    if layout is None:
        return process_share(dist.rank, dist.world_size) or DataShare(dist.rank, dist.world_size)
    spread = spread_of(layout)
    if spread is not None and spread.layout is not None:
        layout = spread.layout  # a pipeline stage's too: the pipeline's Layout, whose schedule places the last stage
    if not callable(getattr(layout, "data_share", None)):
        raise UsageError(f"layout= takes the mg.parallel.Layout the model was spread by, or the model "
                         f"mg.parallelize returned, got {type(layout).__name__}; leave it out when every process "
                         "is a data-parallel rank (DDP, FSDP)")
    return layout.data_share(dist.rank, dist.world_size)
