"""Tokens for the GPT recipe: bytes of a text every Python ships, or a local token file, read through ``np.memmap``.

The built-in corpus is Python's own documentation (``pydoc_data.topics``,
about 0.8 MB of English and code), tokenised as UTF-8 bytes (vocabulary
256). ``prepare_tokens`` writes it once as nanoGPT's layout: ``train.bin``
and ``val.bin``, flat ``uint16`` token ids; a directory that already holds
such files (e.g. nanoGPT's GPT-2 tokenised OpenWebText) is used as it is.
``TokenWindows`` cuts a token file into non-overlapping windows, one sample
each, so ``mg.loader`` gives every layout and world size the same global
batches and resumes them mid-epoch.

``--data`` also takes a directory of token shards (``*train*`` / ``*val*``
``.bin`` or ``.npy`` files: modded-nanogpt's fineweb10B, llm.c's headered
files) or a Hugging Face ``datasets`` folder (``save_to_disk`` of a
``DatasetDict`` with a train and a validation split and a token-id column);
``token_sets`` reads every layout as ``mg.TokenShards``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ...data import TokenShards
from ...errors import UsageError

VAL_FRACTION = 0.1  # the last tenth of the corpus is held out


def builtin_text() -> str:
    """Python's documentation topics, in a fixed order (the order of the dict is the file's)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def prepare_tokens(directory: str | os.PathLike) -> Path:
    """``directory`` with ``train.bin`` and ``val.bin``: kept if both exist, else written from the built-in text.

    >>> prepare_tokens("data/pydoc")            # doctest: +SKIP
    """
    out = Path(directory)
    if (out / "train.bin").is_file() and (out / "val.bin").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokens = np.frombuffer(builtin_text().encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    cut = int(len(tokens) * (1 - VAL_FRACTION))
    for name, part in (("train.bin", tokens[:cut]), ("val.bin", tokens[cut:])):
        tmp = out / f".{name}.{os.getpid()}.tmp"  # another rank or run may write the same file: rename is atomic
        part.tofile(tmp)
        os.replace(tmp, out / name)
    return out


def check_token_file(path: str | os.PathLike, block_size: int) -> int:
    """The number of tokens in ``path``; ``UsageError`` unless it holds at least one window of ``block_size + 1``.

    Reads the file's size only (no mapping: ``np.memmap`` cannot map an empty file), so a
    script can refuse a bad ``--data`` before it starts any work.
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"token file {path} does not exist; pass a directory with train.bin/val.bin "
                         "(nanoGPT's layout, uint16), with *train*/*val* shards, or a datasets save_to_disk folder, "
                         "or omit --data for the built-in text")
    size = path.stat().st_size
    if size % 2:
        raise UsageError(f"token file {path} has {size} bytes, not a whole number of uint16 tokens (2 bytes each); "
                         "write token ids as uint16 (nanoGPT's layout) or omit --data for the built-in text")
    if size == 0:
        raise UsageError(f"token file {path} is empty (0 bytes); write its token ids as uint16 (nanoGPT's layout) "
                         "or omit --data for the built-in text")
    tokens = size // 2
    if tokens < block_size + 1:
        raise UsageError(f"token file {path} has {tokens} tokens, fewer than one window of "
                         f"{block_size + 1}; use a smaller block_size or a longer file")
    return tokens


class TokenWindows(Dataset):
    """Sample ``i``: tokens ``[i*T, (i+1)*T)`` as input and the same shifted by one as target (``T = block_size``)."""

    def __init__(self, path: str | os.PathLike, block_size: int, vocab_size: int | None = None) -> None:
        path = Path(path)
        check_token_file(path, block_size)
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.block_size = block_size
        if vocab_size is not None:
            top = int(self.tokens.max())
            if top >= vocab_size:
                raise UsageError(f"token file {path} holds token id {top} but the model's vocabulary is "
                                 f"{vocab_size}; build the model with vocab_size > {top}")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = torch.from_numpy(self.tokens[start:start + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


VAL_SPLITS = ("validation", "val", "test")


def _shards(directory: Path, part: str) -> list[Path]:
    return sorted(p for p in directory.iterdir() if part in p.name and p.suffix in (".bin", ".npy") and p.is_file())


def token_sets(data: str | os.PathLike, block_size: int, vocab_size: int | None = None) -> tuple[TokenShards, TokenShards]:
    """(train, val) of ``--data``: train.bin/val.bin, a directory of *train*/*val* shards, or a datasets folder.

    Without ``vocab_size`` only headers and sizes are read, so ``check_args``
    can refuse a bad ``--data`` in one line before any work.
    """
    path = Path(data)
    if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        return _hf_sets(path, block_size, vocab_size)
    if path.is_dir() and not (path / "train.bin").exists():
        train, val = _shards(path, "train"), _shards(path, "val")
        if train or val:
            if not (train and val):
                have, miss = ("train", "val") if train else ("val", "train")
                raise UsageError(f"--data {path} has {have} shards but no *{miss}* shard; add one (e.g. "
                                 f"fineweb_{miss}_000000.bin), or pass a directory with train.bin and val.bin")
            return (TokenShards(train, block_size, vocab_size=vocab_size),
                    TokenShards(val, block_size, vocab_size=vocab_size))
    for name in ("train.bin", "val.bin"):
        check_token_file(path / name, block_size)
    return (TokenShards(path / "train.bin", block_size, vocab_size=vocab_size),
            TokenShards(path / "val.bin", block_size, vocab_size=vocab_size))


def _hf_sets(path: Path, block_size: int, vocab_size: int | None) -> tuple[TokenShards, TokenShards]:
    try:
        import datasets
    except ImportError:
        raise UsageError(f"--data {path} is a Hugging Face datasets folder but datasets is not installed; "
                         "pip install 'multigpu[datasets]'") from None
    saved = datasets.load_from_disk(str(path))  # memory-mapped: reads the metadata, not the rows
    if not isinstance(saved, datasets.DatasetDict):
        raise UsageError(f"--data {path} holds one split; save a DatasetDict with a train and a validation split "
                         "(DatasetDict(train=..., validation=...).save_to_disk)")
    val = next((saved[k] for k in VAL_SPLITS if k in saved), None)
    if "train" not in saved or val is None:
        raise UsageError(f"--data {path} has splits {sorted(saved)}; it needs train and one of "
                         f"{', '.join(VAL_SPLITS)}")
    return (TokenShards.from_hf(saved["train"], block_size, vocab_size=vocab_size),
            TokenShards.from_hf(val, block_size, vocab_size=vocab_size))
