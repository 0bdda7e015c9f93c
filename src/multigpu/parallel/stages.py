"""Pipelines without a hand split: ``mg.parallel.pipeline(model, layout, loss_fn, plan)`` cuts a model into
balanced stages and returns the ``Pipeline`` that runs this rank's.

What is cut: a transformers CausalLM (``hf/split.py``: the split it declares or one found in it), a model
whose blocks sit in a ModuleDict of the root as torchtitan cuts its models (the GPT recipe), or an
``nn.Sequential`` by its children. Tied parameters (GPT-2's head and token table) get a copy on each
stage that uses them, kept equal by summing their gradients (``hf/tied.py``). Balanced as torchtitan
does: the embeddings and the head count as one block each, so the first and last stages take a block
less when that evens them out. A stage is a copy of the full model with what it does not run removed,
so parameter names stay as one process has them (``model.layers.3.mlp.up_proj.weight``): DCP reshards
between layouts, and ``mg.full_state_dict(pipe)`` gathers the full weights from the stages.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch
from torch import nn

from ..errors import UsageError
from .auto import block_stack, blocks_of, has_params
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


def stage_ranges(n_blocks: int, n_stages: int, splits: list[int] | None = None) -> list[range]:
    """Which blocks each stage runs: ``balance``d, or with ``splits`` the first block of every stage after
    the first (``[2]``: blocks 0-1, then 2 on), checked."""
    if splits is None:
        return balance(n_blocks, n_stages)
    splits = list(splits)
    if len(splits) != n_stages - 1 or splits != sorted(set(splits)) or not all(0 < b < n_blocks for b in splits):
        raise UsageError(f"pipeline split points must be {n_stages - 1} increasing block indices between 1 and "
                         f"{n_blocks - 1} (where stages 2..{n_stages} begin), got {splits}; e.g. "
                         f"{[round(i * n_blocks / n_stages) for i in range(1, n_stages)]}")
    bounds = [0, *splits, n_blocks]
    return [range(bounds[s], bounds[s + 1]) for s in range(n_stages)]


def even(n: int, k: int) -> list[range]:
    """``n`` items in ``k`` contiguous parts whose sizes differ by at most one (the larger first)."""
    per, extra = divmod(n, k)
    starts = [s * per + min(s, extra) for s in range(k + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(k)]


def _block_dict(model: nn.Module) -> str | None:
    """The name of the root's ``nn.ModuleDict`` of blocks (torchtitan's models and the GPT recipe keep them
    so: a stage deletes the others' entries and the names stay), or None."""
    stack = block_stack(model)
    return stack[0] if stack and "." not in stack[0] and isinstance(stack[1], nn.ModuleDict) else None


def _dict_split(model: nn.Module, layout: Layout, n_stages: int, splits: list[int] | None, blocks_name: str):
    """Cut as torchtitan cuts its models: each stage a copy of the model with the other stages' blocks deleted
    from the ModuleDict and the modules before (after) it set to None on every stage but the first (last);
    the model's forward skips what is None."""
    children = [n for n, _ in model.named_children()]
    at = children.index(blocks_name)
    before = [n for n in children[:at] if has_params(model.get_submodule(n))]
    after = [n for n in children[at + 1:] if has_params(model.get_submodule(n))]
    keys = list(model.get_submodule(blocks_name).keys())
    layout.check_sizes(blocks=len(keys), model=type(model).__name__)
    ranges = stage_ranges(len(keys), n_stages, splits)

    def dict_stage(i: int, share: bool = False) -> nn.Module:
        part = copy.deepcopy(model, {id(t): t for t in (*model.parameters(), *model.buffers())} if share else None)
        held = part.get_submodule(blocks_name)
        for j, key in enumerate(keys):
            if j not in ranges[i]:
                del held[key]
        for n in (before if i != 0 else []) + (after if i != n_stages - 1 else []):
            setattr(part, n, None)
        return part

    return dict_stage, ranges, f"its {blocks_name} ModuleDict ({len(keys)} blocks; the others' deleted, " \
                               f"{', '.join(before + after) or 'nothing'} on the first/last stage only)"


def split(model: nn.Module, layout: Layout, n_stages: int, splits: list[int] | None = None
          ) -> tuple[Callable[[int], nn.Module], list[range] | None, str]:
    """(stage i's module, the blocks of each stage, how the model was cut) for ``n_stages`` stages;
    ``splits``: the first block of every stage after the first (default: balanced).

    Tied parameters (GPT-2's head and token table) stay tied within a stage; a stage that uses one of
    the names holds a copy of its own (each stage is a copy of the model), kept equal to the others by
    the ``Pipeline`` (``tied.TiedGrads``)."""
    name = type(model).__name__
    from .hf.split import causal_lm_split, causal_lm_stage

    found = causal_lm_split(model)
    if found is not None:
        blocks_name = found[1]
        n_blocks = len(model.get_submodule(blocks_name))
        layout.check_sizes(blocks=n_blocks, model=name)
        ranges = stage_ranges(n_blocks, n_stages, splits)
        make = functools.partial(causal_lm_stage, model, found, ranges)
        probe(model, make, n_stages)
        return make, ranges, f"{found[5]} ({blocks_name}: {n_blocks} blocks)"
    if (blocks_name := _block_dict(model)) is not None:
        make, ranges, how = _dict_split(model, layout, n_stages, splits, blocks_name)
        probe(model, make, n_stages)
        return make, ranges, how
    if isinstance(model, nn.Sequential):
        if splits is not None:
            raise UsageError(f"splits= places stages by block index, but {name} is cut evenly by its children; "
                             "leave splits out")
        layout.check_sizes(blocks=len(model), model=name)
        parts = even(len(model), n_stages)

        def seq_stage(i: int) -> nn.Module:
            part = nn.Sequential()
            memo: dict[int, Any] = {}  # one memo: children that share a parameter still share it in the stage
            for j in parts[i]:
                part.add_module(str(j), copy.deepcopy(model[j], memo))
            return part

        return seq_stage, None, f"nn.Sequential ({len(model)} children)"
    classes, _ = blocks_of(model)
    what = (f"its repeated blocks ({', '.join(c.__name__ for c in classes)}) but no split (no _pp_plan, no base "
            "model of them taking inputs_embeds)" if classes else "no repeated blocks")
    raise UsageError(f"a pipeline cuts a model into stages of blocks, but {name} has {what}; give an nn.Sequential "
                     "of its layers, a transformers CausalLM (a _pp_plan, or base_model_prefix naming a base model "
                     "with a ModuleList of blocks), or build the stages yourself and pass them to "
                     "mg.parallel.Pipeline; or use pp=1")


def probe(model: nn.Module, make: Callable[..., nn.Module], n_stages: int) -> None:
    """The stages composed in this process on a probe batch must give the model's own output, or the split is
    refused in one line: what one stage's copy of the model leaves out (a block's attribute the model
    reads, a step after the head) or breaks (an in-place op on the stage's input) shows here, on every
    rank alike, rather than as a wrong number or a hang between stages. The stages share the model's
    tensors (no memory); a stage's input requires grad, as the schedule's does. A model on the meta device
    (``multigpu tune`` asking whether a script's model can be cut) has no values to compare: only its cut is
    checked."""
    from .probe import TOLERANCE, cause, probe_input, relative_error, run

    if any(p.is_meta for p in model.parameters()):
        return
    batch = probe_input(model, 1)
    if batch is None:
        return
    try:
        expected = run(model, batch, backward=False)
    except Exception:  # noqa: BLE001 - a model that needs more than its ids: nothing to check by
        return
    name = type(model).__name__
    try:
        with torch.random.fork_rng(devices=[]):
            x = batch["input_ids"]
            for i in range(n_stages):
                part = make(i, share=True)
                part.eval()
                x = part(x if i == 0 else x.detach().requires_grad_())
            got = x.detach()
    except Exception as e:  # noqa: BLE001 - the failure is the refusal's reason
        raise UsageError(f"{name} cut into {n_stages} pipeline stages fails on a probe batch ({cause(e)}); use pp=1 "
                         "for this model (DDP, FSDP and TP apply)") from None
    error = relative_error(got, expected)
    tol = TOLERANCE.get(expected.dtype, 1e-4)
    if not error <= tol:
        raise UsageError(f"{name} cut into {n_stages} pipeline stages gives another output than the model on a probe "
                         f"batch (relative error {error:.1e}, {expected.dtype} allows {tol:.0e}): its forward does "
                         "more than the stages run; use pp=1 for this model (DDP, FSDP and TP apply)")


def pipeline(model: nn.Module, layout: Layout, loss_fn: Callable, plan: Any, *, tp_plan: dict[str, Any] | None = None,
             splits: list[int] | None = None, verbose: bool = True, _empty: torch.device | None = None):
    """This rank's stages of ``model`` cut by ``layout.pp`` (and its schedule), each tensor parallel over
    ``layout.tp`` (``tp_plan`` or the model's plan, the entries for what the stage holds) and FSDP-sharded
    over the data-parallel ranks when there are several, in a ``Pipeline`` of ``plan.accum_steps``
    micro-batches. ``splits``: the first block of every stage after the first (default: balanced, the
    embeddings and the head counted as a block each).

    >>> pipe = mg.parallel.pipeline(model, layout, loss_fn, plan)
    >>> loss = pipe.step(micro_batches); pipe.clip_grad_norm_(1.0); opt.step()

    ``_empty`` (mg.from_pretrained's): ``model`` is on the meta device; each stage is spread as
    ``mg.parallelize(..., _empty=)`` spreads it, for its shards to be allocated on that device and loaded.
    """
    import weakref

    import torch.distributed as tdist

    from ..dist import print0
    from . import pp
    from .auto import block_modules, head_counts
    from ..spreads import record_share, remember, spread_of
    from .spread import parallelize, tensor_parallel_plan

    on = tdist.is_available() and tdist.is_initialized()
    rank, world = (tdist.get_rank(), tdist.get_world_size()) if on else (0, 1)
    layout = layout.resolve(world).built()
    name = type(model).__name__
    if layout.pp == 1:
        raise UsageError(f"mg.parallel.pipeline cuts {name} into pp stages but the layout has pp=1; "
                         "use mg.parallelize(model, layout), or Layout(pp=2)")
    accum_steps = plan.accum_steps
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        raise UsageError(f"{name} adds the router's load-balancing loss in its own forward (output_router_logits=True), "
                         "which a pipeline's stages do not run; set output_router_logits=False, or pp=1")
    from .probe import draws_note

    if world > 1 and (note := draws_note(model, world, "mg.parallel.pipeline")):  # the whole model, before the cut
        print0(note)
    # The model's own problems first (they need another model, not another flag), then the schedule's.
    make, ranges, how = split(model, layout, layout.stages, splits)
    n_stages = pp.check(layout.schedule, layout.pp, accum_steps, layout.stages_per_rank)
    classes, _ = blocks_of(model)
    styles: dict[str, Any] = {}
    if layout.tp > 1:
        # The plan of the whole model (given, declared, else found), refused here before any group work; each
        # stage then takes the entries for the modules it holds (stage_plan).
        heads = head_counts(model)
        layout.check_sizes(heads=heads.get("attention heads"), kv_heads=heads.get("KV heads"), model=name)
        styles, source, _ = tensor_parallel_plan(model, layout, block_modules(model, classes), tp_plan)
    device = torch.device(_empty) if _empty is not None else next(model.parameters()).device
    pp_mesh = layout.device_mesh(device.type)["pp"]
    ids = pp.stage_ids(layout.schedule, pp_mesh.get_local_rank(), layout.pp, layout.stages_per_rank)
    parts = [make(i) for i in ids]
    # mg.parallelize's TP, activation checkpointing, compile and FSDP, the one way in, on every stage (on pp
    # alone it applies the per-block options only); as a pipeline stage FSDP keeps the parameters gathered
    # between a step's micro-batches. This function prints its own line for all the stages.
    empty = {} if _empty is None else {"_empty": device}
    parts = [parallelize(p, layout, tp_plan=stage_plan(p, styles) if styles else None,
                         block_classes=classes or None, pipeline_stage=True, verbose=False, **empty) for p in parts]
    record_share(layout.data_share(rank), rank, world)  # the schedule places the last stage: who counts (eval)
    if verbose:
        print0(f"mg.parallel.pipeline: {n_stages} stages of {name} by {how}, blocks per stage "
               f"{'even' if ranges is None else [len(r) for r in ranges]}, "
               f"schedule {layout.schedule}, {accum_steps} micro-batches"
               + (f", each stage tensor parallel {layout.tp} (plan {source}, {len(styles)} modules)"
                  if layout.tp > 1 else "")
               + (f", each stage FSDP over {layout.dp_size} ranks" if layout.dp_size > 1 else "")
               + (f", its experts over ep {layout.ep}" if layout.ep > 1 else "")
               + (", activation checkpointing " + (f"on the first {layout.checkpoint_blocks} blocks of each stage"
                                                   if layout.checkpoint_blocks else "per block")
                  if layout.activation_checkpointing else ""))
    from .hf.tied import tied_groups

    tied = tied_groups(model)  # each stage holds its own copy: the Pipeline sums their gradients
    if verbose and tied:
        print0(f"mg.parallel.pipeline: tied {'; '.join(' = '.join(g) for g in tied)}: a copy on each stage that uses "
               "it, gradients summed over the copies after each step")
    pipe = pp.Pipeline(parts, ids, n_stages, pp_mesh.get_group(), device, layout.schedule, accum_steps, loss_fn,
                       tied=tied)
    # One record for the stages' union (each part has its own from parallelize): what takes "a model" reads
    # the pipeline's layout in it, and the meter every stage's expert-parallel figures.
    remember(pipe.model, pipe, layout=layout, pipeline=weakref.ref(pipe), experts=[s for p in parts for s in spread_of(p).experts])
    return pipe


def stage_plan(part: nn.Module, styles: dict[str, Any]) -> dict[str, Any]:
    """The entries of the whole model's tensor-parallel plan (expanded, torch styles) for the modules a stage
    holds with parameters in them: not a block of another stage (deleted, or a stand-in that registers
    nothing), nor what stands in for the embeddings or the norm elsewhere."""
    held = dict(part.named_modules())
    return {n: s for n, s in styles.items() if n in held and next(held[n].parameters(), None) is not None}
