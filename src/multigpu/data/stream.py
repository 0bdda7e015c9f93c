"""Streaming sources with the loader's promises: the same global batches on any world size and worker count.

A stream cannot be indexed, so every rank (and every DataLoader worker)
walks the same global stream of raw records and keeps only its own part:

1. the epoch's shard order is a permutation keyed on (seed, epoch);
2. positions are cut into windows of ``buffer`` records, and the records of
   window ``w`` are permuted by a generator keyed on (seed, epoch, w): the
   sample at global position ``p`` is a function of (seed, epoch, p) only;
3. global batch ``b`` is positions ``[b*G, (b+1)*G)``; data-parallel rank
   ``r`` keeps its contiguous share, cut into micro-batches; DataLoader
   worker ``k`` of ``W`` builds this rank's micro-batches ``k, k+W, ...``
   (the DataLoader hands them back round robin, so in order);
4. ``transform`` (decode, tokenise, augment) runs only on kept records.

Cost, said plainly: each rank and worker *reads* the whole raw stream
(``ranks x workers`` reads of every record, from the page cache after the
first) and holds up to ``buffer`` raw records; only its share is
transformed. Resume at (epoch, batch) skips whole shards of known length
unopened and replays the records of the rest without transforming them.
"""

from __future__ import annotations

import hashlib
from collections import deque
from itertools import islice
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from ..batch import BatchPlan
from ..dist import Dist
from ..errors import UsageError
from ..runtime.values import positive_int
from .loader import (_as_batch, _json, dataloader_kwargs_of, global_order, refuse_changed_source,
                     refuse_other_order, to_device, worker_generator)
from .evaluation import eval_share
from .sources import RawStream, materialize, stream_shards

def window_order(seed: int, epoch: int, window: int, n: int) -> list[int]:
    """The permutation of window ``window``'s ``n`` records: keyed on (seed, epoch, window) alone."""
    key = hashlib.blake2b(f"{seed}/{epoch}/{window}".encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    return torch.randperm(n, generator=g).tolist()


class EpochEnd:
    """A reader's last item: how many raw records the epoch's stream held (not a batch: the loader drops it)."""

    def __init__(self, records: int) -> None:
        self.records = records


def _identity(record):
    return record


class _Pass(IterableDataset):
    """One pass over the stream from global batch ``start``: this rank's micro-batches, split over workers."""

    def __init__(self, owner: "StreamLoader") -> None:
        o = owner
        self.shards, self.plan, self.dp_rank, self.buffer = o.shards, o.plan, o.dp_rank, o.buffer
        self.seed, self.epoch, self.start, self.shuffle = o.seed, o.epoch, o.batch_index, o.shuffle
        self.order = global_order(len(o.shards), o.seed, o.epoch, o.shuffle).tolist()
        self.transform, self.collate = o.transform or _identity, o.collate_fn or default_collate

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        G, A, m = self.plan.global_batch, self.plan.accum_steps, self.plan.micro_batch
        share = self.plan.rank_slice(self.dp_rank).start
        B = self.buffer
        window = self.start * G // B
        raw = RawStream(self.shards, self.order, skip=window * B)
        records = iter(raw)

        def mine():  # (global batch, first position) of this worker's micro-batches, in order
            k = self.start * A + worker
            while True:
                b, a = divmod(k, A)
                yield b, b * G + share + a * m
                k += workers

        upcoming, queue, kept = mine(), deque(), {}
        nxt = next(upcoming)
        pos = origin = window * B
        while True:
            buf = list(islice(records, B))
            if not buf:
                break
            lo = pos
            pos += len(buf)
            perm = window_order(self.seed, self.epoch, window, len(buf)) if self.shuffle else None
            while nxt[1] < pos:
                queue.append(nxt)
                nxt = next(upcoming)
            for _, first in queue:
                for p in range(max(first, lo), min(first + m, pos)):
                    kept[p] = buf[perm[p - lo]] if perm is not None else buf[p - lo]
            del buf
            # A micro-batch leaves once its whole global batch exists (the stream may end before it does);
            # only then is it transformed, so a dropped remainder costs no transform.
            while queue and (queue[0][0] + 1) * G <= pos:
                _, first = queue.popleft()
                yield self.collate([self.transform(materialize(kept.pop(p))) for p in range(first, first + m)])
            if pos - lo < B:
                break
            window += 1
        yield EpochEnd(raw.skipped + pos - origin)


class StreamLoader:
    """Iterate to get, per optimizer step, this rank's micro-batches of a stream (see the module doc).

    The position, ``state_dict()`` and ``load_state_dict()`` behave as ``mg.loader``'s.
    ``len()`` is known once the record count is: after one whole epoch, or at
    once when every shard's length is (lists of records).
    """

    def __init__(self, source: Any, plan: BatchPlan, dist: Dist, *, shuffle: bool, seed: int, buffer: int,
                 transform: Callable | None, collate_fn: Callable | None, device, loader_kwargs: dict) -> None:
        self.dp_rank = plan.dp_rank_of(dist)
        self.plan, self.dist, self.shuffle, self.seed = plan, dist, shuffle, seed
        self.buffer = positive_int(buffer, "buffer", "use e.g. buffer=8192 (records shuffled together)")
        self.transform, self.collate_fn = transform, collate_fn
        self.shards, self.source = stream_shards(source)
        lengths = [s.length for s in self.shards]
        self.records = sum(lengths) if None not in lengths else None
        if self.records is not None:
            self._check_size(self.records)
        self.device = dist.device if device is None else torch.device(device)
        self.epoch = self.batch_index = 0
        self._kwargs = loader_kwargs

    def _check_size(self, records: int) -> None:
        if records == 0:
            raise UsageError(f"the stream is empty: its {len(self.shards)} shard(s) gave no record; "
                             "check the paths or the functions that open them")
        if records < self.plan.global_batch:
            raise UsageError(f"the stream has {records} records but one global batch is {self.plan.global_batch}; "
                             f"use a global batch of at most {records}")

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps per epoch, once the record count is known (else None)."""
        return None if self.records is None else self.plan.steps_per_epoch(self.records)

    def __len__(self) -> int:
        if self.records is None:
            raise TypeError("the stream's length is unknown until one epoch has been read")
        return self.steps_per_epoch

    def _dataloader(self) -> DataLoader:
        gen = worker_generator(self.seed, self.epoch, self.dp_rank)
        return DataLoader(_Pass(self), batch_size=None, collate_fn=_as_batch, generator=gen, **self._kwargs)

    def __iter__(self) -> Iterator[list[Any]]:
        if self.steps_per_epoch is not None and self.batch_index >= self.steps_per_epoch:
            self.epoch, self.batch_index = self.epoch + 1, 0
        non_blocking = bool(self._kwargs.get("pin_memory"))
        group: list[Any] = []
        seen = None
        for item in self._dataloader():
            if isinstance(item, EpochEnd):
                seen = item.records
                continue
            group.append(to_device(item, self.device, non_blocking))
            if len(group) == self.plan.accum_steps:
                self.batch_index += 1
                yield group
                group = []
        if seen is not None:
            if self.records is not None and seen != self.records:
                raise UsageError(f"the stream gave {seen} records in epoch {self.epoch} but {self.records} were "
                                 "counted before (or saved with the position): the source changed under the run; "
                                 "restore the shards, or start without the checkpoint")
            self._check_size(seen)
            self.records = seen
        self.epoch, self.batch_index = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """The position (epoch, next global batch) and what identifies the stream: shards, record count if known."""
        state = {"kind": "stream", "epoch": self.epoch, "batch_index": self.batch_index, "seed": self.seed,
                 "global_batch": self.plan.global_batch, "buffer": self.buffer, "shuffle": self.shuffle,
                 "source": _json(self.source)}  # a copy: whoever loads into the state must not change ours
        if self.records is not None:
            state["records"] = self.records
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        refuse_other_order(state, self.state_dict(), ("seed", "global_batch", "buffer", "shuffle"), "stream")
        saved = state.get("records")
        if saved is not None and self.records is not None and saved != self.records:
            refuse_changed_source({"records": saved}, {"records": self.records})
        self.records = self.records if saved is None else int(saved)
        self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])


def _kwargs(dist: Dist, num_workers: int, pin_memory: bool | None, extra: dict[str, Any], what: str) -> dict[str, Any]:
    if extra.get("persistent_workers"):
        raise UsageError(f"{what} starts its workers at every pass (each learns its position then); "
                         "drop persistent_workers=True")
    return dataloader_kwargs_of(dist, num_workers, pin_memory, extra, what)


def stream_loader(source: Any, plan: BatchPlan, dist: Dist, shuffle: bool = True, seed: int = 0, *,
                  buffer: int = 8192, transform: Callable | None = None, num_workers: int = 0,
                  pin_memory: bool | None = None, collate_fn: Callable | None = None, device=None,
                  **dataloader_kwargs: Any) -> StreamLoader:
    """This rank's share of every global batch of a stream, as lists of ``plan.accum_steps`` micro-batches.

    ``source``: a directory, glob or list of ``.tar`` (WebDataset) / ``.jsonl``
    shards, functions that return an iterable of records, lists of records, or
    a ``datasets.IterableDataset``. ``buffer``: records shuffled together
    (memory per reader: that many raw records). ``transform(record)``: runs on
    this rank's records only; ``collate_fn`` stacks a micro-batch (default
    ``default_collate``).

    >>> train = mg.stream_loader("data/train-*.tar", plan, dist, transform=decode, buffer=4096, num_workers=4)
    >>> for micro_batches in train:
    ...     ...
    """
    kwargs = _kwargs(dist, num_workers, pin_memory, dataloader_kwargs, "mg.stream_loader()")
    return StreamLoader(source, plan, dist, shuffle=shuffle, seed=seed, buffer=buffer, transform=transform,
                        collate_fn=collate_fn, device=device, loader_kwargs=kwargs)


class _EvalPass(IterableDataset):
    """Positions ``rank, rank + R, ...`` of the stream in order, batched, batches split over workers."""

    def __init__(self, shards, rank: int, ranks: int, batch_size: int, transform, collate) -> None:
        self.shards, self.rank, self.ranks, self.batch_size = shards, rank, ranks, batch_size
        self.transform, self.collate = transform or _identity, collate or default_collate

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        batch: list[Any] = []
        for p, record in enumerate(RawStream(self.shards, list(range(len(self.shards))), skip=0)):
            if p % self.ranks != self.rank:
                continue
            j = p // self.ranks  # this rank's j-th record, in batch j // batch_size
            if (j // self.batch_size) % workers != worker:
                continue
            batch.append(self.transform(materialize(record)))
            if len(batch) == self.batch_size:
                yield self.collate(batch)
                batch = []
        if batch:
            yield self.collate(batch)


def stream_eval_loader(source: Any, dist: Dist, batch_size: int, *, layout: Any = None, mesh: Any = None,
                       transform: Callable | None = None, num_workers: int = 0, pin_memory: bool | None = None,
                       collate_fn: Callable | None = None, **dataloader_kwargs: Any) -> DataLoader:
    """This rank's evaluation share of a stream: every record once per data-parallel rank, no padding, in order.

    Data-parallel rank ``r`` of ``R`` takes records ``r, r+R, ...``; ``layout`` (or ``mesh``) as for
    ``mg.eval_loader``: tensor-parallel peers and pipeline stages read the same. Sum metrics and
    combine them with ``mg.all_reduce_sum`` for exact figures. The ranks' batch counts may differ by
    one (the stream's length is not known ahead): under FSDP, use ``mg.eval_loader``.
    """
    positive_int(batch_size, "eval batch_size", "use e.g. batch_size=256")
    share = eval_share(dist, layout, mesh, "mg.stream_eval_loader")
    rank, ranks = share.dp_rank, share.dp_size
    shards, _ = stream_shards(source)
    kwargs = _kwargs(dist, num_workers, pin_memory, dataloader_kwargs, "mg.stream_eval_loader()")
    return DataLoader(_EvalPass(shards, rank, ranks, batch_size, transform, collate_fn), batch_size=None,
                      collate_fn=_as_batch, **kwargs)
