"""Plain values every layer reads the same way: sizes, dtypes, positive integers.

One spelling each, so that ``MB`` means the same bytes in ``multigpu run
--memory-budget`` and ``multigpu bench --sizes``, and ``"bf16"`` the same
dtype in ``mg.Precision``, FSDP's mixed precision and the FLOP counter.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..errors import UsageError

# Every dtype a flag or an option names, by its short name. Training (mg.Precision,
# FSDP's mixed precision, FLOP rates) takes the first three; collectives all.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64,
          "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64}
TRAINING_DTYPES = ("fp32", "bf16", "fp16")
_ALIASES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
            "float64": "fp64", "double": "fp64", "int": "int32"}
_NAMES = {v: k for k, v in DTYPES.items()}

# Binary: K, M, G (nccl-tests' -b/-e convention: 256M is 2**28) and KiB..TiB.
# Decimal: KB..TB (SI, as disk and memory vendors count: 512MB is 512 * 10**6).
_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)([a-z]*)\s*", re.IGNORECASE)  # one word: "12 MB" is two


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes from ``4096``, ``256M`` or ``8GiB`` (binary), ``512MB`` (decimal); ``UsageError`` otherwise.

    ``what`` names the value in the error (e.g. ``"--memory-budget"``). A
    fraction needs a unit (``1.5GiB``; ``1.5`` or ``1.5B`` bytes mean nothing).

    >>> parse_size("1.5GiB"), parse_size("512MB"), parse_size("256M"), parse_size(4096)
    (1610612736, 512000000, 268435456, 4096)
    """
    got = str(text)
    match = _SIZE.fullmatch(got)
    size = 0
    if match and match.group(2).lower() in _UNITS | {"": 1} and (
            match.group(2).lower() not in ("", "b") or "." not in match.group(1)):
        unit = _UNITS.get(match.group(2).lower(), 1)
        number = match.group(1)
        size = int(float(number) * unit) if "." in number else int(number) * unit
    if size <= 0:
        fix = f"; use e.g. {what} 8GiB" if what.startswith("--") else ""
        raise UsageError(f"{what} must be a positive size like 512MB, 8GiB or a number of bytes, got {got!r}{fix}")
    return size


def dtype_name(value: Any) -> str | None:
    """The short name of a ``torch.dtype`` or of any accepted spelling (``"bfloat16"`` -> ``"bf16"``); None if unknown.

    >>> dtype_name(torch.float16), dtype_name("half"), dtype_name("bf16"), dtype_name("complex")
    ('fp16', 'fp16', 'bf16', None)
    """
    if isinstance(value, torch.dtype):
        return _NAMES.get(value)
    if isinstance(value, str):
        name = value.lower()
        return name if name in DTYPES else _ALIASES.get(name)
    return None


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending: the alternatives an impossible split offers.

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0]


def is_positive_int(value: Any) -> bool:
    """An ``int`` (not a ``bool``) of at least 1."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def positive_int(value: Any, what: str, fix: str = "") -> int:
    """``value`` if it is a positive ``int``; otherwise ``UsageError`` naming ``what`` (and the ``fix``).

    >>> positive_int(3, "every")
    3
    """
    if not is_positive_int(value):
        raise UsageError(f"{what} must be a positive integer, got {value!r}" + (f"; {fix}" if fix else ""))
    return value


def int_list(text: str, expected: str, fix: str = "", skip_empty: bool = False) -> tuple[int, ...]:
    """The integers of a comma-separated flag value (``"1,2,4"``; spaces around each are fine);
    ``UsageError`` ``"{expected}, got {text!r}; {fix}"`` when an item is not one.

    ``skip_empty`` drops empty items (``"1,2,"`` is 1, 2) instead of refusing them. Ranges
    (at least 1, increasing, ...) are the caller's: each flag says its own.

    >>> int_list("1, 2,4", "--workers must be a comma-separated list of integers")
    (1, 2, 4)
    """
    try:
        return tuple(int(v) for v in text.split(",") if not skip_empty or v.strip())
    except ValueError:
        raise UsageError(f"{expected}, got {text!r}" + (f"; {fix}" if fix else "")) from None
