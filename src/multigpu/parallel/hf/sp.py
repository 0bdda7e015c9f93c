"""Sequence parallelism derived from a tensor-parallel plan (the one a model declares, or the one found in it).

Megatron-LM's and torchtitan's layout, from PyTorch's own styles only: between
the sub-layers the residual stream is split along the sequence (``Shard(1)``,
each TP rank holding ``seq / tp`` tokens), the norms run on their share
(``SequenceParallel``), each sub-layer gathers the sequence before its
column-wise projections (``PrepareModuleInput``: one all-gather) and its
row-wise projection reduce-scatters back to the split stream
(``RowwiseParallel(output_layouts=Shard(1))``, instead of TP's all-reduce).

Where the split starts and ends:

- At the **first block's input**, not at the embedding's output (torchtitan's
  ``tok_embeddings`` ``output_layouts=Shard(1)``): a transformers base model
  computes its causal mask, ``cache_position``/position ids and the rotary
  embeddings from the embedding output's sequence length, and passes them whole
  to every layer; split there, they would be built for ``seq / tp`` tokens. So
  the embedding (replicated, or row-wise with a replicated output) and what the
  base model computes from it stay whole, and the first block's hidden states
  are split on entry (``PrepareModuleInput`` Replicate -> Shard(1)). The
  attention then sees the whole sequence (gathered), with the whole mask and
  rotary tables the base model passed it.
- At the end: the final norm (a norm registered after the blocks beside their
  container) runs on the split stream and the head, column-wise in the plan,
  gathers it (``ColwiseParallel(input_layouts=Shard(1))``); a model without both
  (the plan found in a plain module's blocks has no head) is gathered at the last
  block's output (``PrepareModuleOutput`` Shard(1) -> Replicate) and runs the
  rest as under TP.

Inside a block, the column-wise projections' parent (an attention or MLP module
with its own forward) gathers its first input, passed by position or by name
(transformers calls ``self_attn(hidden_states=...)`` and ``mlp(hidden_states)``),
and reads its shapes from the gathered input. A parent that is only a container
(no forward of its own: the block calls the projections, as ``tests/_hf_layouts.py``'s
TinyLM does) is refused: such a block takes ``b, t`` from the split stream and
would view the gathered projections by them.
Norms in a block take ``SequenceParallel``: their weights are replicated
DTensors, so each rank's gradient share is summed by DTensor, never by a hook.
A block holding any other module with parameters (or parameters of its own)
outside the sub-layers is refused: on the split stream its gradient would be
one rank's share. Qwen3's per-head ``q_norm``/``k_norm`` stay
``tp.headwise_replicated`` (they run inside the attention, after the gather).
The sequence length must divide by ``tp``: checked on every forward at the
first block (the length is known only then), refused in one line.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ...errors import UsageError
from ...runtime import compat

SP_STYLES = ("SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput")


def spells_sequence_parallel(styles: dict[str, Any]) -> bool:
    """Whether a plan already says how the sequence is split (the GPT recipe's, a user's own)."""
    return any(type(s).__name__ in SP_STYLES or isinstance(s, compat.first_input_style_type()) for s in styles.values())


def is_norm(module: nn.Module) -> bool:
    """A per-token norm over the hidden features (LayerNorm, RMSNorm, transformers' *RMSNorm / *LayerNorm)."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _first_arg_name(module: nn.Module) -> str | None:
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    if params and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return params[0].name if params[0].kind == inspect.Parameter.POSITIONAL_OR_KEYWORD else None
    return None


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def stream_input(name: str | None, src: Any, dst: Any, check: str | None = None, gather_output: bool = False):
    """``PrepareModuleInput`` for a module's first input only, passed by position or by its name (the
    other inputs, e.g. transformers' attention mask and rotary tables, pass through as they are);
    ``check``: refuse a sequence length ``tp`` does not divide (the first block's split), naming that model;
    ``gather_output``: the module's output gathered whole after it (the last block's)."""
    def refuse_uneven(input: Any, mesh: Any) -> None:
        if isinstance(input, torch.Tensor) and input.dim() >= 2:
            from ..layout import Layout

            tp, seq = mesh.size(), input.shape[1]
            try:
                Layout(tp=tp, sequence_parallel=True).check_sizes(seq=seq, model=check)
            except UsageError:
                raise UsageError(f"sequence parallelism splits each sequence of {check} over {tp} tensor-parallel "
                                 f"ranks, but this batch's sequence length {seq} does not divide by {tp}; make it a "
                                 f"multiple of {tp} (pad or cut it), or drop sequence_parallel") from None

    return compat.first_input_style(name, src, dst, check=refuse_uneven if check else None,
                                    then=_gather_output() if gather_output else None)


def _gather_output():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput

    style = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True)
    style.label = "PrepareModuleOutput(Shard(1) -> Replicate)"
    return style


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def sequence_parallel_plan(model: nn.Module, blocks: list[tuple[str, nn.Module]],
                           styles: dict[str, Any]) -> dict[str, Any]:
    """The sequence-parallel plan derived from ``styles`` (a tensor-parallel plan of torch styles, names expanded)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    name = type(model).__name__
    if not blocks:
        raise UsageError(f"sequence parallelism splits the stream between {name}'s blocks, but it has no repeated "
                         "blocks (none declared, no container of one class); pass block_classes=[YourBlock], or "
                         "drop sequence_parallel")
    for key, style in styles.items():
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)) and type(style).__name__ != "HeadwiseReplicated":
            what = getattr(style, "label", None) or type(style).__name__
            raise UsageError(f"sequence parallelism is derived from ColwiseParallel / RowwiseParallel plans, but the "
                             f"plan gives {key} {what}, which takes no sequence-split input (GPT-2's Conv1D styles "
                             "among them); drop sequence_parallel (tensor parallelism alone applies), or pass your own "
                             "tp_plan with SequenceParallel styles")

    containers = sorted({b.rpartition(".")[0] for b, _ in blocks})
    if len(containers) != 1:
        raise UsageError(f"sequence parallelism splits the stream through one chain of blocks, but {name}'s blocks "
                         f"sit in {', '.join(c or '(root)' for c in containers)}; drop sequence_parallel, or pass "
                         "your own tp_plan with SequenceParallel styles")
    plan = dict(styles)
    for b, block in blocks:
        inner = {k: s for k, s in styles.items() if _under(k, b) and k != b}
        if b in styles:
            raise UsageError(f"the tensor-parallel plan shards the block {b} itself; sequence parallelism needs "
                             "the projections inside the blocks: name those, or drop sequence_parallel")
        gathered: list[str] = []  # sub-layers whose first input is gathered
        for key, style in inner.items():
            if isinstance(style, RowwiseParallel):
                # Reduce-scatter back to the split stream instead of TP's all-reduce.
                plan[key] = RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=Shard(1),
                                            use_local_output=style.use_local_output)
            elif isinstance(style, ColwiseParallel):
                parent = key.rpartition(".")[0]
                owner = model.get_submodule(parent)
                if parent != b and _has_forward(owner):
                    if parent in styles:
                        raise UsageError(f"the tensor-parallel plan gives {parent} a style and its projections too; "
                                         "drop one, or drop sequence_parallel")
                    if parent not in gathered:
                        gathered.append(parent)
                        plan[parent] = stream_input(_first_arg_name(owner), Shard(1), Replicate())
                else:
                    # A plain container (or the block itself) leaves the block to call the projections: it may
                    # read the sequence length from the split stream (TinyLM's view(b, t, ...)) and apply it
                    # after the gather.
                    where = (f"{parent} is a plain container (no forward of its own)" if parent != b
                             else f"{b} calls it itself")
                    raise UsageError(f"sequence parallelism gathers the sequence at each sub-layer's input, but {key} "
                                     f"of {name} has no sub-layer module: {where}, so the block may shape the gathered "
                                     "sequence by its split length; give the attention and MLP modules a forward "
                                     "(as transformers' models do), or pass your own tp_plan with SequenceParallel "
                                     "styles, or drop sequence_parallel")
        covered = gathered + list(inner)
        for sub, module in block.named_modules(prefix=b):
            if sub == b or any(_under(sub, c) for c in covered):
                continue
            if is_norm(module):
                plan[sub] = SequenceParallel(use_local_output=True)
                covered.append(sub)
            elif any(True for _ in module.parameters(recurse=False)):
                raise UsageError(f"sequence parallelism would run {sub} ({type(module).__name__}) of {name} on each "
                                 "rank's share of the sequence, but it is neither a norm nor in the tensor-parallel "
                                 "plan, so its gradient would be one rank's share; drop sequence_parallel, or pass "
                                 "your own tp_plan with SequenceParallel styles")
        if any(True for _ in block.parameters(recurse=False)):
            raise UsageError(f"sequence parallelism would run {b}'s own parameters ({type(block).__name__}) on each "
                             "rank's share of the sequence, outside any sub-layer; drop sequence_parallel, or pass "
                             "your own tp_plan with SequenceParallel styles")

    first_name, first = blocks[0]
    last_name, _ = blocks[-1]
    outside = {k: s for k, s in styles.items() if not any(_under(k, b) for b, _ in blocks)}
    heads = [k for k, s in outside.items() if isinstance(s, ColwiseParallel)]
    embeddings = [k for k, s in outside.items() if isinstance(s, RowwiseParallel)
                  and isinstance(model.get_submodule(k), nn.Embedding)]
    only_head = len(heads) == 1 and len(heads) + len(embeddings) == len(outside)
    final = _final_norm(model, containers[0]) if only_head else None
    # The split starts at the first block's input (why: the module docstring, the base model's mask and rotary tables).
    plan[first_name] = stream_input(_first_arg_name(first), Replicate(), Shard(1), check=name,
                                   gather_output=final is None and first_name == last_name)
    if final is not None:  # the final norm on the split stream, the head gathering it
        plan[final] = SequenceParallel(use_local_output=True)
        head = styles[heads[0]]
        plan[heads[0]] = ColwiseParallel(input_layouts=Shard(1), output_layouts=head.output_layouts[0],
                                         use_local_output=head.use_local_output)
    elif first_name != last_name:
        plan[last_name] = _gather_output()
    return plan


def _final_norm(model: nn.Module, container: str) -> str | None:
    """The one norm registered after the blocks' container in its parent (transformers' ``model.norm``), none
    before it (a norm on the embeddings, BLOOM's, would take a whole sequence as a split one)."""
    parent_name = container.rpartition(".")[0] if "." in container else ""
    leaf = container.rpartition(".")[2]
    parent = model.get_submodule(parent_name) if parent_name else model
    names = list(dict(parent.named_children()))
    if leaf not in names:
        return None
    after = [n for n in names[names.index(leaf) + 1:] if is_norm(getattr(parent, n))]
    before = [n for n in names[:names.index(leaf)] if is_norm(getattr(parent, n))]
    if len(after) != 1 or before:
        return None
    return f"{parent_name}.{after[0]}" if parent_name else after[0]
