"""Per-rank random number generator states as plain tensors.

Python's ``random``, NumPy's global generator, torch's CPU generator and the
current CUDA device's generator, stored per rank in ``rng/rank-R.pt`` with
``torch.save`` of tensors and numbers only, so loading uses
``torch.load(weights_only=True)``.

When the world size changes, rank ``r`` takes saved rank ``r``'s state if it
exists; a rank that has no saved counterpart is reseeded from
``(step, rank)`` (deterministic, different per rank). Random draws of those
ranks (dropout, augmentation) then differ from an uninterrupted run; the
model, optimizer and data order do not.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """This process's RNG states as plain tensors and numbers."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python_version": int(version),
        "python_state": torch.tensor(mt, dtype=torch.int64),
        "python_gauss": gauss,
        "numpy_kind": str(kind),
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "numpy_pos": int(pos),
        "numpy_has_gauss": int(has_gauss),
        "numpy_gauss": float(cached),
        "torch": torch.get_rng_state(),
    }
    # Only if CUDA is already in use: querying it would otherwise create a context.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore(state: dict[str, Any]) -> None:
    random.setstate((state["python_version"], tuple(int(v) for v in state["python_state"].tolist()), state["python_gauss"]))
    np.random.set_state((
        state["numpy_kind"],
        state["numpy_keys"].numpy().astype(np.uint32),
        state["numpy_pos"],
        state["numpy_has_gauss"],
        state["numpy_gauss"],
    ))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def reseed(step: int, rank: int) -> None:
    """Deterministic fresh seeds for a rank that has no saved state (world size grew)."""
    seeds = np.random.SeedSequence([step, rank, 0x6D67]).generate_state(2, dtype=np.uint32)
    seed = int(seeds[0]) << 32 | int(seeds[1])
    random.seed(seed)
    np.random.seed(int(seeds[0]))
    torch.manual_seed(seed)


def save(path: Path, state: dict[str, Any]) -> None:
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True, map_location="cpu")


def file_name(rank: int) -> str:
    return f"rng/rank-{rank}.pt"
