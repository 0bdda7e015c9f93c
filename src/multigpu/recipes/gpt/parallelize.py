"""How the GPT recipe spreads over a mesh: its tensor-parallel plan, then FSDP over the data-parallel ranks.

Column-wise q, k, v and MLP up (each rank computes its heads and its share
of the hidden units), row-wise attention out and MLP down (one all-reduce,
or a reduce-scatter with sequence parallelism, per sub-layer), the token
table and the head sharded by vocabulary rows (Megatron-LM's layout;
torchtitan's llama plan). With ``sequence_parallel`` the norms and the
residual stream between sub-layers are split along the sequence. With
``loss_parallel`` the logits stay sharded by vocabulary into the loss.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...errors import UsageError
from .model import GPTConfig


def check_tp(cfg: GPTConfig, tp: int) -> None:
    """Refuse a TP degree that does not divide what it shards (heads, hidden units, vocabulary, sequence)."""
    sizes = {"n_head": cfg.n_head, "4 x n_embd (MLP hidden)": 4 * cfg.n_embd, "vocab_size": cfg.vocab_size,
             "block_size (sequence parallel splits it)": cfg.block_size}
    bad = [f"{name} {n}" for name, n in sizes.items() if n % tp]
    if bad:
        fits = [d for d in range(1, tp + 1) if all(n % d == 0 for n in sizes.values())]
        raise UsageError(f"tensor-parallel degree {tp} does not divide {', '.join(bad)}; "
                         f"use tp={max(fits)} or a model whose sizes it divides")


def tp_plan(cfg: GPTConfig, *, sequence_parallel: bool = False, loss_parallel: bool = False) -> dict[str, Any]:
    """The plan ``parallel.apply_tp`` takes for a ``GPT(cfg)``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        "embed.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                use_local_output=not loss_parallel),
    }
    if sequence_parallel:
        # The embeddings' sum (token + position, both full) is split along the sequence here.
        plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        plan["ln_f"] = SequenceParallel()
    for i in range(cfg.n_layer):
        b = f"blocks.{i}"
        plan |= {f"{b}.attn.q": ColwiseParallel(), f"{b}.attn.k": ColwiseParallel(), f"{b}.attn.v": ColwiseParallel(),
                 f"{b}.attn.out": RowwiseParallel(output_layouts=seq), f"{b}.mlp.up": ColwiseParallel(),
                 f"{b}.mlp.down": RowwiseParallel(output_layouts=seq)}
        if sequence_parallel:
            plan |= {f"{b}.ln1": SequenceParallel(), f"{b}.ln2": SequenceParallel(),
                     f"{b}.attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                     f"{b}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
    return plan


def parallelize(model: nn.Module, mesh: Any, *, sequence_parallel: bool = False, loss_parallel: bool = False,
                activation_checkpointing: bool = False, fsdp: bool = True, **fsdp_options: Any) -> nn.Module:
    """TP over ``mesh.tp_mesh`` (when tp > 1), activation checkpointing per block if asked, then FSDP
    per block and on the root over ``mesh.dp_mesh`` (torchtitan's order: FSDP outermost).

    ``model`` may be a pipeline stage (``pipeline.stage_module``): the plan keeps the modules it has,
    and FSDP keeps its parameters gathered between the micro-batches of a step (each would gather
    them again otherwise).
    """
    from ...parallel import apply_tp, shard_blocks
    from .model import Block

    cfg = model.cfg
    if mesh.shape.tp > 1:
        check_tp(cfg, mesh.shape.tp)
        plan = tp_plan(cfg, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        present = dict(model.named_modules())
        apply_tp(model, mesh.tp_mesh, {name: style for name, style in plan.items() if name in present})
    elif sequence_parallel or loss_parallel:
        raise UsageError("sequence_parallel and loss_parallel split work over tensor-parallel ranks but tp is 1; "
                         "use mg.parallel.mesh(dist, tp=2) or drop them")
    for block in model.blocks.values():
        block.checkpointed = activation_checkpointing
    if fsdp and mesh.dp_mesh is not None:
        if mesh.shape.pp > 1:
            fsdp_options.setdefault("reshard_after_forward", False)
        shard_blocks(model, mesh.dp_mesh, block_classes=[Block], **fsdp_options)
    return model
