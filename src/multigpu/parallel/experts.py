"""Expert parallelism: each rank holds experts/ep of every MoE layer's experts, and the routed tokens travel to them.

The ``ep`` degree borrows its ranks from the data-parallel shard degree and, beside tensor parallelism,
every tensor-parallel rank (torchtitan's ``dp_shard x tp = efsdp x ep``), so a layout keeps its world and
global batch. What it spreads
is transformers 5's experts modules (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...): one module per MoE layer
holding every expert's weights as 3-D parameters whose first dimension is the expert (``gate_up_proj``
``(E, 2F, D)``, ``down_proj`` ``(E, D, F)``), called as ``experts(hidden (T, D), top_k_index (T, K),
top_k_weights (T, K))``. The router and everything else stay as the layout spreads them (FSDP over every
dp_shard rank); the experts modules get their own FSDP over the ranks that hold the same experts (efsdp; with
dp_replicate, HSDP over dp_replicate x efsdp).

Dropless dispatch, on PyTorch's own collectives (functional ``all_to_all_single``, so autograd flows):

1. the (token, slot) pairs sorted by expert (stable), the counts per expert exchanged;
2. the rows sent to the rank that holds their expert (uneven splits, zero included), there;
3. the experts module's own forward (its configured implementation: eager loop, batched or grouped GEMM)
   run on the rows received, with this rank's slice of its weights and each row's local expert;
4. the rows sent back, weighted by their routing scores and summed per token in expert order, as the
   module itself sums them.

So every token meets the same expert weights in the same order as on one process. The weights are DTensors
``Shard(0)`` on the expert-parallel mesh (and FSDP's shard of that over efsdp): ``mg.clip_grad_norm_`` and
DCP see the whole expert set. Their gradient collects the ep group's tokens through the all-to-all's
backward; FSDP averages it over efsdp (and dp_replicate: HSDP), and the dispatch divides it by what ep
borrows of dp_shard, so it is divided by the data-parallel size as FSDP divides the dense parameters'
(each rank's loss is its share's mean). Beside tensor parallelism the tp ranks hold the same tokens: each
routes its share, and the shares' outputs are gathered back (``_Share``, ``_Gathered``).
"""

from __future__ import annotations

import functools
import inspect
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import UsageError


def _candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules shaped as experts: an ``int`` ``num_experts`` and own parameters that all have that many experts
    first, 3-D weights among them (transformers 5's fused experts, with 2-D biases in some; a router's 2-D
    weight alone is not one)."""
    found = []
    for name, module in model.named_modules():
        n = getattr(module, "num_experts", None)
        params = list(module.parameters(recurse=False))
        if (isinstance(n, int) and n > 0 and params and all(p.dim() >= 2 and p.shape[0] == n for p in params)
                and any(p.dim() == 3 for p in params)):
            found.append((name, module))
    return found


def _takes_routing(module: nn.Module) -> bool:
    """Whether the dispatch can call the module's forward as it does: ``forward(hidden, top_k_index,
    top_k_weights)`` by position, nothing else required. Llama-4's experts take the hidden states alone (their
    rows already scaled by the router, one copy per slot), JetMoE's ``(inputs, expert_size)``: rows sorted
    by expert beforehand; neither tells the dispatch which expert a row is for."""
    params = list(inspect.signature(type(module).forward).parameters.values())[1:]  # after self
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    return len(positional) >= 3 and len(required) <= 3


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules of ``model`` that expert parallelism can spread: shaped as experts (``_candidates``)
    and called with the routing (``_takes_routing``)."""
    return [(n, m) for n, m in _candidates(model) if _takes_routing(m)]


def check(model: nn.Module, layout: Any) -> list[tuple[str, nn.Module]]:
    """The experts ``layout.ep`` spreads, or a one-line refusal of what it cannot."""
    name = type(model).__name__
    found = expert_modules(model)
    shaped = _candidates(model)
    if len(found) < len(shaped):
        first = next(m for _, m in shaped if not _takes_routing(m))
        takes = ", ".join(list(inspect.signature(type(first).forward).parameters)[1:])
        raise UsageError(f"expert parallelism (ep={layout.ep}) sends each routed row to its expert's rank and calls "
                         f"the experts module as experts(hidden, top_k_index, top_k_weights), but {name}'s "
                         f"{type(first).__name__} takes ({takes}): which expert each row is for is not in its call; "
                         "use ep=1 for this model (FSDP and HSDP spread its experts with the rest)")
    if not found:
        raise UsageError(f"expert parallelism (ep={layout.ep}) spreads the experts of a mixture-of-experts model, but "
                         f"{name} has no experts module (3-D expert weights and num_experts); use ep=1")
    counts = sorted({m.num_experts for _, m in found})

    def problem(ep: int) -> str | None:
        """Which ep fits is one rule: the layout's other degrees (``Layout.ep_problem``) and the experts."""
        if why := layout.ep_problem(ep):
            return why
        if any(n % ep for n in counts):
            return f"ep={ep} does not divide the {', '.join(map(str, counts))} experts of {name}"
        return None

    if why := problem(layout.ep):  # each degree suggested is one the same ranks take, by the same rule
        fits = [d for d in range(1, layout.dp_shard * layout.tp + 1) if problem(d) is None]  # ep / tp | dp_shard
        raise UsageError(f"{why}; use {'ep=1' if fits == [1] else 'ep in ' + ', '.join(map(str, fits))}")
    return found


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``factor`` (1 / the data-parallel size, as FSDP averages)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


class _Local:
    """The experts module as its own forward sees it on this rank: its attributes, with this rank's slice of
    its weights and its number of local experts."""

    def __init__(self, module: nn.Module, local: dict[str, Any]) -> None:
        self.__dict__.update(_module=module, _local=local)

    def __getattr__(self, name: str) -> Any:
        local = self.__dict__["_local"]
        return local[name] if name in local else getattr(self.__dict__["_module"], name)


class Stats:
    """What the dispatch saw since the meter last took it: tokens per expert per layer (this rank's, on the
    device: no sync), (token, slot) pairs dropped by a capacity factor, and the seconds in the all-to-alls,
    forward and backward (host clocks on CPU, where gloo's all-to-all is synchronous; CUDA events on GPU)."""

    def __init__(self, layers: int, experts: int, group: Any, device: torch.device) -> None:
        self.group = group  # the ranks of a micro-batch's tokens, each once (Layout.tokens_group)
        self.tokens = torch.zeros(layers, experts, dtype=torch.float64, device=device)
        self.dropped = torch.zeros((), dtype=torch.float64, device=device)
        self.seconds = 0.0
        self._open: list[Any] = []  # the start marks of all-to-alls running now
        self._spans: list[tuple[Any, Any]] = []  # CUDA event pairs, read at take()

    def mark(self, start: bool, device: torch.device) -> None:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            if start:
                self._open.append(event)
            else:
                self._spans.append((self._open.pop(), event))
        elif start:
            self._open.append(time.perf_counter())
        else:
            self.seconds += time.perf_counter() - self._open.pop()

    def clear(self) -> None:
        """Forget what was counted (mg.parallelize's probe batch is none of the training's tokens)."""
        self.tokens.zero_(), self.dropped.zero_()
        self.seconds, self._open, self._spans = 0.0, [], []

    def take(self) -> dict[str, Any]:
        """The interval's figures over the data-parallel ranks (a collective over them), then zeroed."""
        import torch.distributed as tdist

        if self._spans:
            self._spans[-1][1].synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self._spans) / 1e3
            self._spans = []
        packed = torch.cat([self.tokens.flatten(), self.dropped.view(1),
                            torch.tensor([self.seconds], dtype=torch.float64, device=self.tokens.device)])
        tdist.all_reduce(packed, group=self.group)
        tokens = packed[:self.tokens.numel()].view_as(self.tokens)
        self.tokens.zero_(), self.dropped.zero_()
        self.seconds = 0.0
        return {"tokens": tokens, "dropped": float(packed[-2]), "a2a_s": float(packed[-1]) / tdist.get_world_size(self.group)}


def figures(stats: list[Stats]) -> dict[str, Any] | None:
    """The interval's figures of every ``Stats`` this rank holds (one per pipeline stage; a collective over
    each one's data-parallel ranks): the layers of its stages, the seconds of all its all-to-alls."""
    if not stats:
        return None
    taken = [s.take() for s in stats]
    tokens = torch.cat([t["tokens"] for t in taken])  # (layers, experts)
    per_layer = tokens.max(1).values / tokens.mean(1).clamp(min=1e-30)
    return {"tokens": tokens.sum(0).tolist(), "imbalance": float(per_layer.max()),
            "imbalance_by_layer": per_layer.tolist(), "dropped": sum(t["dropped"] for t in taken),
            "a2a_s": sum(t["a2a_s"] for t in taken)}


class _Clock(torch.autograd.Function):
    """Identity; marks an all-to-all's start (``start``) or end in the forward, and the reverse in the
    backward, where the all-to-all's own backward runs between the two marks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, stats: Stats, start: bool) -> torch.Tensor:
        ctx.stats, ctx.start = stats, start
        stats.mark(start, x.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.stats.mark(not ctx.start, grad.device)
        return grad, None, None


@dataclass(frozen=True)
class _Dispatch:
    group: Any
    ep: int
    local: int
    grad_scale: float  # FSDP averages over (dp_replicate x) efsdp; this makes it the data-parallel mean
    capacity_factor: float | None
    stats: Stats
    layer: int
    tp: tuple[Any, int, int] | None = None  # (group, size, rank) of the tp ranks ep spans, each routing a share


def _shares(n: int, parts: int) -> list[int]:
    """``n`` rows cut into ``parts`` contiguous shares, the first ``n % parts`` one row longer."""
    return [n // parts + (i < n % parts) for i in range(parts)]


def _span(n: int, tp: tuple) -> slice:
    """This tp rank's share of ``n`` rows."""
    sizes = _shares(n, tp[1])
    return slice(sum(sizes[:tp[2]]), sum(sizes[:tp[2] + 1]))


class _Share(torch.autograd.Function):
    """This tp rank's share of rows every tp rank holds alike; the gradient gathered back from every share
    (so each rank again holds the whole, as the replicated rows' gradients are on every tp rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: tuple) -> torch.Tensor:
        ctx.tp, ctx.n = tp, x.shape[0]
        return x[_span(x.shape[0], tp)].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad, ctx.tp, ctx.n), None


class _Gathered(torch.autograd.Function):
    """Every tp rank's share, in order: the whole rows; the gradient of the whole (alike on every tp rank) cut
    back to this rank's share."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: tuple, n: int) -> torch.Tensor:
        ctx.tp, ctx.n = tp, n
        return _gather(x, tp, n)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[_span(ctx.n, ctx.tp)].contiguous(), None, None


def _gather(x: torch.Tensor, tp: tuple, n: int) -> torch.Tensor:
    """The tp ranks' shares of ``n`` rows (this rank's ``x`` among them) concatenated; shares are padded to the
    longest for the all-gather (which takes equal sizes)."""
    import torch.distributed as tdist

    group, size, _ = tp
    sizes = _shares(n, size)
    longest = max(sizes)
    padded = torch.zeros((longest, *x.shape[1:]), dtype=x.dtype, device=x.device)
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(size)]
    tdist.all_gather(parts, padded, group=group)
    return torch.cat([part[:k] for part, k in zip(parts, sizes)])


def apply(found: list[tuple[str, nn.Module]], layout: Any, mesh: Any, capacity_factor: float | None = None) -> "Stats":
    """Spread the experts modules ``found`` (``check``'s) over ``mesh`` (the expert-parallel ranks): each rank
    keeps its slice of every module's weights (a DTensor ``Shard(0)``) and runs the dispatch above.
    ``capacity_factor``: at most ceil(factor x pairs / experts) (token, slot) pairs of a rank's tokens per
    expert, the rest dropped (counted in ``Stats``); None: dropless. Returns the dispatch's figures (the
    model's record keeps them: ``spreads.py``)."""
    from torch.distributed.tensor import DTensor, Shard

    ep, rank = mesh.size(), mesh.get_local_rank()
    n = found[0][1].num_experts
    device = next(found[0][1].parameters()).device
    if device.type == "meta":  # spread before it is loaded (mg.from_pretrained): its figures on the mesh's device
        device = torch.empty(0, device=mesh.device_type).device
    stats = Stats(len(found), n, layout.tokens_group(device.type), device)
    tp = None
    if layout.tp > 1:  # ep spans the tp ranks: each routes its share of the tokens they all hold
        tp_mesh = layout.device_mesh(device.type)["tp"]
        tp = (tp_mesh.get_group(), layout.tp, tp_mesh.get_local_rank())
    for layer, (_, module) in enumerate(found):
        local = module.num_experts // ep
        for pname, p in list(module.named_parameters(recurse=False)):
            shard = p.detach()[rank * local:(rank + 1) * local].clone()
            new = nn.Parameter(DTensor.from_local(shard, mesh, [Shard(0)], run_check=False), p.requires_grad)
            setattr(module, pname, new)
        how = _Dispatch(mesh.get_group(), ep, local, layout.dp_replicate * layout.efsdp / layout.dp_size, capacity_factor,
                        stats, layer, tp)
        module.forward = functools.partial(_forward, module, type(module).forward, how)
    return stats


def _kept(flat: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, factor: float) -> tuple:
    """(order, counts) without the pairs past each expert's capacity (the first ones in token order stay)."""
    capacity = math.ceil(factor * flat.numel() / len(counts))
    starts = torch.cumsum(counts, 0) - counts
    place = torch.arange(len(order), device=order.device) - starts.repeat_interleave(counts)
    return order[place < capacity], counts.clamp(max=capacity)


def _forward(module: nn.Module, forward: Any, how: _Dispatch,
             hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    if how.tp is None:
        return _dispatch(module, forward, how, hidden, top_k_index, top_k_weights)
    # Every tp rank holds the same tokens (and their routing): each sends its share to the experts, and the
    # shares' outputs are gathered back, so each token meets its experts once over the ep x tp ranks.
    out = _dispatch(module, forward, how, _Share.apply(hidden, how.tp), top_k_index[_span(hidden.shape[0], how.tp)],
                    _Share.apply(top_k_weights, how.tp))
    return _Gathered.apply(out, how.tp, hidden.shape[0])


def _dispatch(module: nn.Module, forward: Any, how: _Dispatch,
              hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

    ep, local, group, stats = how.ep, how.local, how.group, how.stats
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)            # the (token, slot) pairs in expert order
    counts = torch.bincount(flat, minlength=ep * local)  # rows per expert, this rank's tokens
    stats.tokens[how.layer] += counts
    if how.capacity_factor is not None:
        order, kept = _kept(flat, order, counts, how.capacity_factor)
        stats.dropped += (counts - kept).sum()
        counts = kept
    token = order // k
    received = all_to_all_single(counts, None, None, group).wait()  # (ep, local): from each rank, per local expert
    send, recv = counts.view(ep, local).sum(1).tolist(), received.view(ep, local).sum(1).tolist()
    sent = _Clock.apply(hidden[token], stats, True)
    rows = _Clock.apply(all_to_all_single_autograd(sent, recv, send, group), stats, False)
    ids = torch.arange(local, device=flat.device).repeat(ep).repeat_interleave(received)  # each row's local expert
    weights = {n: _ScaleGrad.apply(p.to_local(), how.grad_scale) for n, p in module.named_parameters(recurse=False)}
    out = forward(_Local(module, {**weights, "num_experts": local}), rows, ids[:, None],
                  torch.ones(len(ids), 1, dtype=top_k_weights.dtype, device=rows.device))
    if len(ids) == 0:
        # No token for this rank's experts. Their gradient is zeros, as on one process (not None), and the
        # output still hangs on the rows received, so this rank's backward runs the dispatch's all-to-all as
        # the others' do (without, the ranks' collectives no longer pair up: a hang).
        out = out + (rows.sum() + sum(w.sum() for w in weights.values())) * 0
    back = _Clock.apply(all_to_all_single_autograd(_Clock.apply(out, stats, True), send, recv, group), stats, False)
    scores = top_k_weights.reshape(-1)[order]
    return torch.zeros_like(hidden).index_add_(0, token, (back * scores[:, None]).to(hidden.dtype))
