"""A transformers CausalLM cut into pipeline stages: each a copy of the model with the other stages' parts
standing in (the stand-ins below), so a stage runs the model's own forward.

By the split the model declares (``_pp_plan``: embed_tokens / layers / norm, then lm_head outside the base
model) or, where it declares none (GPT-2), the split found in it (the base model ``base_model_prefix``
names, its ModuleList of blocks, its modules before and after them, the head). A stage is a copy of the
full model, so parameter names stay as one process has them (``model.layers.3.mlp.up_proj.weight``).

What stands in for what other stages hold: ``Skipped`` takes the place of another stage's block at its
index, so the model's own forward still walks every block (per-layer config by position stays right) while
the hidden states pass through; ``BlockOutput`` is what a stage's blocks return beside the hidden states,
learnt once; ``Elsewhere`` stands in for what the first stage runs before the blocks (embeddings), and
``FeedFirstBlock`` hands a later stage's input to its first block as it is.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from torch import nn

from ...errors import UsageError
from ...runtime import compat
from ..auto import block_stack, has_params


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


def _found_split(model: nn.Module) -> tuple[str, str, list[str], list[str], list[str], str] | None:
    """A transformers CausalLM that declares no ``_pp_plan`` (GPT-2 declares none in transformers 5.24):
    its base model is the child ``base_model_prefix`` names, whose forward takes ``inputs_embeds``; its
    blocks the model's stack (``auto.block_stack``), a ModuleList child of the base; before and after them the base's
    children registered before and after it that hold parameters (wte, wpe; ln_f), and the head the
    model's other children that hold parameters (lm_head). Parameterless children (dropout, rotary
    embeddings) stay on every stage: the base calls them wherever it runs."""
    import inspect

    from ...runtime.compat import direct_child

    prefix = getattr(model, "base_model_prefix", "")
    base = direct_child(model, prefix) if isinstance(prefix, str) and prefix else None
    if base is None:
        return None
    try:
        takes_embeds = "inputs_embeds" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        takes_embeds = False
    stack = block_stack(model)
    children = list(base.named_children())
    at = next((k for k, (_, c) in enumerate(children) if stack and c is stack[1]), None)
    if not takes_embeds or at is None or not isinstance(children[at][1], nn.ModuleList):
        return None
    before = [f"{prefix}.{n}" for n, c in children[:at] if has_params(c)]
    inner_after = [f"{prefix}.{n}" for n, c in children[at + 1:] if has_params(c)]
    after = [n for n, c in model.named_children() if n != prefix and has_params(c)]
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


# -- the stand-ins ---------------------------------------------------------------------------------------

class BlockOutput:
    """What a stage's blocks return beside the hidden states (``()`` for the hidden states alone), learnt from
    the first block that runs on the stage, real or a stand-in's meta copy, and shared by the stage's stand-ins.

    A forward hook on each block the stage holds checks the real output against what the stand-ins
    returned: a block that hands the next more than the hidden states (a tensor beside them) cannot be cut
    after, and a stand-in that had to assume the hidden states alone (its meta copy could not run: MoE
    routing is data-dependent) and was wrong is refused too, both in one line at the first step."""

    def __init__(self) -> None:
        self.extra: tuple | None = None
        self.assumed = False

    def learn(self, what: str, out: Any) -> tuple:
        if isinstance(out, torch.Tensor):
            extra: tuple = ()
        elif isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            carried = [type(t).__name__ for t in out[1:] if t is not None]
            if carried:
                raise UsageError(f"{what} returns {', '.join(carried)} beside the hidden states, which the next block "
                                 "takes, but a pipeline stage passes on the hidden states only; use pp=1 for this model")
            extra = tuple(out[1:])
        else:
            raise UsageError(f"{what} returns {type(out).__name__}, not the hidden states (a tensor, or a tuple "
                             "starting with them), so a pipeline stage cannot pass over it; use pp=1")
        if self.assumed and extra:
            raise UsageError(f"{what} returns a tuple of {1 + len(extra)} where the blocks of other stages were taken "
                             "to return the hidden states alone (their meta copies could not run); use pp=1 for "
                             "this model")
        if self.extra is None:
            self.extra = extra
        return self.extra

    def hook(self, module: nn.Module, args: Any, out: Any) -> None:
        self.learn(type(module).__name__, out)


class Skipped(nn.Module):
    """Where another stage's block sits in this stage's copy of the model: the hidden states pass through
    unchanged, and none of the block's parameters stay.

    Why a stand-in rather than a shorter list of blocks: the model's own forward still walks every block
    by its index (Gemma-2 picks each layer's mask by ``config.layer_types[i]``), so each held block runs
    at the position one process runs it at. What the block returns beside the hidden states is the
    stage's ``BlockOutput``, learnt on a meta copy of the block (no memory) when no block ran before."""

    def __init__(self, block: nn.Module, index: int, output: BlockOutput) -> None:
        super().__init__()
        object.__setattr__(self, "meta", meta_copy(block))  # plain attributes: nothing registered
        object.__setattr__(self, "output", output)
        self.index, self.what = index, type(block).__name__

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x = args[0] if args else kwargs["hidden_states"]
        extra = self.output.extra
        if extra is None:
            try:
                extra = self.output.learn(self.what, self.meta(*to_meta(args), **to_meta(kwargs)))
            except (NotImplementedError, RuntimeError):  # a data-dependent op (MoE routing's nonzero) on meta
                self.output.assumed, self.output.extra = True, ()
                extra = ()
        return (x, *extra) if extra else x

    def __getattr__(self, name: str) -> Any:
        """The block's own attributes, from its meta copy (no memory): Dory's model reads
        ``layer.attention_type`` of every layer, RWKV's rescales every block's weights in place when it
        changes mode (a no-op on meta). Nothing is registered: the stage holds none of them."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["meta"], name)

    def extra_repr(self) -> str:
        return f"{self.what} {self.index} on another stage"


def meta_copy(module: nn.Module) -> nn.Module:
    """``module`` with its parameters and buffers on the meta device (no memory), the module itself untouched."""
    memo: dict[int, Any] = {id(t): (nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad)
                                    if isinstance(t, nn.Parameter) else torch.empty_like(t, device="meta"))
                            for t in [*module.parameters(), *module.buffers()]}
    return copy.deepcopy(module, memo)


def to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (tuple, list)):
        return type(value)(to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: to_meta(v) for k, v in value.items()}
    return value


class Elsewhere(nn.Module):
    """On a non-first stage, what stands in for a module the first stage runs before the blocks (GPT-2's
    position embedding): zeros shaped as its output (computed on a meta copy), none of its parameters,
    so the base model's forward still runs there and its parameters live on the first stage only. What
    it returns never reaches the blocks (``FeedFirstBlock``)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "meta", meta_copy(module))  # a plain attribute: nothing registered
        self.what = type(module).__name__

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        device = next((a.device for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)), None)
        out = self.meta(*to_meta(args), **to_meta(kwargs))

        def zeros(t: Any) -> Any:
            return torch.zeros(t.shape, dtype=t.dtype, device=device) if isinstance(t, torch.Tensor) else t

        return type(out)(zeros(t) for t in out) if isinstance(out, (tuple, list)) else zeros(out)

    def extra_repr(self) -> str:
        return f"{self.what} on the first stage"


class FeedFirstBlock:
    """A forward pre-hook on a non-first stage's first block: the hidden states the stage received enter
    it as they are.

    Why: a base model given ``inputs_embeds`` still runs what it runs before its blocks on them (GPT-2
    adds the position embedding and applies the embedding dropout again; Llama passes them through).
    All of that is the first stage's, done once there, so every later stage feeds its input past it,
    the one rule for every CausalLM, while the base's forward still builds what the blocks take beside
    the hidden states (the causal mask, position ids, rotary embeddings)."""

    def __init__(self) -> None:
        self.x: torch.Tensor | None = None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.x is None:
            return None
        if args:
            return (self.x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self.x}
