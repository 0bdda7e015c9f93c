"""Hugging Face ``datasets`` as loader sources, never imported by the core (the optional extra ``multigpu[datasets]``).

A ``datasets.Dataset`` is map-style and memory-mapped Arrow: ``mg.loader``
reads one micro-batch per Arrow take (``ds[indices]``, columns as tensors)
and never copies the table into the process. Its pickle names the Arrow
files, not their contents, so DataLoader workers receive it cheaply. A
``datasets.IterableDataset`` is a list of shards for ``mg.stream_loader``
(``ds.shard(num_shards, i)``, each one a data source of the dataset).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
from torch.utils.data import Dataset

from ..errors import UsageError


def _is(obj: Any, name: str) -> bool:
    return any(c.__name__ == name and c.__module__.split(".")[0] == "datasets" for c in type(obj).__mro__)


def is_hf_dataset(obj: Any) -> bool:
    """A ``datasets.Dataset`` (checked by type name: the core never imports ``datasets``)."""
    return _is(obj, "Dataset")


def is_hf_iterable(obj: Any) -> bool:
    """A ``datasets.IterableDataset``."""
    return _is(obj, "IterableDataset")


def hf_fingerprint(ds) -> dict[str, Any]:
    """Arrow's own fingerprint (kept by save_to_disk / load_from_disk), the row count and the columns."""
    return {"kind": "hf", "fingerprint": str(getattr(ds, "_fingerprint", "")), "rows": len(ds),
            "columns": list(ds.column_names)}


class _HFBatched(Dataset):
    """A ``datasets.Dataset`` read one micro-batch per call: a dict of columns, tensors where they stack."""

    def __init__(self, ds) -> None:
        # No format set: torch tensors. A format the user chose (numpy, a column subset) is kept.
        self.ds = ds.with_format("torch") if ds.format.get("type") is None else ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index):
        return self.ds[index]

    def __getitems__(self, indices: list[int]):
        return self.ds[indices]


def hf_batched(ds) -> Dataset:
    return _HFBatched(ds)


def token_column(ds, column: str | None, where: str = "the dataset") -> str:
    """The integer-list column holding token ids: ``column``, or the first of input_ids / tokens / ids / token_ids."""
    import pyarrow as pa

    names = list(ds.column_names)
    wanted = [column] if column else [c for c in ("input_ids", "tokens", "ids", "token_ids") if c in names]
    if not wanted or wanted[0] not in names:
        raise UsageError(f"{where} has columns {names} but no token-id column "
                         f"({column or 'input_ids, tokens, ids or token_ids'}); save the token ids as one of them")
    kind = ds.data.column(wanted[0]).type
    if not ((pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind))
            and pa.types.is_integer(kind.value_type)):
        raise UsageError(f"{where}'s column {wanted[0]!r} holds {kind}, not lists of integer token ids; "
                         "tokenise it first (a list of ints per row)")
    if getattr(ds, "_indices", None) is not None:
        raise UsageError(f"{where} is a selection or shuffle of its table (an indices mapping); "
                         "call ds.flatten_indices() (or save_to_disk it) first, and let the loader shuffle")
    return wanted[0]


def token_chunks(ds, column: str) -> list[np.ndarray]:
    """Each Arrow chunk's token ids as one flat numpy view onto the memory map (no copy)."""
    chunks = []
    for chunk in ds.data.column(column).chunks:
        flat = chunk.flatten()  # respects the chunk's offset into the shared buffers
        chunks.append(flat.to_numpy(zero_copy_only=flat.null_count == 0))
    return chunks


def _hf_shard(ds, shards: int, index: int, batch: int = 256):
    # Through .iter() in batches, not iter(ds): inside a DataLoader worker, iter(ds) splits the
    # shards over the workers itself, and every worker here must read the whole stream.
    for columns in ds.shard(num_shards=shards, index=index).iter(batch_size=batch):
        names = list(columns)
        for row in range(len(columns[names[0]]) if names else 0):
            yield {name: columns[name][row] for name in names}


def hf_iterable_shards(ds) -> tuple[list[Callable[[], Any]], dict[str, Any]]:
    """An ``IterableDataset`` as one opener per data source, and what identifies it."""
    shards = int(getattr(ds, "num_shards", None) or getattr(ds, "n_shards", 1))
    info = getattr(ds, "info", None)
    fp = {"kind": "hf-iterable", "shards": shards,
          "name": getattr(info, "dataset_name", None), "config": getattr(info, "config_name", None),
          "columns": list(ds.column_names) if getattr(ds, "column_names", None) else None}
    return [functools.partial(_hf_shard, ds, shards, i) for i in range(shards)], fp
