"""Context parallelism: each of ``cp`` ranks holds a load-balanced share of every sequence.

The cp ranks of a data-parallel rank read the same samples. The parallelized model takes the whole
sequences (``input_ids``, optional ``position_ids``) and keeps this rank's share of them: the sequence cut
into 2 x cp chunks, rank r holding chunks r and 2cp - 1 - r (head-tail, so under causal attention every
rank has the same work: torchtitan's and Megatron's balance). Everything but attention is per token, so it
runs on the share as it is; RoPE reads the tokens' original positions (the share of ``position_ids``).

Attention needs the whole sequence. Around it, an all-to-all trades the sequence split for a head split
(DeepSpeed's Ulysses): every rank gets heads/cp heads of the whole sequence, back in its original order,
runs the model's own attention (eager or SDPA, transformers' attention interface) under the same mask one
process builds (causal, documents packed by ``position_ids`` restarting, a sliding window), and a second
all-to-all takes the output back to the share. It runs on any kernel and on gloo; the query heads each
tensor-parallel rank holds must divide by cp (KV heads it does not divide are repeated per query head). On
CUDA, causal SDPA calls go to PyTorch's own ring attention instead (``_ring``).

The logits come out in the share's token order: ``mg.context_share(model, labels)`` is the labels'
share in that order, so a per-token loss pairs up; ``labels=`` (the model's own loss) is shifted on the
whole sequence first. ``mg.token_divisor`` counts every rank's targets, so
the summed loss over it is exact; a mean loss per rank is exact when every share counts alike.
Parameters are not split by cp: FSDP shards them over (dp_shard, cp) and averages the gradients there.

A user's own model (not transformers) takes the same path through its ``F.scaled_dot_product_attention``
calls (``context_sdpa.py``), under the mask its call asks for (causal, across packed documents as on one
process). Either way ``mg.parallelize`` checks the whole model on a probe batch first (``context_probe.py``):
a forward under cp that fails or differs from the model's own is refused in one line, and packed documents
that differ are refused at the forward by one check both paths make (``Context.begin``). What a refusal
suggests (a cp degree, a sequence length) is computed by the rule that refused (``check_heads``,
``length_refusal``), so the same command accepts it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import weakref
from typing import Any

import torch
from torch import nn

from ..errors import UsageError
from .context_sdpa import batch_and_length, repeated_kv

NAME = "multigpu_context_parallel"  # the attention implementations registered with transformers: NAME_<n>
_NAMES = itertools.count()


# `multigpu verify`'s likely cause of a step-0 difference on packed documents under cp (verify._causes)
DOCUMENTS_CAUSE = ("the loss of step 0 differs with the same model and samples, on packed documents (position_ids "
                   "restarting) under context parallelism: the document mask differs (attention under cp keeps each "
                   "document apart by transformers' rule; the model on one process may not), or the loss is averaged "
                   "per cp rank while the shares count different targets (sum it and divide by mg.token_divisor of "
                   "the shares; docs/context.md)")


def share_index(seq: int, cp: int, rank: int) -> torch.Tensor:
    """The positions of the sequence that ``rank`` of ``cp`` holds: chunks rank and 2cp - 1 - rank of 2cp."""
    chunk = seq // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def length_refusal(seq: int, cp: int) -> str | None:
    """Why sequences of ``seq`` tokens cannot be cut into cp shares (None: they can), with the lengths nearest
    ``seq`` that can, found by the same rule: 2 x cp equal chunks."""
    def fits(n: int) -> bool:
        return n > 0 and n % (2 * cp) == 0

    if fits(seq):
        return None
    lengths = [n for n in (next((n for n in range(seq, 0, -1) if fits(n)), None),
                           next(n for n in range(seq, seq + 2 * cp + 1) if fits(n))) if n is not None]
    return (f"2 x cp = {2 * cp} equal chunks, but the sequence has {seq} tokens; pad or pack the sequences to a "
            f"multiple of {2 * cp} ({' or '.join(map(str, lengths))} tokens)")


class Context:
    """One parallelized model's context parallelism: its group and, for the forward under way, where its
    share sits in the sequence and which tokens may see which."""

    def __init__(self, model: nn.Module, cp: int, rank: int, group: Any, inner: str) -> None:
        self.cp, self.rank, self.group, self.inner = cp, rank, group, inner
        self.name = type(model).__name__
        self.layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
        self.seq = 0
        self.docs: torch.Tensor | None = None  # (B, S) document of each token, None when one per row
        self.calls = 0
        self.no_documents: str | None = None  # why packed documents are refused (the probe's finding)
        self.no_labels: str | None = None  # why labels= (the model's own loss) is refused (the probe's finding)
        self.packed = False  # whether a forward since the probe took packed documents (verify's likely cause)
        self.ring, self.mesh = False, None  # PyTorch's ring attention for causal SDPA on CUDA (_ring)
        self._orders: dict[tuple, tuple[torch.Tensor, ...]] = {}  # (length, device) -> index, order, restore
        self.signature = inspect.signature(model.forward)  # read once: every forward binds its arguments by it
        self.suspended = False  # the model's own forward, unsplit (``suspended``: a loaded model's probe)

    # -- the share ----------------------------------------------------------------------------------
    def begin(self, seq: int, positions: torch.Tensor) -> torch.Tensor:
        """Start a forward over sequences of ``seq`` tokens at ``positions`` (B, S); this rank's index."""
        if why := length_refusal(seq, self.cp):
            raise UsageError(f"context parallelism cuts each sequence of {self.name} into {why}")
        self.seq, self.calls = seq, 0
        # transformers' rule for packed documents (masking_utils.find_packed_sequence_indices): a new one
        # starts wherever the position does not follow the previous one.
        step = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
        docs = (step != 1).cumsum(-1)
        self.docs = docs if bool((docs != docs[:, :1]).any()) else None
        self.packed |= self.docs is not None
        # Both paths' one check of packed documents: what the probe found them to give (context_probe.py)
        if self.docs is not None and self.no_documents:
            raise UsageError(f"context parallelism does not give {self.name} packed documents (position_ids "
                             f"restarting) as one process computes them ({self.no_documents}); give it whole "
                             "sequences, or use cp=1")
        key = (seq, positions.device)
        if key not in self._orders:  # a run's sequences mostly share one length: built once for it
            order = torch.cat([share_index(seq, self.cp, r) for r in range(self.cp)]).to(positions.device)
            self._orders[key] = share_index(seq, self.cp, self.rank).to(positions.device), order, torch.argsort(order)
        self.index, self.order, self.restore = self._orders[key]  # this rank's; gathered -> original and back
        return self.index

    # -- around attention ---------------------------------------------------------------------------
    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, s, D), this rank's share of every head -> (B, H/cp, S, D), its heads over the whole sequence."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        b, h, s, d = x.shape
        x = x.reshape(b, self.cp, h // self.cp, s, d).transpose(0, 1).contiguous()  # piece j goes to rank j
        x = all_to_all_single_autograd(x, None, None, self.group)  # piece j came from rank j: its share
        # (B, S, H/cp, D) in order, then viewed as (B, H/cp, S, D): the strides one process's attention gets
        # from its (B, S, H, D) projection, so a kernel that picks its path by layout picks the same one
        # (GPT-J computes its scores in float32: another path rounds differently).
        x = x.permute(1, 0, 3, 2, 4).reshape(b, self.cp * s, h // self.cp, d)
        return x.index_select(1, self.restore).transpose(1, 2)

    def to_share(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, H/cp, D), the attention output of this rank's heads -> (B, s, H, D), every head of its share."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        b, seq, h, d = x.shape
        x = x.index_select(1, self.order).reshape(b, self.cp, seq // self.cp, h, d).transpose(0, 1).contiguous()
        x = all_to_all_single_autograd(x, None, None, self.group)  # piece j: rank j's heads of this share
        return x.permute(1, 2, 0, 3, 4).reshape(b, seq // self.cp, self.cp * h, d)

    def mask(self, like: torch.Tensor, window: int | None) -> torch.Tensor:
        """(B, 1, S, S) True where a token may attend: causal, within its document and the sliding window."""
        i = torch.arange(self.seq, device=like.device)
        allowed = i[None, :] <= i[:, None]
        if window is not None:
            allowed = allowed & (i[None, :] > i[:, None] - window)
        allowed = allowed[None, None]
        if self.docs is not None:
            allowed = allowed & (self.docs[:, None, :, None] == self.docs[:, None, None, :])
        return allowed


class _Ungrouped:
    """An attention module as its attention function sees it with its KV heads already repeated per query head."""

    def __init__(self, module: nn.Module) -> None:
        self.__dict__["_module"] = module

    num_key_value_groups = 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)


def _attention(ctx: "Context", module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface under context parallelism (registered per model, ``ctx`` bound):
    the model's own attention (``inner``) over the whole sequence for heads/cp heads, between the two
    all-to-alls."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ctx.calls += 1
    if ctx.inner == "eager":  # the family's own eager attention, beside its module
        import sys

        inner = sys.modules[type(module).__module__].eager_attention_forward
    else:
        inner = ALL_ATTENTION_FUNCTIONS[ctx.inner]
    window = kwargs.pop("sliding_window", None)
    causal = ctx.inner == "sdpa" and window is None and ctx.docs is None  # the kernel's is_causal, no mask
    if causal and ctx.ring:
        return _ring(ctx, query, key, value, kwargs), None
    if key.shape[1] % ctx.cp:  # fewer KV heads than cp splits: each query head gets its own copy
        key, value = repeated_kv(query, key, value)
        module = _Ungrouped(module)
    q, k, v = (ctx.to_heads(t) for t in (query, key, value))
    mask = None if causal else ctx.mask(q, window)
    if ctx.inner == "eager":  # an additive mask, as transformers' eager_mask builds it
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, torch.finfo(q.dtype).min)
    out, _ = inner(module, q, k, v, mask, **kwargs)
    return ctx.to_share(out), None


def _ring(ctx: "Context", query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """Causal SDPA on CUDA by PyTorch's own ring attention (``context_parallel``'s dispatcher: each rank's
    query share meets every rank's keys in turn, merged by log-sum-exp; its head-tail balance is this
    module's share). The shares go in as DTensors sharded on the sequence; (B, s, H, D) comes out."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Shard

    if key.shape[1] != query.shape[1]:  # grouped-query attention: the ring kernels take equal head counts
        key, value = repeated_kv(query, key, value)
    q, k, v = (DTensor.from_local(t.contiguous(), ctx.mesh, [Shard(2)], run_check=False) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=kwargs.get("dropout", 0.0), is_causal=True,
                                         scale=kwargs.get("scaling"))
    return out.to_local().transpose(1, 2)


def _before(ctx: "Context", model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The model's forward gets this rank's share of the sequences it was given."""
    if ctx.suspended:
        return args, kwargs
    bound = ctx.signature.bind_partial(*args, **kwargs)
    given = dict(bound.arguments)
    given.update(given.pop("kwargs", {}))
    if given.get("past_key_values") is not None:
        raise UsageError(f"context parallelism gives {ctx.name} a share of each sequence; past_key_values= is not "
                         "taken under it: generate without cp")
    if given.get("labels") is not None and ctx.no_labels:
        raise UsageError(f"context parallelism does not give {ctx.name}'s own loss of labels= as one process computes it "
                         f"({ctx.no_labels}); compute the loss from the logits against mg.context_share(model, y)")
    mask = given.pop("attention_mask", None)
    if mask is not None and not bool(mask.all()):
        raise UsageError(f"context parallelism takes causal attention over whole or packed sequences, but {ctx.name} "
                         "got an attention_mask with padding; pack the documents (position_ids restarting at 0 "
                         "mark them) and leave attention_mask out")
    tokens = given.get("input_ids")
    if tokens is None:
        tokens = given.get("inputs_embeds")
    if tokens is None:
        raise UsageError(f"context parallelism needs input_ids or inputs_embeds of {ctx.name}, got neither")
    b, seq = batch_and_length(tokens, ctx.name)
    positions = given.get("position_ids")
    if positions is None:
        positions = torch.arange(seq, device=tokens.device)
    positions = positions.expand(b, seq)
    index = ctx.begin(seq, positions)  # packed documents refused there where the probe found them apart
    for name in ("input_ids", "inputs_embeds"):
        if given.get(name) is not None:
            given[name] = given[name].index_select(1, index)
    given["position_ids"] = positions.index_select(1, index)
    if given.get("labels") is not None:
        _share_labels(ctx, given, index)
    given["use_cache"] = False  # a cache of one share's keys is nothing generation could use
    return (), given


def _share_labels(ctx: Context, given: dict[str, Any], index: torch.Tensor) -> None:
    """``labels=``: the model's own loss over this rank's share. transformers shifts the labels inside its loss,
    which a share cannot (its next token may be on another rank): they are shifted here, on the whole
    sequence, and passed as ``shift_labels``. Its mean would be over this share's targets; the divisor is
    the whole sequences' count over cp instead, so the cp ranks' average is one process's mean."""
    labels = given["labels"]
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    given["labels"] = given["shift_labels"] = shifted.index_select(1, index)
    count = given.get("num_items_in_batch")
    if count is None:
        count = (shifted != -100).sum().clamp(min=1)
    given["num_items_in_batch"] = count / ctx.cp


def _after(ctx: "Context", model: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    if ctx.suspended:
        return output
    expected = ctx.layers or 1
    if ctx.calls < expected:
        raise UsageError(f"context parallelism saw {ctx.calls} of {ctx.name}'s {expected} attention layers call "
                         "transformers' attention interface; the others would attend within a share only: use cp=1")
    return output


def check(model: nn.Module, layout: Any, heads: dict[str, int]) -> None:
    """Refuse in one line what context parallelism cannot split exactly (before any step changes the model)."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    inner = getattr(config, "_attn_implementation", None)
    if config is None:  # a user's own model: its F.scaled_dot_product_attention calls (context_sdpa.py)
        from . import context_sdpa

        context_sdpa.check(model, layout)
        heads = {}
    elif inner not in ("eager", "sdpa"):
        what = f"its attention implementation is {inner!r}"
        raise UsageError(f"context parallelism wraps a transformers model's eager or SDPA attention, but {what} "
                         f"({name}); load it with attn_implementation='sdpa' or 'eager', or use cp=1")
    if config is not None and (getattr(config, "is_encoder_decoder", False)
                               or any(getattr(m, "is_causal", True) is False for m in model.modules())):
        raise UsageError(f"context parallelism is built for causal attention; {name} has bidirectional attention: "
                         "use cp=1")
    if heads.get("attention heads"):  # from the config; a user's own model's are counted on its probe batch
        check_heads(name, layout, [heads["attention heads"] // layout.tp])


def check_heads(name: str, layout: Any, local: list[int]) -> None:
    """Refuse a cp that does not divide the query heads each tensor-parallel rank holds (``local``; KV heads
    cp does not divide are repeated per query head), naming the cp degrees that the same ranks take: this
    rule and the world's (``Layout.resolve``, dp_shard taking the rest), so each is one the command accepts."""
    import dataclasses

    def problem(cp: int) -> list[int]:
        return [h for h in local if h % cp]

    def takes(cp: int) -> bool:
        try:
            dataclasses.replace(layout, cp=cp, dp_shard=None).resolve(layout.world_size).built()
        except UsageError:
            return False
        return not problem(cp)

    if bad := problem(layout.cp):
        fits = [d for d in range(1, layout.world_size + 1) if takes(d)]
        raise UsageError(f"context parallelism trades the sequence for the heads: cp {layout.cp} must divide the "
                         f"attention heads {' and '.join(map(str, sorted(set(bad))))} each tensor-parallel rank holds "
                         f"of {name}; use {'cp=1' if fits == [1] else 'cp in ' + ', '.join(map(str, fits))}")


def apply(model: nn.Module, layout: Any, mesh: Any) -> tuple["Context", str]:
    """Spread every sequence ``model`` is given over the cp ranks of ``mesh`` (``check``ed first); its
    ``Context`` (the model's record keeps it: ``spreads.py``) and what was done, for ``mg.parallelize``'s line."""
    config = getattr(model, "config", None)
    if config is None:  # a user's own model
        from . import context_sdpa

        ctx = Context(model, layout.cp, mesh.get_local_rank(), mesh.get_group(), "sdpa")
        context_sdpa.apply(model, ctx)
        return ctx, (f"context parallel {layout.cp}: each sequence in {2 * layout.cp} chunks, head-tail; its "
                     "F.scaled_dot_product_attention between all-to-alls over heads")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = config._attn_implementation
    ctx = Context(model, layout.cp, mesh.get_local_rank(), mesh.get_group(), inner)
    ctx.mesh, ctx.ring = mesh, inner == "sdpa" and mesh.device_type == "cuda" and _ring_dispatcher()
    # transformers' own extension point: an attention implementation by name, this model's Context bound
    # to it (its attention modules read the name from the config they share, in the forward and in an
    # activation-checkpointing recompute alike); dropped with the model.
    name = f"{NAME}_{next(_NAMES)}"
    ALL_ATTENTION_FUNCTIONS[name] = functools.partial(_attention, ctx)
    weakref.finalize(model, ALL_ATTENTION_FUNCTIONS.__delitem__, name)
    config._attn_implementation = name
    model.register_forward_pre_hook(functools.partial(_before, ctx), with_kwargs=True)
    model.register_forward_hook(functools.partial(_after, ctx), with_kwargs=True)
    how = "causal SDPA by PyTorch's ring attention, else " if ctx.ring else ""
    return ctx, (f"context parallel {layout.cp}: each sequence in {2 * layout.cp} chunks, head-tail; {how}{inner} "
                 f"attention between all-to-alls over heads")


@contextlib.contextmanager
def suspended(model: nn.Module, ctx: Context):
    """A transformers ``model`` under context parallelism running its own forward on whole sequences, as before
    ``apply``: the unsplit output a model loaded onto the layout (no process holding it whole) is probed against."""
    config = model.config
    name, config._attn_implementation, ctx.suspended = config._attn_implementation, ctx.inner, True
    try:
        yield
    finally:
        config._attn_implementation, ctx.suspended = name, False


def _ring_dispatcher() -> bool:
    """Turn on PyTorch's context-parallel SDPA dispatch for DTensors (a prototype API: False where this
    torch has none, and the all-to-all path serves)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _enable_context_parallel_dispatcher)
    except ImportError:
        return False
    _enable_context_parallel_dispatcher()
    return True


def context_share(model: nn.Module, *tensors: torch.Tensor, dim: int = 1) -> Any:
    """This rank's share of per-token ``tensors`` (the labels; the sequence along ``dim``), in the order
    ``model``'s outputs come; the tensors themselves when ``model`` is not context-parallel.

    >>> logits = model(input_ids=x).logits
    >>> y = mg.context_share(model, y)
    """
    from ..spreads import spread_of

    spread = spread_of(model)
    ctx = None if spread is None else spread.context
    if ctx is None:
        return tensors[0] if len(tensors) == 1 else tensors
    out = []
    for t in tensors:
        if why := length_refusal(t.shape[dim], ctx.cp):
            raise UsageError(f"context_share cuts the sequence (dim {dim}) of a tensor of shape {tuple(t.shape)} into "
                             f"{why}, or give context_share the sequence's dim=")
        out.append(t.index_select(dim, share_index(t.shape[dim], ctx.cp, ctx.rank).to(t.device)))
    return out[0] if len(out) == 1 else tuple(out)
