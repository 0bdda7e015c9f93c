"""Pipelines without a hand split: ``mg.parallel.pipeline(model, layout, loss_fn, plan)`` cuts a model into
balanced stages and returns the ``Pipeline`` that runs this rank's.

What is cut: a transformers CausalLM by the split it declares (``_pp_plan``: embed_tokens / layers / norm,
then lm_head outside the base model) or, where it declares none (GPT-2), the split found in it (the base
model ``base_model_prefix`` names, its ModuleList of blocks, its modules before and after them, the
head), or an ``nn.Sequential`` by its children. Tied parameters (GPT-2's head and token table) get a
copy on each stage that uses them, kept equal by summing their gradients (``tied.py``). Balanced as torchtitan
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
from ..runtime import compat
from .layout import Layout
from .standins import BlockOutput, Elsewhere, FeedFirstBlock, Skipped
from .tied import tied_groups


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


def _hf_split(model: nn.Module) -> tuple[str, str, list[str], list[str], list[str], str] | None:
    """(the base model's name, its blocks' name, the base's modules before and after the blocks, the modules
    after the base, where the split came from): from a declared ``_pp_plan``, else found in a transformers
    CausalLM (``_found_split``)."""
    plan = getattr(model, "pp_plan", None) or getattr(model, "_pp_plan", None)
    if not isinstance(plan, dict) or not plan:
        return _found_split(model)
    held = {n for n, _ in model.named_modules()}
    if any(n not in held for n in plan):  # a plan for another variant (HRM's two block stacks): not this model's
        return _found_split(model)
    names = list(plan)
    blocks = next((n for n in names if isinstance(model.get_submodule(n), nn.ModuleList)), None)
    if blocks is None:  # a plan of the head alone (OLMoE: its config declares no base_model_pp_plan)
        return _found_split(model)
    base = blocks.rpartition(".")[0]
    inside = [n for n in names if n.rpartition(".")[0] == base]
    before, inner_after = inside[:inside.index(blocks)], inside[inside.index(blocks) + 1:]
    # The plan's order is not the forward's (transformers lists lm_head first): what lies outside the base
    # model runs after it (a CausalLM's head).
    after = [n for n in names if base and not n.startswith(base + ".")]
    return base, blocks, before, inner_after, after, "declared _pp_plan"


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _found_split(model: nn.Module) -> tuple[str, str, list[str], list[str], list[str], str] | None:
    """A transformers CausalLM that declares no ``_pp_plan`` (GPT-2 declares none in transformers 5.24):
    its base model is the child ``base_model_prefix`` names, whose forward takes ``inputs_embeds``; its
    blocks the base's longest ModuleList of the model's block class; before and after them the base's
    children registered before and after it that hold parameters (wte, wpe; ln_f), and the head the
    model's other children that hold parameters (lm_head). Parameterless children (dropout, rotary
    embeddings) stay on every stage: the base calls them wherever it runs."""
    import inspect

    from ..runtime.compat import direct_child
    from .auto import blocks_of

    prefix = getattr(model, "base_model_prefix", "")
    base = direct_child(model, prefix) if isinstance(prefix, str) and prefix else None
    if base is None:
        return None
    try:
        takes_embeds = "inputs_embeds" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        takes_embeds = False
    classes, _ = blocks_of(model)
    children = list(base.named_children())
    lists = [k for k, (_, c) in enumerate(children) if isinstance(c, nn.ModuleList) and len(c) > 0
             and all(type(b) in classes for b in c)]
    if not takes_embeds or not lists:
        return None
    at = max(lists, key=lambda k: len(children[k][1]))
    before = [f"{prefix}.{n}" for n, c in children[:at] if _has_params(c)]
    inner_after = [f"{prefix}.{n}" for n, c in children[at + 1:] if _has_params(c)]
    after = [n for n, c in model.named_children() if n != prefix and _has_params(c)]
    return prefix, f"{prefix}.{children[at][0]}", before, inner_after, after, "found split"


def _causal_lm_forward(part: nn.Module, base: str, first: bool, last: bool, feed: FeedFirstBlock | None, x):
    """A stage of a transformers CausalLM: token ids (first stage) or hidden states in. The last stage runs
    the CausalLM's own forward (its base model, then the head and whatever the model does after it: Gemma's
    logit soft-capping, Granite's logit scaling); the others run the base model's forward. Either way the
    model's own code walks every block, this stage's and the stand-ins of the others' (``Skipped``)."""
    kwargs = {"input_ids": x} if first else {"inputs_embeds": x}
    if feed is not None:
        feed.x = x
    try:
        if last:  # the class's forward: the instance's is this function
            return type(part).forward(part, **kwargs, use_cache=False).logits
        h = (part.get_submodule(base) if base else part)(**kwargs, use_cache=False).last_hidden_state
    finally:
        if feed is not None:
            feed.x = None
    # GPT-2 returns its hidden states through .view(); the schedules that split the backward into input and
    # weight parts detach a stage's outputs in place, which torch refuses for a view.
    return h.clone() if compat.is_view(h) else h


def _set(model: nn.Module, name: str, value: nn.Module) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attr, value)


def split(model: nn.Module, layout: Layout, n_stages: int) -> tuple[Callable[[int], nn.Module], int, str]:
    """(stage i's module, the number of blocks, how the model was cut) for ``n_stages`` stages.

    Tied parameters (GPT-2's head and token table) stay tied within a stage; a stage that uses one of
    the names holds a copy of its own (each stage is a copy of the model), kept equal to the others by
    the ``Pipeline`` (``tied.TiedGrads``)."""
    name = type(model).__name__
    hf = _hf_split(model)
    if hf is not None:
        base, blocks_name, before, inner_after, after, source = hf
        blocks = model.get_submodule(blocks_name)
        layout.check_sizes(blocks=len(blocks), model=name)
        ranges = balance(len(blocks), n_stages)

        def hf_stage(i: int, share: bool = False) -> nn.Module:
            """Stage i, a copy of the model; ``share``: the copy holds the model's own tensors (for ``probe``)."""
            part = copy.deepcopy(model, {id(t): t for t in (*model.parameters(), *model.buffers())} if share else None)
            held = part.get_submodule(blocks_name)
            output = BlockOutput()
            for j in range(len(held)):  # the other stages' blocks: stand-ins at their indices
                if j in ranges[i]:
                    held[j].register_forward_hook(output.hook)
                else:
                    held[j] = Skipped(held[j], j, output)
            first, last = i == 0, i == n_stages - 1
            feed = None
            if not first:
                for n in before:  # the first stage's (embeddings): zeros stand in, fed past (FeedFirstBlock)
                    _set(part, n, Elsewhere(part.get_submodule(n)))
                feed = FeedFirstBlock()
                # Registered before FSDP's own pre-hooks (parallelize comes later), which then see the fed input.
                held[ranges[i].start].register_forward_pre_hook(feed, with_kwargs=True)
            if not last:
                for n in inner_after:  # the base model calls its final norm always: a no-op before the last stage
                    _set(part, n, nn.Identity())
                for n in after:
                    _set(part, n, None)
            part.forward = functools.partial(_causal_lm_forward, part, base, first, last, feed)
            return part

        probe(model, hf_stage, n_stages)
        return hf_stage, len(blocks), f"{source} ({blocks_name}: {len(blocks)} blocks)"
    if isinstance(model, nn.Sequential):
        layout.check_sizes(blocks=len(model), model=name)
        parts = even(len(model), n_stages)

        def seq_stage(i: int) -> nn.Module:
            part = nn.Sequential()
            memo: dict[int, Any] = {}  # one memo: children that share a parameter still share it in the stage
            for j in parts[i]:
                part.add_module(str(j), copy.deepcopy(model[j], memo))
            return part

        return seq_stage, len(model), f"nn.Sequential ({len(model)} children)"
    from .auto import blocks_of

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
    tensors (no memory); a stage's input requires grad, as the schedule's does."""
    from .probe import TOLERANCE, cause, probe_input, relative_error, run

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


def pipeline(model: nn.Module, layout: Layout, loss_fn: Callable, plan: Any, *, verbose: bool = True):
    """This rank's stages of ``model`` cut by ``layout.pp`` (and its schedule), each tensor parallel over
    ``layout.tp`` (the model's plan, the entries for what the stage holds) and FSDP-sharded over the
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
    accum_steps = plan.accum_steps
    # The model's own problems first (they need another model, not another flag), then the schedule's.
    make, n_blocks, how = split(model, layout, shape.pp * pp.stages_per_rank(layout.schedule))
    n_stages = pp.check(layout.schedule, shape.pp, accum_steps)
    from .auto import block_modules, blocks_of, head_counts

    classes, _ = blocks_of(model)
    styles: dict[str, Any] = {}
    if shape.tp > 1:
        from .spread import tensor_parallel_plan

        # The plan of the whole model (declared, else found), refused here before any group work; each stage
        # then takes the entries for the modules it holds (stage_plan).
        heads = head_counts(model)
        layout.check_sizes(heads=heads.get("attention heads"), kv_heads=heads.get("KV heads"), model=name)
        styles, source, _ = tensor_parallel_plan(model, layout, block_modules(model, classes), None)
    params = list(model.parameters())
    device = params[0].device
    mesh = layout.mesh(world, device.type)
    ids = pp.stage_ids(layout.schedule, mesh.pp_rank, shape.pp)
    parts = [make(i) for i in ids]
    if mesh.dp_mesh is not None or shape.tp > 1:
        # mg.parallelize's TP and FSDP, the one way in; as a pipeline stage FSDP keeps the parameters gathered
        # between a step's micro-batches. This function prints its own line for all the stages.
        parts = [parallelize(p, mesh, tp_plan=stage_plan(p, styles) if styles else None,
                             block_classes=classes or None, pipeline_stage=True, verbose=False) for p in parts]
    if verbose:
        print0(f"mg.parallel.pipeline: {n_stages} stages of {name} by {how}, blocks per stage "
               f"{'even' if how.startswith('nn.Sequential') else [len(r) for r in balance(n_blocks, n_stages)]}, "
               f"schedule {layout.schedule}, {accum_steps} micro-batches"
               + (f", each stage tensor parallel {shape.tp} (plan {source}, {len(styles)} modules)"
                  if shape.tp > 1 else "")
               + (f", each stage FSDP over {shape.dp} ranks" if mesh.dp_mesh is not None else ""))
    tied = tied_groups(model)  # each stage holds its own copy: the Pipeline sums their gradients
    if verbose and tied:
        print0(f"mg.parallel.pipeline: tied {'; '.join(' = '.join(g) for g in tied)}: a copy on each stage that uses "
               "it, gradients summed over the copies after each step")
    return pp.Pipeline(parts, ids, n_stages, mesh.pp_mesh.get_group(), device, layout.schedule, accum_steps, loss_fn,
                       tied=tied)


def stage_plan(part: nn.Module, styles: dict[str, Any]) -> dict[str, Any]:
    """The entries of the whole model's tensor-parallel plan (expanded, torch styles) for the modules a stage
    holds: those it kept with their own parameters (not a block of another stage, nor what stands in for
    the embeddings or the norm elsewhere)."""
    held = dict(part.named_modules())
    return {n: s for n, s in styles.items()
            if n in held and next(held[n].parameters(recurse=False), None) is not None}


def gathered_state_dict(pipe: Any) -> dict:
    """The full weights of every stage, under one process's names, on every rank (a collective)."""
    import torch.distributed as tdist
    from torch.distributed.tensor import DTensor

    mine = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            for part in pipe.modules for k, v in part.state_dict().items()}
    gathered: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(gathered, mine)
    return {k: v for d in gathered for k, v in d.items()}
