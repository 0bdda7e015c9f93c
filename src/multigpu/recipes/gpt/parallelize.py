"""The GPT's tensor-parallel plan, the one thing ``mg.parallelize`` cannot find in it by itself.

Column-wise q, k, v and MLP up (each rank computes its heads and its share
of the hidden units), row-wise attention out and MLP down (one all-reduce,
or a reduce-scatter with sequence parallelism, per sub-layer), the token
table and the head sharded by vocabulary rows (Megatron-LM's layout;
torchtitan's llama plan). With ``sequence_parallel`` the norms and the
residual stream between sub-layers are split along the sequence. With
``loss_parallel`` the logits stay sharded by vocabulary into the loss.
The plan is the user's (``tp_plan=``) to ``mg.parallelize`` rather than one
the GPT declares: it depends on those two choices and on which modules a
pipeline stage kept, which a fixed declaration cannot say.

>>> model = spread(model, mg.parallel.Layout(tp=2, sequence_parallel=True), loss_parallel=True)
"""

from __future__ import annotations

from typing import Any

from torch import nn

import multigpu as mg

from .model import GPTConfig


def check_layout(cfg: GPTConfig, layout: mg.parallel.Layout) -> None:
    """The Layout's one size rule on the GPT's sizes: TP divides the heads, the MLP width, the vocabulary (and
    the sequence under sequence parallelism); no more pipeline stages than blocks; a pipeline only untied."""
    layout.check_sizes(heads=cfg.n_head, hidden=cfg.mlp_width, vocab=cfg.vocab_size, seq=cfg.block_size,
                       blocks=cfg.n_layer, tied=cfg.tie_embeddings, model="the GPT")


def tp_plan(model: nn.Module, *, sequence_parallel: bool = False, loss_parallel: bool = False) -> dict[str, Any]:
    """The plan for ``model``, a ``GPT`` or a pipeline stage of one: only the modules it has
    (``mg.parallelize`` refuses a plan naming a module the model lacks; a pipeline takes the whole model's
    and gives each stage the entries for what it holds)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {}
    first, last = model.embed is not None, model.head is not None
    if first:
        plan["embed.wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if last:
        plan["head"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                       use_local_output=not loss_parallel)
    if sequence_parallel and first:
        # The embeddings' sum (token + position, both full) is split along the sequence here.
        plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    if sequence_parallel and last:
        plan["ln_f"] = SequenceParallel()
    for i in model.blocks:
        b = f"blocks.{i}"
        plan |= {f"{b}.attn.q": ColwiseParallel(), f"{b}.attn.k": ColwiseParallel(), f"{b}.attn.v": ColwiseParallel(),
                 f"{b}.attn.out": RowwiseParallel(output_layouts=seq), f"{b}.mlp.up": ColwiseParallel(),
                 f"{b}.mlp.down": RowwiseParallel(output_layouts=seq)}
        if sequence_parallel:
            plan |= {f"{b}.ln1": SequenceParallel(), f"{b}.ln2": SequenceParallel(),
                     f"{b}.attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                     f"{b}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
    return plan


def spread(model: nn.Module, layout: mg.parallel.Layout, *, loss_parallel: bool = False, **options: Any) -> nn.Module:
    """``mg.parallelize`` with the GPT's plan (``options``: its other keywords)."""
    if layout.tp > 1:
        check_layout(model.cfg, layout)
        options["tp_plan"] = tp_plan(model, sequence_parallel=layout.sequence_parallel, loss_parallel=loss_parallel)
    elif loss_parallel:
        raise mg.UsageError("loss_parallel keeps the logits split over tensor-parallel ranks but tp is 1; "
                            "use --tp 2 or drop --loss-parallel")
    return mg.parallelize(model, layout, **options)


def pipeline(model: nn.Module, layout: mg.parallel.Layout, plan: mg.BatchPlan, splits: list[int] | None = None):
    """``mg.parallel.pipeline`` with the GPT's plan; the loss is a micro-batch's mean token cross-entropy."""
    import torch
    import torch.nn.functional as F

    check_layout(model.cfg, layout)
    plan_ = tp_plan(model, sequence_parallel=layout.sequence_parallel) if layout.tp > 1 else None

    def loss_fn(logits, y):
        # at least float32 (autocast's half-precision logits), float64 kept
        return F.cross_entropy(logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)), y.flatten())

    return mg.parallel.pipeline(model, layout, loss_fn, plan, tp_plan=plan_, splits=splits)
