"""World-size-invariant data loading: the sequence of global batches depends on (data, seed, global batch, epoch) only.

``loader`` (map-style datasets: tensors, ``TokenShards`` on disk, a Hugging
Face ``Dataset``) and ``stream_loader`` (shards read in order: WebDataset
tars, JSON lines, generators, a ``datasets.IterableDataset``) give rank
``r`` its contiguous share of every global batch, resume mid-epoch on any
world size from ``state_dict()``, and refuse a resume over changed data.
``eval_loader`` / ``stream_eval_loader`` read each row once per data-parallel rank, and
``all_reduce_sum`` counts each data-parallel rank once: exact evaluation on any layout.
"""

from .evaluation import all_reduce_sum, eval_batches, eval_loader
from .loader import DistributedLoader, global_order, loader, source_fingerprint, to_device
from .shards import TokenShards
from .stream import StreamLoader, stream_eval_loader, stream_loader, window_order

__all__ = ["DistributedLoader", "StreamLoader", "TokenShards", "all_reduce_sum", "eval_loader", "global_order",
           "loader", "eval_batches", "source_fingerprint", "stream_eval_loader", "stream_loader", "to_device",
           "window_order"]
