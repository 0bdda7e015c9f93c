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

>>> mg.parallelize(model, mesh, tp_plan=tp_plan(model, sequence_parallel=True), sequence_parallel=True)
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...errors import UsageError
from .model import GPTConfig


def check_tp(cfg: GPTConfig, tp: int, sequence_parallel: bool = False) -> None:
    """Refuse a TP degree that does not divide what it shards: the Layout's one rule (heads, hidden units,
    vocabulary, and the sequence under sequence parallelism)."""
    from ...parallel.layout import Layout

    Layout(tp=tp, sequence_parallel=sequence_parallel and tp > 1).check_sizes(
        heads=cfg.n_head, hidden=4 * cfg.n_embd, vocab=cfg.vocab_size, seq=cfg.block_size, model="the GPT")


def tp_plan(model: nn.Module, *, sequence_parallel: bool = False, loss_parallel: bool = False) -> dict[str, Any]:
    """The plan for ``model``, a ``GPT`` or a pipeline stage of one (``pipeline.stage_module``): only the
    modules it has (``mg.parallelize`` refuses a plan naming a module the model lacks)."""
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


def spread(model: nn.Module, mesh: Any, *, sequence_parallel: bool = False, loss_parallel: bool = False,
           **options: Any) -> nn.Module:
    """``mg.parallelize`` with the GPT's plan (``options``: its other keywords, e.g. ``pipeline_stage``)."""
    from ...parallel.spread import parallelize

    if mesh.shape.tp > 1:
        check_tp(model.cfg, mesh.shape.tp, sequence_parallel)
        options["tp_plan"] = tp_plan(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    elif sequence_parallel or loss_parallel:
        raise UsageError("sequence_parallel and loss_parallel split work over tensor-parallel ranks but tp is 1; "
                         "use mg.parallel.mesh(dist, tp=2) or drop them")
    return parallelize(model, mesh, sequence_parallel=sequence_parallel, **options)
