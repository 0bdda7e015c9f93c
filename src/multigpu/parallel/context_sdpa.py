"""Context parallelism for a user's own model: one that calls ``F.scaled_dot_product_attention``.

Also the helpers both paths share (the input's batch and length, KV heads repeated per query head).

The contract (docs/context.md): the model's forward takes the token ids (B, S) as its first argument and,
if its positions matter, a ``position_ids`` keyword (B, S) or (S,); its attention is causal SDPA
(``is_causal=True``, no ``attn_mask``). The parallelized forward gets this rank's share of the tokens and
their original positions; while it runs, a ``TorchFunctionMode`` takes every
``F.scaled_dot_product_attention`` call through the two all-to-alls over heads (``context.py``), under
the mask the call asks for: causal over the whole sequence. Packed documents (``position_ids``
restarting) change the positions the model reads, never that mask: one process's causal SDPA attends
across them, and so does the share's. A model whose positions come from elsewhere (``torch.arange`` of
its input length) computes something else under the shares: the probe batch ``mg.parallelize`` runs
first sees it and refuses the model in one line. Its query heads, counted on that probe batch on one
process (``Heads``), must divide by cp, the rule transformers models' heads are checked by
(``context.check_heads``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import UsageError


def batch_and_length(tokens: torch.Tensor, name: str) -> tuple[int, int]:
    """(batch, sequence length) of the tokens a forward got, or a one-line refusal of an unbatched input."""
    if tokens.dim() < 2:
        raise UsageError(f"context parallelism cuts {name}'s input along its sequence, dimension 1 of (batch, "
                         f"sequence), but got shape {tuple(tokens.shape)}; add the batch dimension (x[None])")
    return tokens.shape[0], tokens.shape[1]


def repeated_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``key`` and ``value`` (B, H_kv, s, D) with each KV head repeated for its query heads: (B, H, s, D)."""
    groups = query.shape[1] // key.shape[1]
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)


def first_input(model: nn.Module) -> str:
    """The name of the forward's first argument: the token ids."""
    params = [p for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not params or any(p.kind == p.VAR_POSITIONAL for p in inspect.signature(model.forward).parameters.values()):
        raise UsageError(f"context parallelism gives {type(model).__name__}'s forward a share of its token ids, its "
                         "first argument, but the forward takes none by position; use cp=1")
    return params[0].name


def takes_positions(model: nn.Module) -> bool:
    return "position_ids" in inspect.signature(model.forward).parameters


def check(model: nn.Module, layout: Any) -> None:
    name = type(model).__name__
    first_input(model)
    if layout.activation_checkpointing:  # the recompute runs outside the forward, where no mode catches SDPA
        raise UsageError(f"context parallelism on {name} (not a transformers model) with activation checkpointing is "
                         "not built yet: its recomputed attention would see one share; drop one of them")
    if not any(isinstance(m, nn.Embedding) for m in model.modules()):
        raise UsageError(f"context parallelism checks {name} on a probe batch of token ids first, but it has no "
                         "nn.Embedding to read their range from; use cp=1")


def probe_input(model: nn.Module, cp: int) -> dict[str, torch.Tensor]:
    """2 sequences of 16 x cp token ids below the first embedding's size, as the forward's first argument."""
    table = next(m for m in model.modules() if isinstance(m, nn.Embedding))
    device = table.weight.device
    g = torch.Generator().manual_seed(0)
    return {first_input(model): torch.randint(0, table.num_embeddings, (2, 16 * cp), generator=g).to(device)}


class Heads(TorchFunctionMode):
    """The query heads of each ``F.scaled_dot_product_attention`` call of a forward (one process's)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query = args[0] if args else kwargs.get("query")
            if isinstance(query, torch.Tensor) and query.dim() >= 3:
                self.counts.add(query.shape[-3])  # (B, H, S, D)
        return func(*args, **kwargs)


class _Attention(TorchFunctionMode):
    """Every ``F.scaled_dot_product_attention`` of the forward under way, between the all-to-alls."""

    def __init__(self, ctx: Any, name: str) -> None:
        super().__init__()
        self.ctx, self.name = ctx, name

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self.attend(*args, **kwargs)

    def attend(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
        ctx = self.ctx
        if attn_mask is not None or not is_causal:
            raise UsageError(f"context parallelism takes {self.name}'s scaled_dot_product_attention as causal "
                             f"(is_causal=True, no attn_mask), got {'an attn_mask' if attn_mask is not None else 'is_causal=False'}; "
                             "an attention mask of its own (documents, padding) is not built yet under cp: use cp=1")
        ctx.calls += 1
        if key.shape[1] % ctx.cp:  # fewer KV heads than cp splits: each query head gets its own copy
            key, value = repeated_kv(query, key, value)
            enable_gqa = False
        q, k, v = (ctx.to_heads(t) for t in (query, key, value))
        # the call's own mask, causal over the whole sequence: packed documents are no mask of the model's
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                             enable_gqa=enable_gqa)
        return ctx.to_share(out.transpose(1, 2)).transpose(1, 2)


def apply(model: nn.Module, ctx: Any) -> None:
    """Replace the forward on the instance (its parameter names stay): the share in, the mode around it."""
    inner, first, positional = model.forward, first_input(model), takes_positions(model)
    name, signature = type(model).__name__, inspect.signature(model.forward)

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        given = dict(signature.bind_partial(*args, **kwargs).arguments)
        given.update(given.pop("kwargs", {}))
        tokens = given[first]
        b, seq = batch_and_length(tokens, name)
        positions = given.get("position_ids")
        positions = (torch.arange(seq, device=tokens.device) if positions is None else positions).expand(b, seq)
        index = ctx.begin(seq, positions)
        given[first] = tokens.index_select(1, index)
        if positional:
            given["position_ids"] = positions.index_select(1, index)
        with _Attention(ctx, name):
            out = inner(**given)
        if ctx.calls == 0:
            raise UsageError(f"context parallelism saw no F.scaled_dot_product_attention in {name}'s forward: its "
                             "attention would see one share; use cp=1")
        return out

    model.forward = forward
