"""ZeRO-1 (``ZeroRedundancyOptimizer``) state in the same format as every other strategy.

``get_state_dict`` cannot see a ZeroRedundancyOptimizer's shards, so on save
the shards are consolidated on rank 0 (``consolidate_state_dict``, a
collective) and rewritten from parameter indices to parameter names, flattened
(``state.<name>.exp_avg``, ``param_groups.<name>.lr``): the format
``get_state_dict`` gives for DDP and FSDP (``state.OPTIONS``). A ZeRO-1 checkpoint then
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
    flat = {f"state.{names[i]}.{k}": v for i, entry in full["state"].items() for k, v in entry.items()}
    for group in full["param_groups"]:
        flat |= {f"param_groups.{names[i]}.{k}": v for i in group["params"] for k, v in group.items() if k != "params"}
    return flat


def load_state(path: Path, module: nn.Module, optimizer: Any, no_dist: bool) -> None:
    """Read the optimizer entries of a checkpoint on every rank and load this rank's partition."""
    loaded: dict[str, Any] = {}
    with storage.single_process_ok():
        compat.dcp_load_in_place(loaded, storage_reader=storage.SafeReader(path),
                                 planner=storage.SafeEmptyLoadPlanner(keys={"optim"}), no_dist=no_dist)
    saved = loaded["optim"]
    names = _names(module, optimizer)
    index = {n: i for i, n in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    for key, value in saved.items():
        if key.startswith("state."):  # state.<parameter name>.<exp_avg, ...>: the names hold dots, the keys none
            name, _, field = key[len("state."):].rpartition(".")
            state.setdefault(index[name], {})[field] = value
    groups, start = [], 0
    for group in optimizer.param_groups:  # this optimizer's grouping, each group's hyperparameters as saved
        ids = list(range(start, start + len(group["params"])))
        start += len(ids)
        first = names[ids[0]] if ids else None
        saved_group = {field: v for k, v in saved.items() if k.startswith("param_groups.")
                       for name, _, field in [k[len("param_groups."):].rpartition(".")] if name == first}
        groups.append({**{k: v for k, v in group.items() if k != "params"}, **saved_group, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
