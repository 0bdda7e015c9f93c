"""The GPU kinds: public spec figures (``gpus.json``), the one table the meter's MFU and the forecast read.

Per kind: its architecture, the pattern its ``torch.cuda.get_device_name()`` matches, the dense peak per dtype,
the HBM's size and bandwidth and, for the kinds the forecast offers, the bus bandwidth nccl-tests reaches;
each row names its source.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path


@cache
def kinds() -> dict[str, dict]:
    """Every GPU kind as stored (GB, TB/s, TFLOP/s, GB/s), in matching order: the specific names first."""
    return json.loads((Path(__file__).resolve().parent / "gpus.json").read_text())["gpus"]


def by_device_name(device_name: str) -> dict | None:
    """The row of the first kind whose pattern the device's name matches (``H100 PCIe`` before ``H100``), or None."""
    return next((row for row in kinds().values() if row["match"] and re.search(row["match"], device_name)), None)
