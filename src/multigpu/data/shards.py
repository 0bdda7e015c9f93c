"""Token shards on disk as one map-style dataset: ``mg.loader`` then orders it the same on any world size.

Formats, told apart by their bytes (never by a guess that could pass silently):

- nanoGPT's raw ``.bin``: flat little-endian token ids, ``uint16`` (or the
  ``dtype`` given, e.g. ``uint32`` for vocabularies over 65,536);
- llm.c / modded-nanogpt's headered ``.bin``: 256 int32 (magic, version,
  token count), then the tokens; magic 20240520 is ``uint16`` (GPT-2),
  20240801 ``uint32`` (LLaMA 3). The count makes truncation detectable;
- ``.npy``: one 1-D integer array (``np.load(mmap_mode="r")``);
- a Hugging Face ``Dataset`` column of token-id lists (``TokenShards.from_hf``):
  each Arrow chunk is a shard, read in place from the memory map.

Sample ``i`` is a window of ``block_size + 1`` tokens, input and target
shifted by one (nanoGPT's windows, stride ``block_size``); windows never
cross a shard boundary, so a shard's last partial window is dropped. Index
``i`` finds its shard by binary search over cumulative window counts. Files
are memory-mapped lazily, in each process that reads (DataLoader workers
included), so the object pickles as names and counts. Memory per rank: the
loader's permutation, 8 bytes per window (10B tokens at block 1024: 78 MiB),
plus the page cache the kernel shares between ranks.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import UsageError
from ..runtime.values import positive_int
from .sources import listed_files

HEADER_BYTES = 256 * 4
MAGIC = {20240520: np.dtype("<u2"), 20240801: np.dtype("<u4")}  # llm.c's GPT-2 and LLaMA 3 token files
OPEN_MAPS = 64  # each np.memmap holds a file descriptor: keep at most this many open per process
VOCAB_SCAN = 1 << 24  # tokens per shard read by the vocabulary check


@dataclass(frozen=True)
class Shard:
    """One shard: where its tokens start (bytes) and how many there are."""

    name: str
    path: str | None  # None: an Arrow chunk of a Hugging Face dataset
    offset: int
    count: int
    dtype: str
    nbytes: int


def shard_files(source: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """The files of ``source``: a directory (its ``.bin`` and ``.npy`` files, sorted), a glob, a file or a list."""
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        files = listed_files(text, (".bin", ".npy"), ".bin or .npy token shards; pass a directory of shards, a glob "
                             "like 'data/*train*.bin' or a list of files", "data/fineweb_train_*.bin")
        if files is not None:
            return files
        source = [text]
    files = [Path(p) for p in source]
    if not files:
        raise UsageError("the list of token shards is empty; pass at least one .bin or .npy file")
    for p in files:
        if not p.is_file():
            raise UsageError(f"token shard {p} does not exist; pass existing .bin / .npy files or their directory")
    return files


def token_dtype(dtype: Any) -> np.dtype | None:
    """``dtype`` as numpy's integer dtype (None stays None: the header, or uint16 for a raw file, decides)."""
    if dtype is None:
        return None
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.kind not in "iu":
        raise UsageError(f"dtype={dtype!r} is not an integer token dtype; pass e.g. dtype='uint16' or 'uint32'")
    return dt


def inspect_file(path: Path, dtype: np.dtype | None = None) -> Shard:
    """A shard's layout from its header and size alone (nothing is mapped): ``UsageError`` when it cannot be read."""
    size = path.stat().st_size
    if size == 0:
        raise UsageError(f"token shard {path} is empty (0 bytes); remove it or write its token ids again")
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r")
        except ValueError as err:  # numpy: the header promises more bytes than the file has
            raise UsageError(f"token shard {path} is truncated or not a .npy array ({err}); write it again") from None
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise UsageError(f"token shard {path} holds a {arr.dtype} array of shape {arr.shape}; "
                             "save token ids as one flat integer array")
        shard = Shard(path.name, str(path), int(arr.offset), int(arr.shape[0]), arr.dtype.name, size)
        return _checked(shard, dtype, path)
    head = np.fromfile(path, dtype="<i4", count=256) if size >= HEADER_BYTES else np.zeros(1, "<i4")
    if int(head[0]) in MAGIC:
        dt = MAGIC[int(head[0])]
        if int(head[0]) == 20240520 and int(head[1]) != 1:
            raise UsageError(f"token shard {path} has llm.c's magic but version {int(head[1])} (expected 1, uint16); "
                             "write it with llm.c's or modded-nanogpt's writer")
        count = int(head[2])
        expected = HEADER_BYTES + count * dt.itemsize
        if size != expected:
            raise UsageError(f"token shard {path} is truncated: its header promises {count:,} tokens "
                             f"({expected:,} bytes) but it has {size:,} bytes; download or write it again")
        return _checked(Shard(path.name, str(path), HEADER_BYTES, count, dt.name, size), dtype, path)
    dt = dtype if dtype is not None else np.dtype("uint16")
    if size % dt.itemsize:
        raise UsageError(f"token shard {path} has {size:,} bytes, not a whole number of {dt.name} tokens "
                         f"({dt.itemsize} bytes each); it is truncated, or pass the dtype it was written with")
    return Shard(path.name, str(path), 0, size // dt.itemsize, dt.name, size)


def _checked(shard: Shard, dtype: np.dtype | None, path: Path) -> Shard:
    if dtype is not None and dtype.name != shard.dtype:
        raise UsageError(f"token shard {path} holds {shard.dtype} tokens but dtype={dtype.name} was "
                         f"asked for; pass dtype={shard.dtype!r} or omit dtype (the header says it)")
    return shard


class TokenShards(Dataset):
    """Windows of ``block_size + 1`` tokens over one or many token shards (see the module doc for formats).

    >>> train = mg.TokenShards("data/fineweb10B/fineweb_train_*.bin", block_size=1024)
    >>> loader = mg.loader(train, plan, dist, seed=0)    # same global batches on any world size
    """

    def __init__(self, source: str | os.PathLike | Sequence[str | os.PathLike], block_size: int,
                 dtype: Any = None, vocab_size: int | None = None) -> None:
        positive_int(block_size, "block_size", "use e.g. block_size=1024")  # before any file is read
        dtype = token_dtype(dtype)
        files = shard_files(source)
        root = os.path.commonpath([str(p.resolve().parent) for p in files])
        shards = [inspect_file(p, dtype) for p in files]
        # Names relative to the shards' common folder: moving the folder keeps a checkpoint valid.
        shards = [Shard(os.path.relpath(Path(s.path).resolve(), root), s.path, s.offset, s.count, s.dtype, s.nbytes)
                  for s in shards]
        self._setup(shards, block_size, hf=None)
        if vocab_size is not None:
            self.check_vocab(vocab_size)

    @classmethod
    def from_hf(cls, ds, block_size: int, column: str | None = None, vocab_size: int | None = None) -> "TokenShards":
        """A Hugging Face ``Dataset`` whose ``column`` holds token-id lists, concatenated per Arrow chunk, in place."""
        from .hf import token_chunks, token_column

        positive_int(block_size, "block_size", "use e.g. block_size=1024")
        column = token_column(ds, column)
        chunks = token_chunks(ds, column)
        self = cls.__new__(cls)
        shards = [Shard(f"chunk{i}", None, 0, len(a), a.dtype.name, a.nbytes) for i, a in enumerate(chunks)]
        self._setup(shards, block_size, hf=(ds, column, str(getattr(ds, "_fingerprint", ""))))
        self._chunks = chunks
        if vocab_size is not None:
            self.check_vocab(vocab_size)
        return self

    def _setup(self, shards: list[Shard], block_size: int, hf) -> None:
        kinds = sorted({s.dtype for s in shards})
        if len(kinds) > 1:
            odd = next(s for s in shards if s.dtype != shards[0].dtype)
            raise UsageError(f"token shards mix dtypes ({', '.join(kinds)}): {odd.name} holds {odd.dtype} but "
                             f"{shards[0].name} holds {shards[0].dtype}; write every shard with one dtype")
        self.shards, self.block_size, self._hf = shards, block_size, hf
        self.dtype = shards[0].dtype
        windows = np.array([(s.count - 1) // block_size if s.count > block_size else 0 for s in shards], np.int64)
        self._ends = np.cumsum(windows)
        self._starts = self._ends - windows
        if int(self._ends[-1]) == 0:
            longest = max(s.count for s in shards)
            raise UsageError(f"the token shards hold no window of {block_size + 1} tokens (the longest of "
                             f"{len(shards)} has {longest:,}); use a smaller block_size or longer shards")
        self._maps: OrderedDict[int, np.ndarray] | None = None
        self._chunks = None

    @property
    def tokens(self) -> int:
        """Tokens in all shards."""
        return sum(s.count for s in self.shards)

    @property
    def fingerprint(self) -> dict[str, Any]:
        """What identifies the source in a loader's ``state_dict``: shard names and sizes, dtype, block size."""
        fp = {"kind": "token_shards", "block_size": self.block_size, "dtype": self.dtype,
              "shards": [[s.name, s.nbytes] for s in self.shards]}
        if self._hf is not None:
            fp["hf"] = self._hf[2]
        return fp

    def __getstate__(self):
        # Workers map the files themselves: pickle names and counts, not mappings (nor Arrow views).
        return dict(self.__dict__, _maps=None, _chunks=None)

    def _tokens(self, i: int) -> np.ndarray:
        if self._hf is not None:
            if self._chunks is None:
                from .hf import token_chunks

                self._chunks = token_chunks(self._hf[0], self._hf[1])
            return self._chunks[i]
        if self._maps is None:
            self._maps = OrderedDict()
        tokens = self._maps.get(i)
        if tokens is None:
            s = self.shards[i]
            tokens = np.memmap(s.path, dtype=s.dtype, mode="r", offset=s.offset, shape=(s.count,))
            self._maps[i] = tokens
            if len(self._maps) > OPEN_MAPS:
                self._maps.popitem(last=False)
        else:
            self._maps.move_to_end(i)
        return tokens

    def __len__(self) -> int:
        return int(self._ends[-1])

    def locate(self, i: int) -> tuple[int, int]:
        """(shard, first token) of window ``i``."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"window {i} out of range for {n} windows")
        i %= n
        shard = int(np.searchsorted(self._ends, i, side="right"))
        return shard, (i - int(self._starts[shard])) * self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard, start = self.locate(int(i))
        chunk = torch.from_numpy(self._tokens(shard)[start:start + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]

    def read_batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows ``indices`` stacked: (inputs, targets), each ``(len(indices), block_size)`` int64."""
        idx = np.asarray(indices, dtype=np.int64)
        n = len(self)
        if idx.size and not (-n <= int(idx.min()) and int(idx.max()) < n):
            raise IndexError(f"window {int(idx.min()) if idx.min() < -n else int(idx.max())} out of range for {n} windows")
        idx %= n
        # locate() for the whole batch at once: the per-window Python work was most of a batch's time.
        shards = np.searchsorted(self._ends, idx, side="right")
        starts = (idx - self._starts[shards]) * self.block_size
        out = np.empty((len(idx), self.block_size + 1), dtype=np.int64)
        for row, (shard, start) in enumerate(zip(shards.tolist(), starts.tolist())):
            out[row] = self._tokens(shard)[start:start + self.block_size + 1]
        t = torch.from_numpy(out)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def check_vocab(self, vocab_size: int) -> None:
        """``UsageError`` when a token id is ``>= vocab_size`` in the first 16M tokens of any shard.

        A bounded scan, not a proof: a full one would read every shard at every start.
        """
        for i, s in enumerate(self.shards):
            head = self._tokens(i)[:VOCAB_SCAN]
            top = int(head.max()) if len(head) else 0
            if top >= vocab_size:
                raise UsageError(f"token shard {s.name} holds token id {top} but the model's vocabulary is "
                                 f"{vocab_size}; build the model with vocab_size > {top}")

    def __repr__(self) -> str:
        return (f"TokenShards({len(self.shards)} shards, {self.tokens:,} {self.dtype} tokens, "
                f"{len(self):,} windows of {self.block_size + 1})")
