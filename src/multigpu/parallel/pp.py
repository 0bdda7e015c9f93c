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

import contextlib
import functools
import time
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
        self.clock = StageClock(device)
        for stage in self.stages:
            self.clock.wrap(stage)

    def parameters(self) -> Iterable[nn.Parameter]:
        for m in self.modules:
            yield from m.parameters()

    @property
    def model(self) -> nn.Module:
        """This rank's stages as one module under one process's parameter names: what a
        ``Checkpointer`` saves and loads (``model=pipe.model``), so a pipeline checkpoint resumes
        under any layout and back."""
        return stage_union(self.modules)

    def step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """Forward and backward of one optimizer step's micro-batches; their mean loss on the last stage's rank."""
        if len(micro_batches) != self.microbatches:
            raise UsageError(f"the pipeline was built for {self.microbatches} micro-batches per step but got "
                             f"{len(micro_batches)}; build it with the plan's accum_steps")
        with self.clock.step():
            return self._run(self.schedule.step, micro_batches)

    def evaluate(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """Forward only (the schedule's ``eval``): the mean micro-batch loss on the last stage's rank."""
        if not hasattr(self.schedule, "eval"):
            raise UsageError(f"pipeline evaluation needs a torch whose schedules have eval() (2.13 has it), this is "
                             f"{torch.__version__}; upgrade torch or evaluate a one-process copy of the model")
        with torch.no_grad(), self.clock.discard():  # evaluation is not the training steps' compute
            return self._run(self.schedule.eval, micro_batches)

    def _run(self, call: Callable[..., Any], micro_batches: list) -> torch.Tensor | None:
        """``call`` (the schedule's step or eval) on the inputs this rank's stages need: the first stage the
        inputs, the last the targets; their mean micro-batch loss there, None elsewhere."""
        x = torch.cat([mb[0] for mb in micro_batches]) if self.has_first else None
        y = torch.cat([mb[1] for mb in micro_batches]) if self.has_last else None
        losses: list[torch.Tensor] = []
        call(*((x,) if self.has_first else ()), target=y, losses=losses if self.has_last else None)
        return torch.stack([loss.detach() for loss in losses]).mean() if self.has_last else None

    def stage_times(self) -> dict[str, float]:
        """This rank's time in its stages since the last call, for ``meter.step_end(**pipe.stage_times())``:
        ``stage/compute`` (forward and backward chunks), ``stage/p2p`` (the rest of ``step``: sending,
        receiving and waiting for the neighbour stages, the bubble), ``stage/id`` (its first stage).
        The meter keeps them per rank and the summary reports each stage's shares of the step."""
        compute, total, steps = self.clock.take()
        # The meter sums a metric over its interval's steps and divides by their number: the id
        # counts once per step read here, so reading only at log steps still gives the id.
        return {"stage/compute": compute, "stage/p2p": max(0.0, total - compute),
                "stage/id": float(self.ids[0] * steps)}

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


def stage_union(parts: list[nn.Module]) -> nn.Module:
    """The stage modules of one rank as one module with the names one process has.

    A stage is the full model with what it does not run deleted (``recipes.gpt.pipeline``), so
    the parts' children are disjoint except for block containers, whose entries are merged
    (an ``nn.ModuleDict`` keeps its names; list indices would shift). The parameters are the
    parts' own: an optimizer over ``pipe.parameters()`` keys its state by these names.
    """
    if len(parts) == 1:
        return parts[0]
    union = nn.Module()
    for part in parts:
        if next(part.named_parameters(recurse=False), None) is not None:
            raise UsageError(f"pipeline stage {type(part).__name__} holds parameters directly on its root; keep "
                             "them in sub-modules so the stages of one rank can be saved under one set of names")
        for name, child in part.named_children():
            have = union._modules.get(name)
            if have is None:
                union.add_module(name, nn.ModuleDict(child) if isinstance(child, nn.ModuleDict) else child)
            elif isinstance(have, nn.ModuleDict) and isinstance(child, nn.ModuleDict):
                clash = sorted(set(have) & set(child))
                if clash:
                    raise UsageError(f"two pipeline stages of this rank both hold {name}.{clash[0]}; "
                                     "give every block to one stage")
                have.update(child)
            else:
                raise UsageError(f"two pipeline stages of this rank both hold {name!r} "
                                 f"({type(have).__name__}, {type(child).__name__}); keep each module on one stage, "
                                 "blocks in an nn.ModuleDict")
    return union


class StageClock:
    """Time a stage's compute calls (``forward_one_chunk``, ``backward_one_chunk``, the zero-bubble
    schedules' ``backward_weight_one_chunk``) and whole steps: host time on CPU, CUDA events on a GPU
    (kernels run after the host returns), read at ``take()``."""

    CALLS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.compute = self.total = 0.0
        self.steps = 0
        self.events: list[tuple[Any, Any, bool]] = []  # (start, end, is_compute), CUDA only

    def wrap(self, stage: Any) -> None:
        for name in self.CALLS:
            inner = getattr(stage, name, None)
            if inner is not None:
                setattr(stage, name, functools.wraps(inner)(functools.partial(self._timed, inner)))

    def _timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self._span(compute=True):
            return fn(*args, **kwargs)

    def step(self) -> contextlib.AbstractContextManager:
        self.steps += 1
        return self._span(compute=False)

    @contextlib.contextmanager
    def discard(self):
        """Leave out what is timed inside (forward chunks of an evaluation)."""
        compute, total, steps, n = self.compute, self.total, self.steps, len(self.events)
        try:
            yield
        finally:
            self.compute, self.total, self.steps, self.events = compute, total, steps, self.events[:n]

    @contextlib.contextmanager
    def _span(self, compute: bool):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self.events.append((start, end, compute))
                if len(self.events) > 4096:  # nobody reads them (no stage_times() calls): fold, bounded
                    self._fold()
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            if compute:
                self.compute += dt
            else:
                self.total += dt

    def _fold(self) -> None:
        """The recorded CUDA events into seconds (waits for the last one)."""
        if self.events:
            self.events[-1][1].synchronize()
            for start, end, compute in self.events:
                dt = start.elapsed_time(end) / 1e3
                if compute:
                    self.compute += dt
                else:
                    self.total += dt
            self.events = []

    def take(self) -> tuple[float, float, int]:
        """(compute seconds, step seconds, steps) since the last call."""
        self._fold()
        out, self.compute, self.total, self.steps = (self.compute, self.total, self.steps), 0.0, 0.0, 0
        return out
