"""Tokens for the GPT recipe: bytes of a text every Python ships, or a local token file, read through ``np.memmap``.

The built-in corpus is Python's own documentation (``pydoc_data.topics``,
about 0.8 MB of English and code), tokenised as UTF-8 bytes (vocabulary
256). ``prepare_tokens`` writes it once as nanoGPT's layout: ``train.bin``
and ``val.bin``, flat ``uint16`` token ids; a directory that already holds
such files (e.g. nanoGPT's GPT-2 tokenised OpenWebText) is used as it is.
``TokenWindows`` cuts a token file into non-overlapping windows, one sample
each, so ``mg.loader`` gives every layout and world size the same global
batches and resumes them mid-epoch.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

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
                         "(nanoGPT's layout, uint16) or omit --data for the built-in text")
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
