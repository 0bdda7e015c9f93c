"""ZeRO-1 (``ZeroRedundancyOptimizer``) state in the same format as every other strategy.

``get_state_dict`` cannot see a ZeroRedundancyOptimizer's shards, so on save
the shards are consolidated on rank 0 (``consolidate_state_dict``, a
collective) and rewritten from parameter indices to parameter names: the
format ``get_state_dict`` gives for DDP and FSDP. A ZeRO-1 checkpoint then
resumes under any strategy and world size, and vice versa. On load every
rank reads the full optimizer state (what ``ZeroRedundancyOptimizer.load_state_dict``
expects) and keeps its own partition.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..runtime import compat
from . import storage


def _names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter index (torch's optimizer state_dict numbering) -> parameter name."""
    fqn = {id(p): n for n, p in module.named_parameters()}
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in fqn:
                from ..errors import UsageError

                raise UsageError("the ZeroRedundancyOptimizer holds a parameter that is not in the Checkpointer's "
                                 "model; build the optimizer from model.parameters()")
            names.append(fqn[id(p)])
    return names


def gather_state(module: nn.Module, optimizer: Any, rank: int) -> dict[str, Any] | None:
    """The whole optimizer state keyed by parameter names, on rank 0 (None elsewhere). Collective."""
    optimizer.consolidate_state_dict(to=0)
    if rank != 0:
        return None
    full = optimizer.state_dict()
    names = _names(module, optimizer)
    return {
        "state": {names[i]: dict(v) for i, v in full["state"].items()},
        "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in full["param_groups"]],
    }


def load_state(path: Path, module: nn.Module, optimizer: Any, no_dist: bool) -> None:
    """Read the optimizer entries of a checkpoint on every rank and load this rank's partition."""
    loaded: dict[str, Any] = {}
    with storage.single_process_ok():
        compat.dcp_load_in_place(loaded, storage_reader=storage.SafeReader(path),
                                 planner=storage.SafeEmptyLoadPlanner(keys={"optim"}), no_dist=no_dist)
    saved = loaded["optim"]
    index = {n: i for i, n in enumerate(_names(module, optimizer))}
    groups = saved["param_groups"]
    if isinstance(groups, dict):  # DCP rebuilds a list it flattened as a dict keyed 0, 1, ...
        groups = [groups[k] for k in sorted(groups, key=int)]
    optimizer.load_state_dict({
        "state": {index[n]: v for n, v in saved.get("state", {}).items()},
        "param_groups": [dict(g, params=[index[n] for n in g["params"]]) for g in groups],
    })
