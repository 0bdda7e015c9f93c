"""Tied parameters across pipeline stages: one process's single tensor, one copy per stage that uses it.

GPT-2 ties its head to its token table (``lm_head.weight`` is ``transformer.wte.weight``). A pipeline
puts the table on the first stage and the head on the last, so each of them holds its own copy
(initialised equal: the stages are copies of one model). One process's gradient of the tied tensor is
the sum of what each use contributes; so after every step's backward the copies' gradients are summed
over the stages that hold them (point to point between those pipeline ranks only, at the same
data-parallel coordinate; added locally where one rank holds several of them, as V-placed schedules
put the first and the last stage on one rank). Every copy then has one process's gradient and the
optimizer keeps them equal. The gradient norm for clipping counts the tensor once (its copy on the
lowest stage). Under FSDP the copies are sharded alike on the data-parallel mesh (same shape, same
mesh), so the local shards are summed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from ...errors import UsageError


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The names of every parameter ``model`` holds under several names (tied), in the model's order.

    >>> tied_groups(gpt2)
    [['transformer.wte.weight', 'lm_head.weight']]
    """
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [n for n in names.values() if len(n) > 1]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t  # under no_grad: the shard itself, summed in place


def _layout(p: torch.Tensor) -> tuple:
    from torch.distributed.tensor import DTensor

    placements = str(tuple(p.placements)) if isinstance(p, DTensor) else "plain"
    return tuple(p.shape), str(p.dtype), placements, tuple(_local(p).shape)


class TiedGrads:
    """The copies of each tied group on this rank's stages, summed with the other holders' after a step."""

    def __init__(self, modules: list[nn.Module], ids: list[int], group: Any, tied: list[list[str]]) -> None:
        me = tdist.get_rank(group)
        mine: list[list[tuple[int, str, nn.Parameter]]] = []
        for names in tied:
            held, seen = [], set()
            for module, i in zip(modules, ids):
                for name, p in module.named_parameters(remove_duplicate=False):
                    if name in names and id(p) not in seen:
                        seen.add(id(p))
                        held.append((i, name, p))
            mine.append(sorted(held, key=lambda h: (h[0], h[1])))  # the holders' order below
        # One gather, so every rank knows who holds what and every rank refuses alike.
        got: list[Any] = [None] * tdist.get_world_size(group)
        tdist.all_gather_object(got, [[(i, n, _layout(p)) for i, n, p in held] for held in mine], group=group)
        self.group = group
        self.sums: list[tuple[list[nn.Parameter], list[int], list[int]]] = []  # (my copies, order, peer ranks)
        self.skip: set[int] = set()  # the copies the gradient norm leaves out (all but the lowest stage's)
        for g, names in enumerate(tied):
            # (rank, stage, name, layout), in one order on every rank: the sum runs in that order everywhere.
            holders = sorted((r, i, n, lay) for r, per in enumerate(got) for i, n, lay in per[g])
            if len(holders) < 2:
                continue  # one stage holds the tensor (both uses on one stage): nothing to sum
            layouts = {lay for *_, lay in holders}
            if len(layouts) > 1:
                a, b = holders[0], next(h for h in holders if h[3] != holders[0][3])
                raise UsageError(
                    f"the tied parameters {' = '.join(names)} are laid out differently on pipeline stages {a[1]} and "
                    f"{b[1]} ({a[2]} {_describe(a[3])}, {b[2]} {_describe(b[3])}), so their gradients cannot be "
                    "summed; give both the same sharding (tensor-parallel style), or untie them "
                    "(transformers: config.tie_word_embeddings=False)")
            counted = min(holders, key=lambda h: (h[1], h[2]))
            for i, n, p in mine[g]:
                if (me, i, n) != counted[:3]:
                    self.skip.add(id(p))
            if mine[g]:
                order = [r for r, *_ in holders]  # whose copy comes k-th in the sum
                self.sums.append(([p for _, _, p in mine[g]], order, sorted({r for r, *_ in holders} - {me})))

    @torch.no_grad()
    def sum_(self) -> None:
        """Every copy's gradient becomes the sum over all copies (one process's gradient), the same bits on every
        holder: all add the copies in one order. A copy its stage did not use (no gradient) adds zeros."""
        from torch.distributed.tensor import DTensor

        for params, order, peers in self.sums:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                    # Laid out as its parameter (checked alike on every copy): a row-wise TP embedding's gradient
                    # comes back replicated (torch 2.13) while the head's is sharded; Replicate -> Shard is a slice.
                    p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)
            local = [_local(p.grad) for p in params]
            mine = torch.stack(local)
            received: dict[int, torch.Tensor] = {}
            ops = []
            for r in peers:
                n = order.count(r)
                received[r] = torch.empty((n, *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
                peer = tdist.get_global_rank(self.group, r)
                ops.append(tdist.P2POp(tdist.isend, mine, peer, group=self.group))
                ops.append(tdist.P2POp(tdist.irecv, received[r], peer, group=self.group))
            if ops:
                for work in tdist.batch_isend_irecv(ops):
                    work.wait()
            me = tdist.get_rank(self.group)
            taken: dict[int, int] = {}
            total = None
            for rank in order:
                k = taken.get(rank, 0)
                taken[rank] = k + 1
                part = mine[k] if rank == me else received[rank][k]
                total = part.clone() if total is None else total.add_(part)
            for t in local:
                t.copy_(total)


def _describe(layout: tuple) -> str:
    shape, dtype, placements, local = layout
    sharded = "" if placements == "plain" else f" {placements} local {list(local)}"
    return f"{list(shape)} {dtype.removeprefix('torch.')}{sharded}"
