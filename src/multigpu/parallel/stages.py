"""Pipelines without a hand split: ``mg.parallel.pipeline(model, layout, loss_fn, plan)`` cuts a model into
balanced stages and returns the ``Pipeline`` that runs this rank's.

What is cut: a transformers CausalLM by the split it declares (``_pp_plan``: embed_tokens / layers / norm,
then lm_head outside the base model), or an ``nn.Sequential`` by its children. Balanced as torchtitan
does: the embeddings and the head count as one block each, so the first and last stages take a block
less when that evens them out. A stage is a copy of the full model with what it does not run removed,
so parameter names stay as one process has them (``model.layers.3.mlp.up_proj.weight``): DCP reshards
between layouts, and ``mg.full_state_dict(pipe)`` gathers the full weights from the stages.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Iterator

from torch import nn

from ..errors import UsageError
from .layout import Layout


def balance(n_blocks: int, n_stages: int) -> list[range]:
    """Contiguous blocks per stage: ``n_blocks + 2`` units (embeddings, blocks, head) spread evenly; every
    stage gets at least one block."""
    units = n_blocks + 2
    bounds = [round(i * units / n_stages) for i in range(n_stages + 1)]
    out = [range(max(bounds[s] - 1, 0), n_blocks if s == n_stages - 1 else min(bounds[s + 1] - 1, n_blocks))
           for s in range(n_stages)]
    if any(len(r) == 0 for r in out):  # an embeddings- or head-only stage: give each stage a block
        out = even(n_blocks, n_stages)
    return out


def even(n: int, k: int) -> list[range]:
    """``n`` items in ``k`` contiguous parts whose sizes differ by at most one (the larger first)."""
    per, extra = divmod(n, k)
    starts = [s * per + min(s, extra) for s in range(k + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(k)]


class StageBlocks(nn.Module):
    """The blocks one stage holds, under their original indices (``layers.3`` stays ``layers.3``), iterated
    and sliced like the ``nn.ModuleList`` they came from (a slice by original index)."""

    def __init__(self, blocks: dict[int, nn.Module], total: int) -> None:
        super().__init__()
        self.total = total
        for i, block in sorted(blocks.items()):
            self.add_module(str(i), block)

    # Through nn.Module's public children API (not its private _modules dict, as nn.ModuleList does).
    def __iter__(self) -> Iterator[nn.Module]:
        return self.children()

    def __len__(self) -> int:
        return sum(1 for _ in self.children())

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            keep = set(range(self.total)[key])
            return [m for i, m in self.named_children() if int(i) in keep]
        return self.get_submodule(str(key))


def _hf_split(model: nn.Module) -> tuple[str, str, list[str], list[str], list[str]] | None:
    """From a declared ``_pp_plan``: (the base model's name, its blocks' name, the base's modules before and
    after the blocks, the modules after the base)."""
    plan = getattr(model, "pp_plan", None) or getattr(model, "_pp_plan", None)
    if not isinstance(plan, dict) or not plan:
        return None
    names = list(plan)
    blocks = next((n for n in names if isinstance(model.get_submodule(n), nn.ModuleList)), None)
    if blocks is None:
        return None
    base = blocks.rpartition(".")[0]
    inside = [n for n in names if n.rpartition(".")[0] == base]
    before, inner_after = inside[:inside.index(blocks)], inside[inside.index(blocks) + 1:]
    # The plan's order is not the forward's (transformers lists lm_head first): what lies outside the base
    # model runs after it (a CausalLM's head).
    after = [n for n in names if base and not n.startswith(base + ".")]
    return base, blocks, before, inner_after, after


def _causal_lm_forward(part: nn.Module, base: str, after: list[str], first: bool, last: bool, x):
    """A stage of a transformers CausalLM: token ids (first stage) or hidden states in, through the base
    model's blocks this stage holds (its own rotary embeddings and causal mask), the head on the last."""
    inner = part.get_submodule(base) if base else part
    kwargs = {"input_ids": x} if first else {"inputs_embeds": x}
    h = inner(**kwargs, use_cache=False).last_hidden_state
    if last:
        for name in after:
            h = part.get_submodule(name)(h)
    return h


def _set(model: nn.Module, name: str, value: nn.Module) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attr, value)


def _tied(model: nn.Module) -> list[str]:
    seen: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            return [seen[id(p)], name]
        seen[id(p)] = name
    return []


def split(model: nn.Module, layout: Layout, n_stages: int) -> tuple[Callable[[int], nn.Module], int, str]:
    """(stage i's module, the number of blocks, how the model was cut) for ``n_stages`` stages."""
    name = type(model).__name__
    tied = _tied(model)
    if tied:
        raise UsageError(f"{name} ties {tied[0]} to {tied[1]}, but a pipeline puts the embeddings and the head on "
                         "different stages; untie them (transformers: config.tie_word_embeddings=False) for pp > 1")
    hf = _hf_split(model)
    if hf is not None:
        base, blocks_name, before, inner_after, after = hf
        blocks = model.get_submodule(blocks_name)
        layout.check_sizes(blocks=len(blocks), model=name)
        ranges = balance(len(blocks), n_stages)

        def hf_stage(i: int) -> nn.Module:
            part = copy.deepcopy(model)
            held = part.get_submodule(blocks_name)
            _set(part, blocks_name, StageBlocks({j: held[j] for j in ranges[i]}, len(held)))
            first, last = i == 0, i == n_stages - 1
            if not first:
                for n in before:  # hidden states come in: the base model embeds only token ids
                    _set(part, n, None)
            if not last:
                for n in inner_after:  # the base model calls its final norm always: a no-op before the last stage
                    _set(part, n, nn.Identity())
                for n in after:
                    _set(part, n, None)
            part.forward = functools.partial(_causal_lm_forward, part, base, after, first, last)
            return part

        return hf_stage, len(blocks), f"declared _pp_plan ({blocks_name}: {len(blocks)} blocks)"
    if isinstance(model, nn.Sequential):
        layout.check_sizes(blocks=len(model), model=name)
        parts = even(len(model), n_stages)

        def seq_stage(i: int) -> nn.Module:
            part = nn.Sequential()
            for j in parts[i]:
                part.add_module(str(j), copy.deepcopy(model[j]))
            return part

        return seq_stage, len(model), f"nn.Sequential ({len(model)} children)"
    from .auto import blocks_of

    classes, _ = blocks_of(model)
    what = (f"its repeated blocks ({', '.join(c.__name__ for c in classes)}) but no declared split" if classes
            else "no repeated blocks")
    raise UsageError(f"a pipeline cuts a model into stages of blocks, but {name} has {what}; give an nn.Sequential "
                     "of its layers, a transformers CausalLM (it declares _pp_plan), or build the stages yourself "
                     "and pass them to mg.parallel.Pipeline; or use pp=1")


def pipeline(model: nn.Module, layout: Layout, loss_fn: Callable, plan: Any, *, verbose: bool = True):
    """This rank's stages of ``model`` cut by ``layout.pp`` (and its schedule), each FSDP-sharded over the
    data-parallel ranks when there are several, in a ``Pipeline`` of ``plan.accum_steps`` micro-batches.

    >>> pipe = mg.parallel.pipeline(model, layout, loss_fn, plan)
    >>> loss = pipe.step(micro_batches); pipe.clip_grad_norm_(1.0); opt.step()
    """
    import torch.distributed as tdist

    from ..dist import print0
    from . import pp
    from .spread import parallelize

    world = tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1
    shape = layout.shape(world)
    name = type(model).__name__
    if shape.pp == 1:
        raise UsageError(f"mg.parallel.pipeline cuts {name} into pp stages but the layout has pp=1; "
                         "use mg.parallelize(model, layout), or Layout(pp=2)")
    if shape.tp > 1:
        raise UsageError("mg.parallel.pipeline does not apply tensor parallelism inside stages yet; use tp=1 with "
                         "pp, or build the stages yourself (parallelize each) and pass them to mg.parallel.Pipeline")
    accum_steps = plan.accum_steps
    # The model's own problems first (they need another model, not another flag), then the schedule's.
    make, n_blocks, how = split(model, layout, shape.pp * pp.stages_per_rank(layout.schedule))
    n_stages = pp.check(layout.schedule, shape.pp, accum_steps)
    params = list(model.parameters())
    device = params[0].device
    mesh = layout.mesh(world, device.type)
    ids = pp.stage_ids(layout.schedule, mesh.pp_rank, shape.pp)
    parts = [make(i) for i in ids]
    if mesh.dp_mesh is not None:
        from .auto import blocks_of

        classes, _ = blocks_of(model)
        # mg.parallelize's FSDP, the one way in; as a pipeline stage it keeps the parameters gathered between
        # a step's micro-batches. This function prints its own line for all the stages.
        parts = [parallelize(p, mesh, block_classes=classes or None, pipeline_stage=True, verbose=False)
                 for p in parts]
    if verbose:
        print0(f"mg.parallel.pipeline: {n_stages} stages of {name} by {how}, blocks per stage "
               f"{[len(r) for r in balance(n_blocks, n_stages)] if how.startswith('declared') else 'even'}, "
               f"schedule {layout.schedule}, {accum_steps} micro-batches"
               + (f", each stage FSDP over {shape.dp} ranks" if mesh.dp_mesh is not None else ""))
    return pp.Pipeline(parts, ids, n_stages, mesh.pp_mesh.get_group(), device, layout.schedule, accum_steps, loss_fn)


def gathered_state_dict(pipe: Any) -> dict:
    """The full weights of every stage, under one process's names, on every rank (a collective)."""
    import torch.distributed as tdist
    from torch.distributed.tensor import DTensor

    mine = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            for part in pipe.modules for k, v in part.state_dict().items()}
    gathered: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(gathered, mine)
    return {k: v for d in gathered for k, v in d.items()}
