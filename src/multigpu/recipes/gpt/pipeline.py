"""The GPT recipe as pipeline stages: contiguous blocks per stage, the embeddings on the first, the head on the last.

Balanced by layers, counting the embeddings and the head as one layer each
(torchtitan's ``input_weight``/``output_weight``), so the first and last
stages take one block less when that evens them out. A stage is the full
model with what it does not own deleted: parameter names (``blocks.5.mlp.up.weight``)
stay as one process has them, which DCP needs to reshard a checkpoint between
pipeline and other layouts.
"""

from __future__ import annotations

import copy

from torch import nn

from ...errors import UsageError
from ...parallel.stages import balance
from .model import GPTConfig


def stage_blocks(cfg: GPTConfig, n_stages: int, splits: list[int] | None = None) -> list[range]:
    """Which blocks each stage runs: ``n_layer + 2`` units (embeddings, blocks, head) spread as evenly as possible,
    or, with ``splits``, the first block of every stage after the first (``[2]``: blocks 0-1, then 2 on)."""
    if n_stages > cfg.n_layer:
        raise UsageError(f"{n_stages} pipeline stages but the model has {cfg.n_layer} blocks; use at most "
                         f"{cfg.n_layer} stages (pp x stages per rank) or a deeper model")
    if splits is not None:
        splits = list(splits)
        if len(splits) != n_stages - 1 or splits != sorted(set(splits)) or not all(0 < b < cfg.n_layer for b in splits):
            raise UsageError(f"pipeline split points must be {n_stages - 1} increasing block indices between 1 and "
                             f"{cfg.n_layer - 1} (where stages 2..{n_stages} begin), got {splits}; e.g. "
                             f"{[round(i * cfg.n_layer / n_stages) for i in range(1, n_stages)]}")
        bounds = [0, *splits, cfg.n_layer]
        return [range(bounds[s], bounds[s + 1]) for s in range(n_stages)]
    return balance(cfg.n_layer, n_stages)


def stage_module(model: nn.Module, stage: int, n_stages: int, splits: list[int] | None = None) -> nn.Module:
    """A copy of ``model`` with only what stage ``stage`` of ``n_stages`` runs (``splits``: see ``stage_blocks``)."""
    cfg = model.cfg
    if cfg.tie_embeddings and n_stages > 1:
        raise UsageError("the token table is tied to the head, but a pipeline puts them on different stages; "
                         "build the model with tie_embeddings=False for pipeline parallelism (the recipe: --untied)")
    mine = stage_blocks(cfg, n_stages, splits)[stage]
    part = copy.deepcopy(model)
    for name in list(part.blocks):
        if int(name) not in mine:
            del part.blocks[name]
    if stage != 0:
        part.embed = None
    if stage != n_stages - 1:
        part.ln_f, part.head = None, None
    return part


def build(model: nn.Module, mesh, device, schedule: str, accum_steps: int, parallelize_stage,
          splits: list[int] | None = None):
    """This rank's stages of ``model`` over ``mesh.pp_mesh``, each parallelized like a whole model, in a
    ``Pipeline`` whose loss is the mean token cross-entropy of a micro-batch."""
    import torch.nn.functional as F

    from ...parallel import Pipeline, pp

    n_stages = pp.check(schedule, mesh.shape.pp, accum_steps)
    ids = pp.stage_ids(schedule, mesh.pp_rank, mesh.shape.pp)
    stage_blocks(model.cfg, n_stages, splits)  # refused here, before any stage is built
    parts = [parallelize_stage(stage_module(model, i, n_stages, splits)) for i in ids]

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    return Pipeline(parts, ids, n_stages, mesh.pp_mesh.get_group(), device, schedule, accum_steps, loss_fn)
