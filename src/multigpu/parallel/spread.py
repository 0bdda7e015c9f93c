"""``mg.parallelize``: the one way to spread a whole model by a ``Layout``, written as short steps.

In torchtitan's order: tensor parallelism first (the user's plan, else the
plan the model declares, else one found from its module pattern; see
``auto.py``), then activation checkpointing and ``torch.compile`` per block,
then FSDP (HSDP with a replicate degree) over the blocks the model declares
or that are found in it, and the root; DDP when the layout only replicates.
The full model is built on every rank with the same seed first and then
distributed, so the weights equal one process's. It says what it chose in
one line for the plan and one for the units, on rank 0. How it spread the
model is kept beside it, never on it (``spreads.py``: ``spread_of(model)``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from ..dist import print0
from ..errors import UsageError
from . import auto, probe, unused
from ..spreads import record_share, remember
from .hf import router
from .batchnorm import prepare_batchnorm
from .fsdp import shard_blocks, unit_rule, units_line
from .layout import Layout


def _world() -> tuple[int, int]:
    on = tdist.is_available() and tdist.is_initialized()
    return (tdist.get_rank(), tdist.get_world_size()) if on else (0, 1)


def _short(plan: dict[str, Any], limit: int = 6) -> str:
    items = [f"{k} {v if isinstance(v, str) else getattr(v, 'label', None) or type(v).__name__}" for k, v in plan.items()]
    return ", ".join(items[:limit]) + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def _checkpointed(block: nn.Module) -> None:
    """Recompute ``block``'s activations in the backward. The forward is replaced on the instance, not
    wrapped in another module, so parameter names (and so checkpoints) stay as one process has them."""
    from torch.utils.checkpoint import checkpoint

    inner = block.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    block.forward = forward


def tensor_parallel_plan(model: nn.Module, layout: Layout, blocks: list[tuple[str, nn.Module]],
                         tp_plan: dict[str, Any] | None, derive_sequence_parallel: bool = False
                         ) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """(the expanded plan of torch styles, where it came from, the plan as written) for ``layout.tp``;
    ``derive_sequence_parallel``: under ``layout.sequence_parallel``, a plan that spells no SP styles gets
    them derived (``sp.py``) rather than refused (a pipeline's stages keep the refusal: the split stream
    would cross their boundaries)."""
    name = type(model).__name__
    if tp_plan is not None:
        written, source = dict(tp_plan), "given"
    elif (own := auto.declared_plan(model)) is not None:
        written, source = own, f"declared by {name}"
    else:
        written, source = auto.found_plan(model, blocks), "found in the blocks"
        if not written:
            kinds = sorted({type(m).__name__ for _, b in blocks for m in b.modules()
                            if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))})
            held = f"its blocks hold {', '.join(kinds)}" if blocks and kinds else "it has no repeated blocks"
            raise UsageError(f"tensor parallelism (tp={layout.tp}) found no plan for {name}: it declares none and "
                             f"{held}, no q/k/v/o or gate/up/down Linears; use tp=1 (DDP or FSDP shard any model), "
                             "or pass tp_plan={'<module name>': 'colwise' | 'rowwise', ...}")
    if not written:
        raise UsageError(f"the tensor-parallel plan for {name} is empty ({source}), so nothing would be sharded; "
                         "pass tp_plan={'<module name>': 'colwise' | 'rowwise', ...} or use tp=1")
    if layout.sequence_parallel and source != "given" and not derive_sequence_parallel:
        raise UsageError(f"sequence_parallel needs a plan that splits the norms along the sequence; the plan {source} "
                         "does not: pass your own tp_plan with SequenceParallel styles, or drop sequence_parallel")
    declared = source.startswith("declared")
    if declared:
        written, experts = auto.without_experts(written)
        if experts:
            source += (f", its {len(experts)} entries for the experts left out ("
                       + (f"ep {layout.ep} spreads them over the TP ranks" if layout.ep > 1
                          else "kept whole on every TP rank: ep is 1") + ")")
    expanded = auto.expand(model, written, declared=declared)
    styles = {k: auto.translate(v, k) for k, v in expanded.items()}
    styles = {k: v for k, v in styles.items() if v is not None}
    from .hf import lora

    adapted = lora.adapter_styles(model, styles, layout.sequence_parallel)  # a PEFT model's LoRA-wrapped Linears
    if wrapped := sum(k not in adapted for k in styles):
        source += f", {wrapped} PEFT-wrapped modules split with their adapters"
    styles = adapted
    if not styles:
        raise UsageError(f"the tensor-parallel plan {source} only replicates, so nothing would be sharded; "
                         "give some modules 'colwise' or 'rowwise', or use tp=1")
    if layout.sequence_parallel and derive_sequence_parallel:
        from .hf import sp

        if not sp.spells_sequence_parallel(styles):  # PyTorch's SP styles derived from the TP plan
            styles = sp.sequence_parallel_plan(model, blocks, styles)
            source += ", sequence parallel derived from it"
    auto.check_shardable(model, styles, layout.tp, declared=declared)
    return styles, source, written


def _resolved(model: nn.Module, layout: Any, sequence_parallel: bool | None) -> Layout:
    if not isinstance(model, nn.Module):
        raise UsageError(f"mg.parallelize expects a torch.nn.Module, got {type(model).__name__}")
    layout = Layout() if layout is None else layout
    if not isinstance(layout, Layout):
        raise UsageError(f"mg.parallelize takes a mg.parallel.Layout, got {type(layout).__name__}; "
                         "e.g. mg.parallelize(model, mg.parallel.Layout(tp=2))")
    if sequence_parallel is not None:  # Layout refuses it with tp 1, in its own line
        layout = dataclasses.replace(layout, sequence_parallel=sequence_parallel)
    # A layout for another number of processes is refused here, then one multigpu does not build yet.
    return layout.resolve(_world()[1]).built()


def _check_options(layout: Layout, options: dict[str, Any]) -> None:
    """The data-parallel step's options, by ``wrap.check_options`` (mg.wrap's one rule) for the strategy the
    layout reads as; one process takes any of them (the same script runs on one process and on many)."""
    from .wrap import STRATEGIES, check_options

    kind = "zero1" if layout.strategy == "ddp" and (options.get("zero1") or layout.zero1) else layout.strategy
    if kind == "none":
        known = {o for s in ("ddp", "zero1", "fsdp") for o in inspect.signature(STRATEGIES[s]).parameters} | {"zero1"}
        if unknown := sorted(set(options) - known - {"model", "block_classes"}):
            raise UsageError(f"mg.parallelize has no option {', '.join(unknown)}; the data-parallel options are "
                             "mg.wrap's for 'ddp', 'zero1' and 'fsdp'")
        return
    named = {"ddp": "DDP", "zero1": "DDP with ZeRO-1", "fsdp": "FSDP", "hsdp": "HSDP"}[kind]
    check_options("fsdp" if kind == "hsdp" else kind,
                  {k: v for k, v in options.items() if not (k == "zero1" and kind == "zero1")},
                  where=f"layout {layout.label} ({named})")


def parallelize(model: nn.Module, layout: Layout | None = None, *, tp_plan: dict[str, Any] | None = None,
                block_classes: list[type] | None = None, activation_checkpointing: bool | None = None,
                compile: bool | None = None, sequence_parallel: bool | None = None, pipeline_stage: bool = False,
                capacity_factor: float | None = None, verbose: bool = True, **options: Any) -> nn.Module:
    """Spread ``model`` (the full model, built with the same seed on every rank, on ``dist.device``) by
    ``layout`` in torchtitan's order: TP, then activation checkpointing and compile per block, then the
    data-parallel step: FSDP/HSDP, or DDP when the layout only replicates. Returns the model to train (the
    DDP wrapper under DDP, the module itself otherwise).

    ``options`` are the data-parallel step's: under DDP ``bucket_cap_mb``, ``static_graph``,
    ``find_unused_parameters``, ``gradient_as_bucket_view``, ``broadcast_buffers``, ``comm_hook`` ("fp16" |
    "bf16" | "powersgd", with ``powersgd_rank``, ``powersgd_start_iter``), ``zero1=True`` (the optimizer
    state sharded: build it with ``mg.optimizer``; the layout's ``zero1`` says the same); under FSDP/HSDP
    ``min_block_params``, ``reshard_after_forward``, ``param_dtype``, ``reduce_dtype``, ``cpu_offload``;
    ``sync_batchnorm`` under both. An option of the other strategy is refused in one line; one process takes any.
    ``sequence_parallel``, ``activation_checkpointing`` and ``compile`` override the layout's.
    ``pipeline_stage``: ``model`` is one stage of a pipeline over ``layout`` (``mg.parallel.pipeline``):
    TP and FSDP apply inside the stage, and FSDP keeps the parameters gathered between a step's
    micro-batches unless ``reshard_after_forward`` says so. ``capacity_factor`` (under ``ep``): each rank
    sends an expert at most ceil(factor x its routed pairs / experts) of its tokens, drops the rest and
    counts them (``mg.StepMeter``'s ``experts.dropped``); None, the default, drops nothing (one process's
    result). A mixture of experts' router loss (``output_router_logits``) is computed over every
    data-parallel rank's tokens (``hf/router.py``).

    >>> model = mg.parallelize(LlamaForCausalLM(cfg).to(dist.device), mg.parallel.Layout(tp=2))
    >>> model = mg.parallelize(net, mg.parallel.Layout(dp_replicate=dist.world_size), comm_hook="bf16")   # DDP
    """
    layout = _resolved(model, layout, sequence_parallel)
    options = dict(options)
    # mg.from_pretrained's: the parameters are on the meta device, to be allocated on this device once spread
    # and filled from a checkpoint; nothing can be probed (no process holds the model's values).
    empty = options.pop("_empty", None)
    _check_options(layout, options)
    name = type(model).__name__
    if layout.pp > 1 and not pipeline_stage:
        raise UsageError(f"pp={layout.pp} splits {name} into pipeline stages, which changes the loop; use "
                         "pipe = mg.parallel.pipeline(model, layout, loss_fn, plan) and loss = pipe.step(micro_batches)")
    params = list(model.parameters())
    if params and params[0].device.type == "meta" and empty is None:
        raise UsageError("mg.parallelize got a model on the meta device; build it on dist.device with the same seed "
                         "on every rank (the weights are then distributed, equal to one process's), or load a "
                         "checkpoint onto the layout with mg.from_pretrained")
    device = torch.device(empty) if empty is not None else params[0].device if params else torch.device("cpu")
    device_type = device.type
    if _world()[1] > 1 and not pipeline_stage and (note := probe.draws_note(model, _world()[1], "mg.parallelize")):
        print0(note)  # whatever verbose says: it is about the numbers, not the choices
    classes, block_source = auto.blocks_of(model, block_classes)
    blocks = auto.block_modules(model, classes)
    say = print0 if verbose else (lambda *a, **k: None)
    found = _experts_to_spread(model, layout, capacity_factor)  # refused before TP changes the model or a mesh
    if layout.cp > 1:
        _check_context(model, layout)
    parts: dict[str, Any] = {}  # what the model's record holds beside its layout (spreads.py)
    if layout.tp > 1:
        parts["tp_plan"] = _tensor_parallel(model, layout, blocks, tp_plan, pipeline_stage, device_type, say,
                                            probed=empty is None)
    if found:
        stats, options["experts"] = _expert_parallel(model, layout, found, capacity_factor, device_type,
                                                     pipeline_stage, say, probed=empty is None)
        parts["experts"] = [stats]
    if layout.cp > 1:
        parts["context"] = _context_parallel(model, layout, device_type, say, probed=empty is None)
    extras = _per_block(model, layout, blocks, activation_checkpointing, compile)
    if layout.dp_size > 1 or layout.cp > 1:  # ranks see other tokens: routing may leave a rank's experts unused
        unused.touch_experts(model)
    if layout.dp_size > 1 and router.has_router_loss(model):  # the batch's load-balancing loss, not a rank's
        router.over_ranks(model, layout.dp_group(device_type))
    model = _data_parallel(model, layout, classes, block_source, block_classes, pipeline_stage, options, extras, say,
                           device)
    rank, world = _world()
    if not pipeline_stage:  # a pipeline records its own (mg.eval_loader and mg.all_reduce_sum read it)
        record_share(layout.data_share(rank), rank, world)
    remember(model, layout=layout, **parts)
    return model


def _tensor_parallel(model: nn.Module, layout: Layout, blocks: list, tp_plan: dict[str, Any] | None,
                     pipeline_stage: bool, device_type: str, say: Any, probed: bool = True) -> str:
    """TP by the plan (given, declared or found), checked on a probe batch of a whole model (``probe.py``);
    where the plan came from."""
    from .hf.conv1d import divide_split_sizes
    from .tp import apply_tp

    heads = auto.head_counts(model)
    layout.check_sizes(heads=heads.get("attention heads"), kv_heads=heads.get("KV heads"), model=type(model).__name__)
    styles, source, written = tensor_parallel_plan(model, layout, blocks, tp_plan,
                                                   derive_sequence_parallel=not pipeline_stage)
    # A stage is not run alone (mg.parallel.pipeline checks the cut on the whole model); any other model is
    # probed as the user's loop calls it (probe.py), its own models included.
    batch = None if pipeline_stage or not probed else probe.probe_batch(model, layout.tp)
    expected, why = (None, "") if pipeline_stage else probe.attempt(model, batch) if probed else \
        (None, "loaded from a checkpoint: no process holds the whole model to compare with")
    # Loaded (not probed), the loader checks the split against an FSDP load, output and gradients, found plans too.
    if expected is None and not pipeline_stage and probed and source.startswith("found"):
        raise UsageError(f"tensor parallelism found a plan in {type(model).__name__}'s blocks but cannot check it on a "
                         f"probe batch: {why}; pass tp_plan={{'<module name>': 'colwise' | 'rowwise', ...}} (a plan "
                         "you give is taken unchecked) or use tp=1")
    tp_mesh = layout.device_mesh(device_type)["tp"]
    apply_tp(model, tp_mesh, styles, say)
    divide_split_sizes(model, styles, layout.tp)  # GPT-2's attention splits its fused c_attn by split_size
    if expected is not None:  # the split checked on the model itself: exact or refused (probe.py)
        probe.check(model, batch, expected, tp_mesh.get_group(), source)
    # loaded (mg.from_pretrained): its output is checked once loaded, against an FSDP load of the checkpoint
    unchecked = "; checked on a probe batch once loaded" if not probed and not pipeline_stage else \
        f"; not checked on a probe batch ({why})" if why else ""
    say(f"mg.parallelize: tensor parallel {layout.tp}: plan {source}, {len(written)} entries on "
        f"{len(styles)} modules: {_short(written)}{unchecked}")
    return source


def _experts_to_spread(model: nn.Module, layout: Layout, capacity_factor: float | None) -> list:
    """The experts modules ``layout.ep`` spreads (none when ep is 1), or a one-line refusal of what this
    release cannot: checked on the model as it came, before any step changes it."""
    if capacity_factor is not None and (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float))
                                        or not capacity_factor > 0 or layout.ep == 1):
        raise UsageError(f"capacity_factor caps the tokens each expert takes under expert parallelism: a number > 0 "
                         f"with ep > 1, got {capacity_factor!r} with ep={layout.ep}; leave it out (dropless) or use ep")
    if layout.ep == 1:
        return []
    from . import experts

    return experts.check(model, layout)


def _expert_parallel(model: nn.Module, layout: Layout, found: list, capacity_factor: float | None, device_type: str,
                     pipeline_stage: bool, say: Any, probed: bool = True) -> tuple[Any, tuple]:
    """Each rank keeps experts/ep of every experts module ``found`` and the routed tokens travel to them
    (``experts.py``), checked on a probe batch as a TP plan is: the model's output as before, or refused
    quoting what failed; (its dispatch figures, (the modules, the mesh FSDP shards them over: efsdp)).
    ``probed`` False: the model is on the meta device, to be loaded once spread (mg.from_pretrained, whose
    test compares it with transformers'): nothing to run."""
    from . import experts

    batch = None if pipeline_stage or not probed else probe.probe_batch(model, layout.tp)
    expected, _ = probe.attempt(model, batch)
    stats = experts.apply(found, layout, layout.ep_mesh(device_type), capacity_factor)
    if expected is not None:
        # A capacity factor drops tokens by design: then only that the forward runs.
        probe.agree(model, batch, None if capacity_factor else expected, None, f"expert parallelism (ep={layout.ep})",
                    "use ep=1 for this model (FSDP and HSDP spread its experts with the rest)", expected.device)
        stats.clear()  # the probe's tokens are none of the training's (mg.StepMeter's experts figures)
    n = found[0][1].num_experts
    drops = "dropless" if capacity_factor is None else f"capacity factor {capacity_factor}"
    say(f"mg.parallelize: expert parallel {layout.ep}: {len(found)} experts modules of {type(model).__name__}, "
        f"{n // layout.ep} of {n} experts per rank, FSDP over efsdp {layout.efsdp}, {drops} all-to-all")
    return stats, ([m for _, m in found], layout.efsdp_mesh(device_type))


def _check_context(model: nn.Module, layout: Layout) -> None:
    from . import context

    if router.has_router_loss(model):
        raise UsageError(f"context parallelism with a mixture of experts' router loss ({type(model).__name__}) is not "
                         "built yet: the loss would count one share's tokens; use cp=1 or output_router_logits=False")
    context.check(model, layout, auto.head_counts(model))


def _context_parallel(model: nn.Module, layout: Layout, device_type: str, say: Any, probed: bool = True) -> Any:
    """Each cp rank keeps a share of every sequence; attention sees the whole one (``context.py``); its
    ``Context``. ``probed`` False: a transformers model on the meta device, to be loaded once spread
    (mg.from_pretrained), checked on the probe batch once loaded (``context_probe.check_loaded``)."""
    from . import context, context_probe, context_sdpa

    if not probed:
        ctx, done = context.apply(model, layout, layout.cp_mesh(device_type))
        say(f"mg.parallelize: {done}; checked on a probe batch once loaded")
        return ctx
    own = getattr(model, "config", None) is None  # a user's own model (context_sdpa.py)
    # 2 sequences of 16 x cp tokens: 2cp chunks of 8
    batch = context_sdpa.probe_input(model, layout.cp) if own else probe.probe_input(model, 2 * layout.cp)
    with context_sdpa.Heads() as heads:  # a user's own model's query heads, counted on one process's forward
        expected, why = probe.attempt(model, batch)
    if expected is None:  # before cp changes anything: the model's own forward, not cp, fails (quoted)
        raise UsageError(f"context parallelism checks {type(model).__name__} on a probe batch of token ids first, but "
                         f"{why}; use cp=1 for this model, or make its forward run on its token ids alone")
    if own:  # a transformers model's heads are checked from its config (context.check), by the same rule
        context.check_heads(type(model).__name__, layout, sorted(heads.counts))
    unsplit = context_probe.unsplit(model, batch, expected, own)  # before cp changes anything
    ctx, done = context.apply(model, layout, layout.cp_mesh(device_type))
    context_probe.probe(model, ctx, batch, *unsplit)  # exact or refused
    say(f"mg.parallelize: {done}")
    return ctx


def _per_block(model: nn.Module, layout: Layout, blocks: list, activation_checkpointing: bool | None,
               compile: bool | None) -> str:
    """Activation checkpointing and ``torch.compile`` per block; what was done, for the closing line."""
    ac = layout.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
    compiled = layout.compile if compile is None else compile
    if (ac or compiled) and not blocks:
        raise UsageError(f"activation checkpointing and compile apply per block, but {type(model).__name__} has no "
                         "repeated blocks (none declared, no container of one class); pass block_classes=[YourBlock]")
    # The first k blocks (of this stage, on a pipeline: each stage is spread on its own), as Megatron's
    # --recompute-method block: the rest keep their activations. A stage of fewer blocks checkpoints them all.
    k = len(blocks) if layout.checkpoint_blocks is None else min(layout.checkpoint_blocks, len(blocks))
    for index, (_, block) in enumerate(blocks):
        if ac and index < k:
            _checkpointed(block)
        if compiled:
            block.compile()  # in place: the parameter names stay
    which = "per block" if k == len(blocks) else f"on the first {k} of {len(blocks)} blocks"
    done = "; ".join(x for x in (f"activation checkpointing {which}" if ac else "",
                                 "compiled per block" if compiled else "") if x)
    return f"; {done}" if done else ""


def _data_parallel(model: nn.Module, layout: Layout, classes: list, block_source: str, block_classes: Any,
                   pipeline_stage: bool, options: dict[str, Any], extras: str, say: Any,
                   device: torch.device) -> nn.Module:
    """DDP when the layout only replicates, FSDP (HSDP) when it shards, nothing on one data-parallel rank."""
    name, kind = type(model).__name__, layout.strategy
    block_names = ", ".join(c.__name__ for c in classes) or "none"
    if kind == "ddp":
        from .wrap import STRATEGIES

        zero1 = bool(options.pop("zero1", False)) or layout.zero1
        how = "with the optimizer state sharded (ZeRO-1; build it with mg.optimizer)" if zero1 else "(replicate only)"
        say(f"mg.parallelize: DDP over {layout.dp_size} ranks {how}: one unit, the whole {name}{extras}")
        return STRATEGIES["zero1" if zero1 else "ddp"](model, **options)  # mg.wrap's own DDP
    if kind in ("fsdp", "hsdp"):
        sync = options.pop("sync_batchnorm", False)
        if pipeline_stage:
            # Resharding after each micro-batch's forward would gather the stage's parameters again for the next.
            options.setdefault("reshard_after_forward", False)
        model = prepare_batchnorm(model, kind, sync, device)
        # The one unit rule (fsdp.unit_rule, mg.wrap's too); shard first, then count what was sharded.
        units, minimum, rule = unit_rule(model, block_classes, options.pop("min_block_params", None))
        experts = len(options.get("experts", ([],))[0])
        model = shard_blocks(model, layout.dp_mesh(device.type), block_classes=units, min_block_params=minimum,
                             **options)
        if not any(p.is_meta for p in model.parameters()):
            from .float8 import refresh_scales

            refresh_scales([model])  # float8 weights' scales from the whole weights before the first step
        shard = f"dp_shard {layout.dp_shard}" + (f" x cp {layout.cp}" if layout.cp > 1 else "")
        over = (f"HSDP over dp_replicate {layout.dp_replicate} x {shard}" if kind == "hsdp" else f"FSDP over {shard}")
        say(f"mg.parallelize: {over}: {units_line(model, rule, experts)}{extras}")
        return model
    if layout.tp == 1 and layout.pp == 1:
        say(f"mg.parallelize: one process, nothing to spread (blocks: {block_names}){extras}")
    elif extras:
        say(f"mg.parallelize: blocks {block_names} ({block_source}){extras}")
    return model
