"""Pipeline parallelism: this rank's stages, a ``torch.distributed.pipelining`` schedule, and ``pipe.step``.

The schedule owns forward and backward, so the loop calls it explicitly:
``loss = pipe.step(micro_batches)`` runs one optimizer step's micro-batches
(the ``BatchPlan``'s accumulation) through the pipeline and returns their
mean loss on the rank with the last stage (None elsewhere). Only the first
stage reads the inputs and only the last the labels, but every stage of a
pipeline receives the same micro-batches from the loader (the mesh's
data-parallel rank ignores the pipeline coordinate). Gradients are the mean
over micro-batches (``scale_grads``), the same as accumulation divides the
loss. Schedules by name: single-stage ``gpipe``, ``1f1b``; multi-stage
(2 stages per rank) ``interleaved_1f1b``, ``looped_bfs``,
``interleaved_zero_bubble`` (loop placement) and ``zbv`` (V placement).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as tdist
from torch import nn

from ..errors import UsageError

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "looped_bfs": "ScheduleLoopedBFS", "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
             "zbv": "ScheduleZBVZeroBubble"}
SINGLE_STAGE = ("gpipe", "1f1b")
# Schedules that refuse fewer micro-batches than stages (torch raises on it at the first step).
NEED_MICROBATCHES = ("1f1b", "zbv")


def stages_per_rank(schedule: str) -> int:
    if schedule not in SCHEDULES:
        raise UsageError(f"unknown pipeline schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    return 1 if schedule in SINGLE_STAGE else 2


def stage_ids(schedule: str, pp_rank: int, pp_size: int) -> list[int]:
    """The stages this rank runs: ``pp_rank`` (+ ``pp_size`` in loop placement; the mirror stage in V placement)."""
    if stages_per_rank(schedule) == 1:
        return [pp_rank]
    if schedule == "zbv":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank, pp_rank + pp_size]


def check(schedule: str, pp_size: int, microbatches: int) -> int:
    """Refuse what the schedule cannot run, before any process-group work; return the number of stages."""
    n_stages = pp_size * stages_per_rank(schedule)
    if schedule in NEED_MICROBATCHES and microbatches < n_stages:
        raise UsageError(f"pipeline schedule {schedule!r} needs at least as many micro-batches as stages, got "
                         f"{microbatches} micro-batches for {n_stages} stages; raise the accumulation "
                         f"(micro_batch=global_batch/dp/{n_stages} or smaller) or use schedule 'gpipe'")
    return n_stages


class Pipeline:
    """This rank's pipeline stages and their schedule.

    >>> pipe = mg.parallel.Pipeline(parts, ids, n_stages, mesh.pp_mesh.get_group(), dist.device,
    ...                             "1f1b", plan.accum_steps, loss_fn)
    >>> loss = pipe.step(micro_batches)          # forward and backward of every micro-batch
    >>> pipe.clip_grad_norm_(1.0); opt.step()
    """

    def __init__(self, modules: list[nn.Module], ids: list[int], n_stages: int, group: Any, device: torch.device,
                 schedule: str, microbatches: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        check(schedule, tdist.get_world_size(group), microbatches)
        self.modules, self.ids, self.n_stages, self.group = modules, ids, n_stages, group
        self.stages = [PipelineStage(m, i, n_stages, device, group=group) for m, i in zip(modules, ids)]
        cls = getattr(schedules, SCHEDULES[schedule])
        stages = self.stages[0] if schedule in SINGLE_STAGE else self.stages
        self.schedule = cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
        self.microbatches = microbatches
        self.has_first, self.has_last = 0 in ids, n_stages - 1 in ids

    def parameters(self) -> Iterable[nn.Parameter]:
        for m in self.modules:
            yield from m.parameters()

    def step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """Forward and backward of one optimizer step's micro-batches; their mean loss on the last stage's rank."""
        if len(micro_batches) != self.microbatches:
            raise UsageError(f"the pipeline was built for {self.microbatches} micro-batches per step but got "
                             f"{len(micro_batches)}; build it with the plan's accum_steps")
        x = torch.cat([mb[0] for mb in micro_batches]) if self.has_first else None
        y = torch.cat([mb[1] for mb in micro_batches]) if self.has_last else None
        losses: list[torch.Tensor] = []
        args = (x,) if self.has_first else ()
        self.schedule.step(*args, target=y, losses=losses if self.has_last else None)
        return torch.stack([loss.detach() for loss in losses]).mean() if self.has_last else None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over every stage: each rank's norm, combined over the pipeline."""
        from .clip import clip_groups, group_norm, grouped

        groups = grouped(self.parameters())
        mine = (group_norm(groups, norm_type) if groups else torch.tensor(0.0)).double()
        if norm_type == float("inf"):
            tdist.all_reduce(mine, op=tdist.ReduceOp.MAX, group=self.group)
            total = mine
        else:
            power = mine ** norm_type
            tdist.all_reduce(power, group=self.group)
            total = power ** (1.0 / norm_type)
        total = total.float()
        clip_groups(groups, max_norm, total)
        return total
