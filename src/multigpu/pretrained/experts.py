"""A checkpoint's names and per-expert weights <-> the model's, by transformers 5's own conversion mapping.

transformers 5 holds a mixture of experts' weights fused (one 3-D tensor per projection, experts first:
``mlp.experts.gate_up_proj`` (E, 2F, D)), yet its ``save_pretrained`` writes them one tensor per expert, in the
naming of the family's published checkpoints (Mixtral: ``block_sparse_moe.experts.3.w1.weight``), and its
``from_pretrained`` converts them back (``transformers.conversion_mapping``: renamings, and
``WeightConverter``s of ``MergeModulelist`` and ``Concatenate``). That mapping is used here as it is:

- in: each model tensor is read from the checkpoint name transformers renames to it; a fused one from the
  per-expert keys its converter collects, in transformers' order (``dot_natural_key``), stacked by the
  converter's own operations run on this rank's experts only (FSDP and EP split the experts' first dim, so a
  rank's shard is whole experts);
- out: the reversed converter (what ``save_pretrained`` runs) is run on one held expert at a time, so each
  rank writes the per-expert tensors of the experts it holds, under the names transformers writes.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import UsageError


def _transforms(model: nn.Module, reverse: bool) -> tuple[list, list]:
    """(renamings, converters): what transformers' ``from_pretrained`` applies to ``model``'s checkpoint keys, or
    (``reverse``) what its ``save_pretrained`` applies to the model's names (``revert_weight_conversion``'s rule)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming

    model = _as_built(model)
    if reverse:
        forward = [t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)]
        transforms = [t.reverse_transform() for t in forward[::-1]]
    else:
        transforms = get_model_conversion_mapping(model)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


def _as_built(model: nn.Module) -> nn.Module:
    """``model``, or where FSDP wrapped it, a meta twin of its class from its config: transformers finds a
    family's conversions by its modules' class names first (GPT-NeoX's head is saved as ``embed_out`` by
    its class's mapping), and FSDP2 renames each class it wraps (``FSDPGPTNeoXForCausalLM``)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return model
    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        return cls(model.config)


def _unsplittable(converter: Any) -> str | None:
    """The operation of ``converter`` that does not keep each expert apart (None: it stacks experts on dim 0 and
    concatenates their projections on another dim, which a rank can run on its experts alone)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    for op in converter.operations:
        if not ((isinstance(op, MergeModulelist) and op.dim == 0) or (isinstance(op, Concatenate) and op.dim != 0)):
            return repr(op)
    return None


def _converted(converter: Any, name: str, pieces: dict[str, list], model: nn.Module) -> dict[str, torch.Tensor]:
    """transformers' own ``WeightConverter.convert`` of ``pieces`` (source pattern -> tensors, or callables that
    read them) into the tensors it names, ``name`` the first of them."""
    conv = copy.deepcopy(converter)
    for pattern, tensors in pieces.items():
        for t in tensors:
            conv.add_tensor(name, name, pattern, t)
    return conv.convert(name, model=model, config=model.config)


def held_experts(t: torch.Tensor, name: str) -> tuple[torch.Tensor, int, int]:
    """(this rank's local tensor, its first expert, how many) of a fused expert tensor ``t`` (a DTensor: the box
    DCP sees, ``__create_chunk_list__``); one line when the box cuts experts apart."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t, 0, t.shape[0]
    local = t.to_local()
    if local.numel() == 0:
        return local, 0, 0
    chunks = t.__create_chunk_list__()
    offsets, sizes = chunks[0].offsets, chunks[0].sizes
    if len(chunks) != 1 or any(offsets[1:]) or list(sizes[1:]) != list(t.shape[1:]):
        raise UsageError(f"{name} is split inside its experts on this layout ({t.placements}); per-expert checkpoint "
                         "weights are read and written by whole experts: keep the experts whole (tp does not split "
                         "them; ep and dp_shard split them by expert)")
    return local, offsets[0], sizes[0]


@dataclass
class Stacked:
    """A fused model tensor and the checkpoint keys transformers' converter stacks into it."""

    converter: Any                                            # transformers' WeightConverter (copied per use)
    keys: dict[str, list[str]] = field(default_factory=dict)  # source pattern -> per-expert keys, in expert order


class Names:
    """How ``model``'s tensors are read from a checkpoint with ``tensors`` (name -> (shape, file), from the
    files' headers), by transformers' conversion: ``tensors`` here is by the model's names (a fused tensor's
    shape what its converter makes of the per-expert shapes), ``read_as`` each one's checkpoint name (a tied
    copy's: the tensor it copies), ``stacked`` the fused ones. Any module holding some of ``model``'s tensors
    under its names (a pipeline stage) is read by it."""

    def __init__(self, model: nn.Module, tensors: dict[str, tuple[tuple[int, ...], str]], where: Path) -> None:
        from transformers.core_model_loading import dot_natural_key, rename_source_key

        renamings, converters = _transforms(model, reverse=False)
        own = dict.fromkeys(model.state_dict())
        self.files = tensors
        self.tensors: dict[str, tuple[tuple[int, ...], str | None]] = {}
        self.read_as: dict[str, str] = {}
        self.stacked: dict[str, Stacked] = {}
        for key in sorted(tensors, key=dot_natural_key):  # transformers' order: experts by number
            name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, own)
            if name not in own and key in own:  # transformers' rule: a key the model has is not renamed
                name, pattern = key, None
            if pattern is None or name not in own:
                self.tensors[name], self.read_as[name] = tensors[key], key
                continue
            converter = next(c for c in converters if pattern in c.source_patterns)
            if (op := _unsplittable(converter)) is not None:
                raise UsageError(f"{where}: transformers converts {key} into {name} by {op}, which from_pretrained "
                                 "cannot read by rank yet; load it with transformers' from_pretrained and spread it")
            stacked = self.stacked.setdefault(name, Stacked(converter, {p: [] for p in converter.source_patterns}))
            stacked.keys[pattern].append(key)
        from ..parallel.hf.tied import tied_groups

        for group in tied_groups(model):  # a pipeline stage may hold a tied copy alone: read as what it copies
            for name in group[1:]:
                if group[0] in self.read_as:
                    self.read_as.setdefault(name, self.read_as[group[0]])
        for name, stacked in self.stacked.items():  # the fused shape, by the converter itself on meta tensors
            meta = {p: [torch.empty(tensors[k][0], device="meta") for k in keys] for p, keys in stacked.keys.items()}
            try:
                shape = tuple(_converted(stacked.converter, name, meta, model)[name].shape)
            except RuntimeError as e:
                raise UsageError(f"{where}: the per-expert tensors of {name} do not stack "
                                 f"({' '.join(str(e).split())[:120]}); the checkpoint is not of this model") from None
            self.tensors[name] = (shape, None)

    def fill_stacked(self, model: nn.Module, root: Path) -> None:
        """Read this rank's experts of every fused tensor from their per-expert keys and stack them into its shard
        (no other expert is read)."""
        from safetensors import safe_open

        state = model.state_dict()
        with contextlib.ExitStack() as stack:
            opened: dict[str, Any] = {}

            def reader(key: str) -> Any:
                file = self.files[key][1]
                if file not in opened:
                    opened[file] = stack.enter_context(safe_open(str(root / file), framework="pt"))
                return lambda: opened[file].get_tensor(key)

            for name, stacked in self.stacked.items():
                if name not in state:  # another pipeline stage's
                    continue
                local, first, count = held_experts(state[name], name)
                if count == 0:
                    continue
                pieces = {p: [reader(k) for k in keys[first:first + count]] for p, keys in stacked.keys.items()}
                value = _converted(stacked.converter, name, pieces, model)[name]
                with torch.no_grad():
                    local.copy_(value)


def per_expert_state(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor],
                                                                                 dict[str, int]]:
    """``state`` (the model's names; DTensors or not) under the names transformers' ``save_pretrained`` writes,
    each fused expert tensor as one tensor per expert by the reversed converter: (what this rank writes, every
    written tensor's bytes in order, those of other ranks' experts included, for the file split)."""
    from transformers.core_model_loading import apply_converters, apply_renamings

    renamings, converters = _transforms(model, reverse=True)
    out: dict[str, torch.Tensor] = {}
    sizes: dict[str, int] = {}
    for key, t in state.items():
        _, pattern = apply_converters(key, converters)
        if pattern is None:
            name = apply_renamings(key, renamings)
            out[name], sizes[name] = t, t.numel() * t.element_size()
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        local, first, count = held_experts(t, key)
        for e in range(t.shape[0]):
            held = first <= e < first + count
            piece = local[e - first:e - first + 1] if held else torch.empty((1, *t.shape[1:]), dtype=t.dtype,
                                                                            device="meta")
            # the converter with expert e's number in its names: transformers' split names its one piece so
            one = converter.copy(converter._original_source_patterns,
                                 [p.replace("*", str(e)) for p in converter._original_target_patterns],
                                 operations=converter.operations)
            first_name, matched = one.rename_source_key(key)
            one.add_tensor(first_name, key, matched, piece)
            for name, value in one.convert(first_name, model=model, config=model.config).items():
                value = value[0] if isinstance(value, list) else value
                name = apply_renamings(name, renamings)
                sizes[name] = value.numel() * value.element_size()
                if held:
                    out[name] = value
    return out, sizes
