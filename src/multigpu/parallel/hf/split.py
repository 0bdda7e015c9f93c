"""A transformers CausalLM cut into pipeline stages: each a copy of the model with the other stages' parts
standing in (``standins.py``), so a stage runs the model's own forward.

By the split the model declares (``_pp_plan``: embed_tokens / layers / norm, then lm_head outside the base
model) or, where it declares none (GPT-2), the split found in it (the base model ``base_model_prefix``
names, its ModuleList of blocks, its modules before and after them, the head). A stage is a copy of the
full model, so parameter names stay as one process has them (``model.layers.3.mlp.up_proj.weight``).
"""

from __future__ import annotations

import copy
import functools
from torch import nn

from ...runtime import compat
from .standins import BlockOutput, Elsewhere, FeedFirstBlock, Skipped


def causal_lm_split(model: nn.Module) -> tuple[str, str, list[str], list[str], list[str], str] | None:
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

    from ...runtime.compat import direct_child
    from ..auto import blocks_of

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


def causal_lm_stage(model: nn.Module, found: tuple, ranges: list[range], i: int, share: bool = False) -> nn.Module:
    """Stage ``i`` of ``model`` cut by ``found`` (``causal_lm_split``) into ``ranges`` of blocks: a copy of the
    model; ``share``: the copy holds the model's own tensors (for the stages' probe). Tied parameters (GPT-2's
    head and token table) stay tied within a stage; a stage that uses one of the names holds a copy of its
    own, kept equal to the others by the ``Pipeline`` (``tied.py``)."""
    base, blocks_name, before, inner_after, after, _ = found
    part = copy.deepcopy(model, {id(t): t for t in (*model.parameters(), *model.buffers())} if share else None)
    held = part.get_submodule(blocks_name)
    output = BlockOutput()
    for j in range(len(held)):  # the other stages' blocks: stand-ins at their indices
        if j in ranges[i]:
            held[j].register_forward_hook(output.hook)
        else:
            held[j] = Skipped(held[j], j, output)
    first, last = i == 0, i == len(ranges) - 1
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
