"""The DCP part of a checkpoint, built from the training objects: one builder for save and load.

Model and optimizer go through ``get_state_dict`` (keys are parameter names
without wrapper prefixes); scheduler, loss scaler and stateful extras give
their own ``state_dict()``. A ZeroRedundancyOptimizer's state is gathered on
rank 0 (collective) for a save and left out of the template for a load (see
zero_state.py). A DTensor DCP cannot write as one chunk per rank (a fused projection's
``_StridedShard``) is saved replicated over those mesh dims and put back after a load.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from ..parallel.zero import is_zero_optimizer
from ..runtime import compat
from .zero_state import gather_state


# The optimizer's state flattened to one entry per parameter name (state.<name>.exp_avg, param_groups.<name>.lr):
# the ranks of a pipeline hold different parameters, and the nested form's param_groups (one list per rank,
# the same DCP key on every rank) kept one rank's list, so another stage's resume failed (KeyError 'betas').
OPTIONS = StateDictOptions(strict=True, flatten_optimizer_state_dict=True)


def without_optimizer_state(optim: dict[str, Any]) -> dict[str, Any]:
    """The flattened optimizer state dict with its per-parameter state removed (its param_groups kept)."""
    return {k: v for k, v in optim.items() if not k.startswith("state.")}


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


@dataclass
class TrainingObjects:
    """What a ``Checkpointer`` was given; all but the loader (its position is in the manifest) go through DCP.

    ``extra`` is the Checkpointer's own dict: a resume writes plain extras back into it.
    """

    model: nn.Module | None
    optimizer: Any
    scheduler: Any
    scaler: Any
    loader: Any
    extra: dict[str, Any]

    def module(self) -> nn.Module:
        """The model without DDP/DP wrappers."""
        from ..parallel import unwrap

        return unwrap(self.model)

    def keys(self) -> list[str]:
        """The top-level DCP entries these objects save: model, optim, scheduler, scaler, extra."""
        keys = [k for k, v in (("model", self.model), ("optim", self.optimizer), ("scheduler", self.scheduler),
                               ("scaler", self.scaler)) if v is not None]
        if any(is_stateful(v) for v in self.extra.values()):
            keys.append("extra")
        return keys

    def state_dict(self, rank: int = 0, for_load: bool = False) -> dict[str, Any]:
        """The DCP state dict (collective under ZeRO-1 for a save); ``for_load``: the template DCP loads into."""
        state: dict[str, Any] = {}
        if self.model is not None:
            zero = is_zero_optimizer(self.optimizer)
            opts = [self.optimizer] if self.optimizer is not None and not zero else []
            msd, osd = get_state_dict(self.module(), opts, options=OPTIONS)
            state["model"] = msd
            if zero and not for_load:
                full = gather_state(self.module(), self.optimizer, rank)
                if full is not None:
                    state["optim"] = full
            elif opts:
                state["optim"] = osd
        # A load writes the saved values into the template: into copies, never into what an object handed
        # out (a loader's state_dict() held its own source fingerprint, so it then compared the saved one
        # with itself and accepted other data).
        own = _template if for_load else (lambda tree: tree)
        if self.scheduler is not None:
            state["scheduler"] = own(self.scheduler.state_dict())
        if self.scaler is not None:
            state["scaler"] = own(self.scaler.state_dict())
        for name, obj in self.extra.items():
            if is_stateful(obj):
                state.setdefault("extra", {})[name] = own(obj.state_dict())
        for part in ("model", "optim"):
            if part in state:
                state[part] = _chunkable(state[part])
        return state

    def respread(self, state: dict[str, Any]) -> None:
        """After a load into ``state_dict(for_load=True)``: the model's and optimizer's DTensors back in the
        placements of the parameters they belong to (undoes ``_chunkable``; a local chunk, no communication)."""
        from torch.distributed.tensor import DTensor

        if self.model is None:
            return
        params = dict(self.module().named_parameters())

        def back(key: str, value: Any) -> Any:
            p = params.get(key)
            if (isinstance(value, DTensor) and isinstance(p, DTensor) and value.shape == p.shape
                    and value.placements != p.placements):
                return value.redistribute(p.device_mesh, p.placements)
            return value

        if "model" in state:
            state["model"] = {k: back(k, v) for k, v in state["model"].items()}
        if isinstance(state.get("optim"), dict):  # flattened (OPTIONS): state.<parameter name>.<exp_avg, ...>
            state["optim"] = {k: back(k[len("state."):].rpartition(".")[0], v) if k.startswith("state.") else v
                              for k, v in state["optim"].items()}


def _template(tree: Any) -> Any:
    """A load template of ``tree`` that shares nothing mutable with it: new dicts and lists, a new tensor of
    each tensor's shape and placement (DCP fills it), the immutable leaves as they are."""
    if isinstance(tree, dict):
        return {k: _template(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_template(v) for v in tree]
    if isinstance(tree, tuple):
        return type(tree)(*map(_template, tree)) if hasattr(tree, "_fields") else tuple(map(_template, tree))
    if isinstance(tree, torch.Tensor):
        return torch.empty_like(tree)
    return copy.deepcopy(tree)


def _dcp_cannot_chunk(placements: tuple[Any, ...]) -> bool:
    """A ``_StridedShard`` that no later mesh dimension shards again: a tensor of equal parts, each part
    sharded (GPT-2's fused q/k/v, multigpu.parallel.hf.conv1d), whose local data is several pieces of the
    global tensor. DCP writes one chunk (offset, size) per rank and describes it as one block: on 2.13
    its save refuses the overlapping chunks ("Failed to validate global plan"). FSDP's own
    ``_StridedShard`` (FSDP x TP on one dim) is followed by TP's Shard of that dim and is one block."""
    for i, p in enumerate(placements):
        if compat.is_strided_shard(p) and not any(
                getattr(q, "dim", None) == p.dim and not q.is_replicate() and not q.is_partial()
                for q in placements[i + 1:]):
            return True
    return False


def _chunkable(tree: Any) -> Any:
    """``tree`` with each DTensor that DCP cannot chunk replaced by one replicated over the mesh dims it
    could not (an all-gather over TP for a save, a full-size template for a load): DCP then stores the
    tensor as one process has it. The load puts them back (``TrainingObjects.respread``)."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(tree, dict):
        return {k: _chunkable(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_chunkable(v) for v in tree]
    if isinstance(tree, DTensor) and _dcp_cannot_chunk(tree.placements):
        placements = [Replicate() if compat.is_strided_shard(p) else p for p in tree.placements]
        return tree.redistribute(tree.device_mesh, placements)
    return tree
