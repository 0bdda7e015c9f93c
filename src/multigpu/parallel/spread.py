"""``mg.parallelize``: the one way to spread a whole model by a ``Layout`` (or a mesh).

In torchtitan's order: tensor parallelism first (the user's plan, else the
plan the model declares, else one found from its module pattern; see
``auto.py``), then activation checkpointing and ``torch.compile`` per block,
then FSDP (HSDP with a replicate degree) over the blocks the model declares
or that are found in it, and the root; DDP when the layout only replicates.
The full model is built on every rank with the same seed first and then
distributed, so the weights equal one process's. It says what it chose in
one line for the plan and one for the units, on rank 0.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch.distributed as tdist
from torch import nn

from ..dist import print0
from ..errors import UsageError
from . import auto, probe
from .batchnorm import prepare_batchnorm
from .fsdp import shard_blocks, size_rule, units_line
from .layout import LAYOUT_ATTR, Layout
from .mesh import Mesh


def _world() -> int:
    return tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1


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


def _stamped(model: nn.Module, layout: Layout) -> nn.Module:
    """``model`` with its layout left on it (``LAYOUT_ATTR``): NoiseScale.attach reads the degrees from it."""
    object.__setattr__(model, LAYOUT_ATTR, layout)  # a plain attribute, never a submodule or a parameter
    return model


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
            source += (f", its {len(experts)} entries for the experts left out (kept whole on every TP rank until "
                       "expert parallelism exists)")
    expanded = auto.expand(model, written, declared=declared)
    styles = {k: auto.translate(v, k) for k, v in expanded.items()}
    styles = {k: v for k, v in styles.items() if v is not None}
    if not styles:
        raise UsageError(f"the tensor-parallel plan {source} only replicates, so nothing would be sharded; "
                         "give some modules 'colwise' or 'rowwise', or use tp=1")
    if layout.sequence_parallel and derive_sequence_parallel:
        from . import sp

        if not sp.spells_sequence_parallel(styles):  # PyTorch's SP styles derived from the TP plan
            styles = sp.sequence_parallel_plan(model, blocks, styles)
            source += ", sequence parallel derived from it"
    auto.check_shardable(model, styles, layout.tp, declared=declared)
    return styles, source, written


def parallelize(model: nn.Module, layout: Layout | Mesh | None = None, *, tp_plan: dict[str, Any] | None = None,
                block_classes: list[type] | None = None, activation_checkpointing: bool | None = None,
                compile: bool | None = None, reshard_after_forward: bool | None = None,
                param_dtype: Any = None, reduce_dtype: Any = None, sync_batchnorm: bool = False,
                sequence_parallel: bool | None = None, pipeline_stage: bool = False,
                verbose: bool = True) -> nn.Module:
    """Spread ``model`` (the full model, built with the same seed on every rank, on ``dist.device``) by
    ``layout``: TP, then activation checkpointing and compile per block, then FSDP/HSDP, or DDP when
    only replicating (``sync_batchnorm``: BatchNorm statistics over the ranks). Returns the model to
    train (the DDP wrapper under DDP, the module itself otherwise).

    ``sequence_parallel`` (like ``activation_checkpointing`` and ``compile``) overrides the layout's, so
    a mesh (whose layout has none of them) can carry it; a plan without SequenceParallel styles (the
    declared or found one) gets them derived (``sp.py``). ``pipeline_stage``: ``model`` is one stage
    of a pipeline over ``layout``, a ``Mesh`` with pp > 1 (what ``mg.parallel.Pipeline`` takes): TP and FSDP apply inside the stage, and FSDP keeps
    the parameters gathered between a step's micro-batches unless ``reshard_after_forward`` says so.

    >>> model = mg.parallelize(LlamaForCausalLM(cfg).to(dist.device), mg.parallel.Layout(tp=2))
    >>> model = mg.parallelize(net, mg.parallel.Layout(dp_replicate=dist.world_size))   # DDP
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"mg.parallelize expects a torch.nn.Module, got {type(model).__name__}")
    mesh = layout if isinstance(layout, Mesh) else None
    layout = Layout.of(layout) if isinstance(layout, Mesh) else (layout or Layout())
    if not isinstance(layout, Layout):
        raise UsageError(f"mg.parallelize takes a mg.parallel.Layout or a mesh, got {type(layout).__name__}; "
                         "e.g. mg.parallelize(model, mg.parallel.Layout(tp=2))")
    if sequence_parallel is not None:  # Layout refuses it with tp 1, in its own line
        layout = dataclasses.replace(layout, sequence_parallel=sequence_parallel)
    world = _world()
    shape = layout.shape(world)  # a layout for another number of processes is refused here
    name = type(model).__name__
    if pipeline_stage and mesh is None:
        raise UsageError(f"a pipeline stage of {name} is spread over the pipeline's own mesh (its stages must share "
                         "it); pass that mg.parallel.Mesh, not a Layout")
    if shape.pp > 1 and not pipeline_stage:
        raise UsageError(f"pp={shape.pp} splits {name} into pipeline stages, which changes the loop; use "
                         "pipe = mg.parallel.pipeline(model, layout, loss_fn) and loss = pipe.step(micro_batches)")
    params = list(model.parameters())
    if params and params[0].device.type == "meta":
        raise UsageError("mg.parallelize got a model on the meta device; build it on dist.device with the same seed "
                         "on every rank (the weights are then distributed, equal to one process's)")
    classes, block_source = auto.blocks_of(model, block_classes)
    blocks = auto.block_modules(model, classes)
    strategy = layout.strategy(world)
    device_type = params[0].device.type if params else "cpu"
    if mesh is None and (shape.tp > 1 or strategy in ("fsdp", "hsdp")):
        mesh = layout.mesh(world, device_type)
    say = print0 if verbose else (lambda *a, **k: None)

    if shape.tp > 1:
        from .tp import apply_tp

        heads = auto.head_counts(model)
        layout.check_sizes(heads=heads.get("attention heads"), kv_heads=heads.get("KV heads"), model=name)
        styles, source, written = tensor_parallel_plan(model, layout, blocks, tp_plan,
                                                       derive_sequence_parallel=not pipeline_stage)
        batch = None if pipeline_stage else probe.probe_input(model, shape.tp)
        expected = None if batch is None else probe.expected(model, batch)
        apply_tp(model, mesh.tp_mesh, styles)
        from .conv1d import divide_split_sizes

        divide_split_sizes(model, styles, shape.tp)  # GPT-2's attention splits its fused c_attn by split_size
        if expected is not None:  # the split checked on the model itself: exact or refused (probe.py)
            probe.check(model, batch, expected, mesh.tp_mesh.get_group(), source)
        say(f"mg.parallelize: tensor parallel {shape.tp}: plan {source}, {len(written)} entries on "
            f"{len(styles)} modules: {_short(written)}")

    ac = layout.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
    compiled = layout.compile if compile is None else compile
    if (ac or compiled) and not blocks:
        raise UsageError(f"activation checkpointing and compile apply per block, but {name} has no repeated blocks "
                         "(none declared, no container of one class); pass block_classes=[YourBlock]")
    for _, block in blocks:
        if ac:
            _checkpointed(block)
        if compiled:
            block.compile()  # in place: the parameter names stay

    extras = "; ".join(x for x in ("activation checkpointing per block" if ac else "",
                                   "compiled per block" if compiled else "") if x)
    extras = f"; {extras}" if extras else ""
    block_names = ", ".join(c.__name__ for c in classes) or "none"
    if strategy == "ddp":
        if any(v is not None for v in (reshard_after_forward, param_dtype, reduce_dtype)):
            raise UsageError("reshard_after_forward, param_dtype and reduce_dtype are FSDP's, but this layout only "
                             "replicates (DDP); use Layout(dp_shard=...) for FSDP, or mg.Precision for DDP")
        from .ddp import wrap_ddp

        say(f"mg.parallelize: DDP over {shape.dp_replicate} ranks (replicate only): one unit, the whole "
            f"{name}{extras}")
        return _stamped(wrap_ddp(model, sync_batchnorm=sync_batchnorm), layout)
    if strategy in ("fsdp", "hsdp"):
        options: dict[str, Any] = {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype}
        if pipeline_stage and reshard_after_forward is None:
            # Resharding after each micro-batch's forward would gather the stage's parameters again for the next.
            reshard_after_forward = False
        if reshard_after_forward is not None:
            options["reshard_after_forward"] = reshard_after_forward
        model = prepare_batchnorm(model, strategy, sync_batchnorm, params[0].device)
        # Shard first, then count what was sharded: a refusal prints no line, and the blocks are picked once.
        model = shard_blocks(model, mesh.dp_mesh, block_classes=classes or None, **options)
        over = (f"HSDP over dp_replicate {shape.dp_replicate} x dp_shard {shape.dp_shard}" if strategy == "hsdp"
                else f"FSDP over dp_shard {shape.dp_shard}")
        rule = f"{block_names} ({block_source})" if classes else size_rule()
        say(f"mg.parallelize: {over}: {units_line(model, rule)}{extras}")
        return _stamped(model, layout)
    if shape.tp == 1 and shape.pp == 1:
        say(f"mg.parallelize: one process, nothing to spread (blocks: {block_names}){extras}")
    elif extras:
        say(f"mg.parallelize: blocks {block_names} ({block_source}){extras}")
    return _stamped(model, layout)
