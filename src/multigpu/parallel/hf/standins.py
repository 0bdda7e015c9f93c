"""What stands in, on a pipeline stage (a copy of the whole model), for what other stages hold.

``Skipped`` takes the place of another stage's block at its index, so the model's own forward still walks
every block (per-layer config by position stays right) while the hidden states pass through; ``BlockOutput``
is what a stage's blocks return beside the hidden states, learnt once; ``Elsewhere`` stands in for what the
first stage runs before the blocks (embeddings), and ``FeedFirstBlock`` hands a later stage's input to its
first block as it is.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ...errors import UsageError


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
