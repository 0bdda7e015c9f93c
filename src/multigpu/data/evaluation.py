"""Exact evaluation on any layout: ``mg.eval_loader`` reads each row once per data-parallel rank, and
``mg.all_reduce_sum`` counts each data-parallel rank once.

The rows are cut into ``dp x k`` contiguous batches of at most ``batch_size``,
as even as they come, and data-parallel rank ``d`` takes batches
``d*k .. d*k+k-1``: no padding duplicates, and every rank runs ``k``
forwards (FSDP and HSDP gather the parameters in each forward, so a rank with
one batch more would wait for the others forever). Tensor-parallel peers and
pipeline stages of a data-parallel rank read the same batches (``share.py``).
Under pipeline parallelism every batch must hold exactly ``batch_size`` rows:
the stages exchange activations of one shape, and ``pipe.evaluate`` returns
one mean per group of micro-batches.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.distributed as tdist
from torch.utils.data import DataLoader, Dataset

from ..dist import Dist
from ..errors import UsageError
from ..runtime.values import positive_int
from .loader import OWNED, batched_view
from .share import DataShare, share_of


def eval_share(dist: Dist, layout: Any, mesh: Any, what: str) -> DataShare:
    """The share an evaluation loader reads (``share.share_of``), recorded for ``mg.all_reduce_sum`` when the
    caller named the layout."""
    if mesh is not None:  # gone with mg.parallel.Mesh (CHANGELOG.md)
        raise UsageError(f"{what}'s mesh= is gone; pass layout= the mg.parallel.Layout the model was spread by "
                         "(or the model mg.parallelize returned)")
    from ..spreads import record_share

    share = share_of(layout, dist)
    if layout is not None:
        record_share(share, dist.rank, dist.world_size)
    return share


def eval_batches(rows: int, dp_rank: int, dp_size: int, batch_size: int) -> list[range]:
    """Data-parallel rank ``dp_rank``'s evaluation batches (see the module doc); every rank gets as many,
    and over the ranks they cover ``range(rows)`` once, in order."""
    per_rank = -(-rows // (dp_size * batch_size))
    total = dp_size * per_rank
    q, r = divmod(rows, total) if total else (0, 0)

    def start(j: int) -> int:
        return j * q + min(j, r)

    first = dp_rank * per_rank
    return [range(start(j), start(j + 1)) for j in range(first, first + per_rank)]


def _refuse_uncountable(rows: int, share: DataShare, batch_size: int) -> None:
    """One line when the rows cannot be cut as the layout needs: a batch left empty, or (pipeline) not full."""
    dp, unit = share.dp_size, share.dp_size * batch_size
    if share.pp > 1 and rows % unit:
        whole = rows // unit * unit
        fits = next((b for b in range(batch_size - 1, 0, -1) if rows % (dp * b) == 0), None)
        fixes = [f"the first {whole} rows (torch.utils.data.Subset(dataset, range({whole})))" if whole else "",
                 f"batch_size={fits}" if fits else "", "" if whole or fits else f"at least {unit} rows"]
        raise UsageError(
            f"mg.eval_loader under layout {share.layout}: a pipeline's stages exchange batches of one shape, so every "
            f"evaluation batch must hold batch_size={batch_size} rows, but {rows} rows over {dp} data-parallel "
            f"rank{'s' if dp > 1 else ''} leave {rows % unit} over; evaluate {', or '.join(f for f in fixes if f)}")
    per_rank = -(-rows // unit)
    if dp > 1 and rows < dp * per_rank:
        if rows < dp:
            fix = f"evaluate at least {dp} rows, or on fewer data-parallel ranks"
        else:
            fix = f"use batch_size={next(b for b in range(batch_size + 1, rows + 1) if rows >= dp * -(-rows // (dp * b)))}"
        raise UsageError(
            f"mg.eval_loader: {rows} rows in batches of at most {batch_size} over {dp} data-parallel ranks "
            f"(layout {share.layout}) would leave a rank an empty batch, and every rank must run as many forwards "
            f"(FSDP gathers the parameters in each); {fix}")


def eval_loader(dataset: Dataset, dist: Dist, batch_size: int, *, layout: Any = None, mesh: Any = None,
                num_workers: int = 0, pin_memory: bool | None = None, **dataloader_kwargs: Any) -> DataLoader:
    """This rank's evaluation batches: every row once per data-parallel rank, no padding duplicates.

    ``layout``: the ``mg.parallel.Layout`` the model was spread by, or the model ``mg.parallelize``
    returned; left out, the layout this process spread a model by last, else every process is a
    data-parallel rank. Tensor-parallel peers and pipeline stages
    read the same batches; every data-parallel rank gets as many batches (of at most ``batch_size`` rows,
    exactly ``batch_size`` under pipeline parallelism). A ``datasets.Dataset`` (or ``TensorDataset``,
    ``TokenShards``) is read one batch per call, columns as tensors, as ``mg.loader`` reads it. Sum
    metrics per rank and combine them with ``mg.all_reduce_sum``: exact figures on any layout.

    >>> correct = count = 0
    >>> for x, y in mg.eval_loader(test_set, dist, batch_size=256, layout=model):
    ...     ...
    >>> totals = mg.all_reduce_sum({"correct": correct, "count": count})
    """
    positive_int(batch_size, "eval batch_size", "use e.g. batch_size=256")
    share = eval_share(dist, layout, mesh, "mg.eval_loader")
    _refuse_uncountable(len(dataset), share, batch_size)
    for bad in OWNED:
        if bad in dataloader_kwargs:
            raise UsageError(f"mg.eval_loader() cuts the batches itself (batch_size={batch_size}); "
                             f"remove {bad}= from the call")
    if pin_memory is None:
        pin_memory = dist.device.type == "cuda"
    kwargs = dict(dataloader_kwargs, num_workers=num_workers, pin_memory=pin_memory)
    view, kwargs = batched_view(dataset, kwargs)
    batches = [list(b) for b in eval_batches(len(dataset), share.dp_rank, share.dp_size, batch_size)]
    return DataLoader(view, batch_sampler=batches, **kwargs)


def _reduce_device() -> torch.device:
    if tdist.is_initialized() and tdist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: Mapping[str, float] | Sequence[float] | float):
    """Sum per-sample numbers (correct, count, summed loss) over the data-parallel ranks, each once (float64).

    Under model parallelism one process per data-parallel rank counts (tensor-parallel peer 0 on the rank
    with the last pipeline stage, see ``mg.eval_loader``); the others' numbers are left out, and every rank
    gets the total. Numbers that differ between tensor-parallel peers or pipeline stages are not per-sample
    sums: reduce those with ``torch.distributed.all_reduce``. Accepts a dict, a list/tuple, or one number,
    and returns the same shape.

    >>> mg.all_reduce_sum({"correct": 940, "count": 1000})
    {'correct': 1873.0, 'count': 2000.0}
    """
    if isinstance(values, Mapping):
        keys = list(values)
        flat = [float(values[k]) for k in keys]
    elif isinstance(values, (list, tuple)):
        flat = [float(v) for v in values]
    else:
        flat = [float(values)]
    from ..spreads import process_share

    on = tdist.is_initialized()
    share = process_share(tdist.get_rank(), tdist.get_world_size()) if on else None
    if share is not None and not share.counts:
        flat = [0.0] * len(flat)  # a copy of a counted rank's numbers (TP peer), or no outputs (earlier stage)
    t = torch.tensor(flat, dtype=torch.float64, device=_reduce_device())
    if on and tdist.get_world_size() > 1:
        tdist.all_reduce(t)
    out = t.tolist()
    if isinstance(values, Mapping):
        return dict(zip(keys, out))
    if isinstance(values, (list, tuple)):
        return type(values)(out)
    return out[0]
