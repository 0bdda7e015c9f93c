"""What ``mg.stream_loader`` reads: a source turned into shards, each opened again by every reader.

A shard is a WebDataset-style ``.tar`` (members grouped by key into one
dict per sample: ``{"__key__": "000017", "jpg": b"...", "cls": b"3"}``), a
``.jsonl`` file (one dict per line), a function that returns an iterable of
records, a list of records (its length is known: a resume skips it without
reading), or a data source of a ``datasets.IterableDataset``. Every reader
(each rank, each DataLoader worker, each epoch) opens the shards again, so
a shard must give the same records in the same order every time.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from ..errors import UsageError
from .hf import hf_iterable_shards, is_hf_iterable

SUFFIXES = (".tar", ".tgz", ".tar.gz", ".jsonl")


@dataclass(frozen=True)
class StreamShard:
    """How to open one shard, what identifies it, and its length when known without reading it."""

    open: Callable[[], Iterable[Any]]
    name: Any
    length: int | None = None
    records: Any = None  # a sized sequence: random access for a resume's skip


class TarRef:
    """A tar sample not read yet: its key and where each member's bytes lie; ``load()`` reads them.

    Every reader walks every record of the stream, but only keeps its share:
    for an uncompressed tar the walk reads the 512-byte headers and leaves
    the members' bytes on disk until the record is kept.
    """

    __slots__ = ("path", "key", "members")

    def __init__(self, path: str, key: str) -> None:
        self.path, self.key, self.members = path, key, {}

    def load(self) -> dict[str, Any]:
        sample: dict[str, Any] = {"__key__": self.key}
        with open(self.path, "rb") as fp:
            for ext, (offset, size) in self.members.items():
                fp.seek(offset)
                sample[ext] = fp.read(size)
        return sample


def materialize(record: Any) -> Any:
    """The record a transform sees: a ``TarRef`` read into its dict, anything else as it is."""
    return record.load() if type(record) is TarRef else record


def _samples(members, key_of, value_of):
    current = None
    for member in members:
        if not member.isfile():
            continue
        key, ext = key_of(member.name)
        if current is not None and current[0] != key:
            yield current
            current = None
        if current is None:
            current = (key, {})
        current[1][ext] = value_of(member)
    if current is not None:
        yield current


def _key(name: str) -> tuple[str, str]:
    folder, base = os.path.split(name)
    stem, _, ext = base.partition(".")
    return os.path.join(folder, stem), ext


def read_tar(path: str) -> Iterator[Any]:
    """A WebDataset-style tar's samples: consecutive members sharing a key (the path before the name's first dot).

    Uncompressed: ``TarRef`` records (headers only; bytes read for kept records).
    Compressed: dicts of bytes, read in one streaming pass.
    """
    if path.endswith(".tar"):
        with tarfile.open(path, "r:") as tar:  # random access: iterating reads headers, seeks over data
            for key, members in _samples(tar, _key, lambda m: (m.offset_data, m.size)):
                ref = TarRef(path, key)
                ref.members = members
                yield ref
        return
    with tarfile.open(path, "r|*") as tar:
        for key, members in _samples(tar, _key, lambda m: tar.extractfile(m).read()):
            yield {"__key__": key, **members}


def read_jsonl(path: str) -> Iterator[Any]:
    with open(path, encoding="utf-8") as fp:
        for line in fp:
            if line.strip():
                yield json.loads(line)


def _iterate(obj) -> Iterator[Any]:
    return iter(obj)


def _path_shard(path: Path, root: str) -> StreamShard:
    name = os.path.relpath(path.resolve(), root)
    if path.name.endswith((".tar", ".tgz", ".tar.gz")):
        reader = read_tar
    elif path.suffix == ".jsonl":
        reader = read_jsonl
    else:
        raise UsageError(f"stream shard {path} is neither a .tar (WebDataset) nor a .jsonl file; convert it, or pass "
                         "a function that opens it and yields its records")
    return StreamShard(functools.partial(reader, str(path)), [name, path.stat().st_size])


def listed_files(text: str, suffixes: tuple[str, ...], none_there: str, example: str) -> list[Path] | None:
    """A directory's files ending in ``suffixes`` (sorted, hidden ones left out) or a glob's matches; ``None``
    when ``text`` is neither. ``none_there``: the refusal's end for a directory without any, after "holds no"."""
    if os.path.isdir(text):
        files = sorted(p for p in Path(text).iterdir()
                       if p.is_file() and p.name.endswith(suffixes) and not p.name.startswith("."))
        if not files:
            raise UsageError(f"{text} holds no {none_there}")
        return files
    if any(c in text for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(text) if os.path.isfile(p))
        if not files:
            raise UsageError(f"no file matches {text}; check the pattern (e.g. '{example}')")
        return files
    return None


def _paths(text: str) -> list[Path]:
    files = listed_files(text, SUFFIXES, ".tar or .jsonl shards; pass a directory of them, a glob or a list",
                         "data/train-*.tar")
    if files is not None:
        return files
    if not os.path.isfile(text):
        raise UsageError(f"stream shard {text} does not exist; pass existing .tar / .jsonl files or their directory")
    return [Path(text)]


def _callable_name(fn) -> Any:
    if isinstance(fn, functools.partial):
        args = [a if isinstance(a, (str, int, float, bool)) else type(a).__name__ for a in fn.args]
        return [_callable_name(fn.func), *args]
    return getattr(fn, "__qualname__", type(fn).__name__)


def _one(item: Any, i: int, root: str) -> StreamShard:
    if isinstance(item, (str, os.PathLike)):
        return _path_shard(Path(item), root)
    if callable(item) and not hasattr(item, "__len__"):
        return StreamShard(item, _callable_name(item))
    if hasattr(item, "__len__") and hasattr(item, "__getitem__") and not isinstance(item, (Mapping, bytes)):
        return StreamShard(functools.partial(_iterate, item), ["records", len(item)], len(item), item)
    raise UsageError(f"stream shard {i} is a {type(item).__name__}; a shard is a .tar/.jsonl path, a function that "
                     "returns an iterable of records, or a list of records (a flat list of records is one shard: "
                     "pass [records])")


def stream_shards(source: Any) -> tuple[list[StreamShard], dict[str, Any]]:
    """The shards of ``source`` and its fingerprint (names, byte sizes, known lengths)."""
    if is_hf_iterable(source):
        openers, fp = hf_iterable_shards(source)
        return [StreamShard(o, ["hf", i]) for i, o in enumerate(openers)], fp
    if isinstance(source, Iterator):
        raise UsageError(f"the stream source is an iterator ({type(source).__name__}): it can be read once, but "
                         "every rank, worker and epoch reads the stream again; pass a function that returns it, "
                         "or a list of such functions (one per shard)")
    if isinstance(source, (str, os.PathLike)):
        items: list[Any] = _paths(os.fspath(source))
    elif isinstance(source, (list, tuple)):
        items = list(source)
    elif callable(source):
        items = [source]
    elif hasattr(source, "__iter__"):  # a re-iterable (a torch IterableDataset): one shard
        items = [functools.partial(_iterate, source)]
    else:
        raise UsageError(f"mg.stream_loader cannot read a {type(source).__name__}; pass shard paths, functions that "
                         "yield records, lists of records or a datasets.IterableDataset")
    if not items:
        raise UsageError("the stream source has no shards; pass at least one path, function or list of records")
    files = [Path(p) for p in items if isinstance(p, (str, os.PathLike))]
    root = os.path.commonpath([str(p.resolve().parent) for p in files]) if files else ""
    shards = [_one(item, i, root) for i, item in enumerate(items)]
    return shards, {"kind": "stream", "shards": [s.name for s in shards]}


class RawStream:
    """The records of ``shards`` in ``order``, from record ``skip`` on; ``skipped`` counts what was passed over.

    Shards of known length are skipped without being opened, lists by index;
    the rest are read and their records dropped (no transform runs on them).
    """

    def __init__(self, shards: list[StreamShard], order: list[int], skip: int) -> None:
        self.shards, self.order, self.skip, self.skipped = shards, order, skip, 0

    def __iter__(self) -> Iterator[Any]:
        skip = self.skip
        for i in self.order:
            shard = self.shards[i]
            if skip and shard.length is not None and shard.length <= skip:
                skip -= shard.length
                self.skipped += shard.length
                continue
            if shard.records is not None:
                start, skip = skip, 0
                self.skipped += start
                for j in range(start, len(shard.records)):
                    yield shard.records[j]
                continue
            it = iter(shard.open())
            while skip:
                try:
                    next(it)
                except StopIteration:
                    break
                skip -= 1
                self.skipped += 1
            else:
                yield from it
