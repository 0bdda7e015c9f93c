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
``interleaved_1f1b``, ``looped_bfs``, ``interleaved_zero_bubble`` (loop
placement: any number of stages per rank, 2 unless asked) and ``zbv`` (V
placement: 2 per rank).
"""

from __future__ import annotations

import functools
import inspect
import operator
from typing import Any, Callable, Iterable

import torch
import torch.distributed as tdist
from torch import nn

from ..runtime.compat import direct_child
from ..errors import UsageError
from ..runtime.values import is_positive_int, positive_int
from . import float8
from .stage_clock import StageClock

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "looped_bfs": "ScheduleLoopedBFS", "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
             "zbv": "ScheduleZBVZeroBubble"}
SINGLE_STAGE = ("gpipe", "1f1b")
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv")  # their backward split in input and weight parts
V_SHAPED = ("zbv",)  # torch's ScheduleZBVZeroBubble takes exactly 2 stages a rank, placed in a V
LOOPED = tuple(s for s in SCHEDULES if s not in SINGLE_STAGE + V_SHAPED)  # torch's take any number a rank


def stages_per_rank(schedule: str, per_rank: int | None = None) -> int:
    """Stages each pp rank runs: ``per_rank`` where asked (a looped schedule takes any number, as torch's
    ScheduleInterleaved1F1B, ScheduleLoopedBFS and ScheduleInterleavedZeroBubble do), else the schedule's own
    (1 single-stage, 2 multi-stage); refused in one line where the schedule cannot run it.

    >>> pp.stages_per_rank("interleaved_1f1b"), pp.stages_per_rank("interleaved_1f1b", 3)
    (2, 3)
    """
    if schedule not in SCHEDULES:
        raise UsageError(f"unknown pipeline schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    default = 1 if schedule in SINGLE_STAGE else 2
    if per_rank is None:
        return default
    positive_int(per_rank, "stages_per_rank", "use e.g. stages_per_rank=3 with schedule 'interleaved_1f1b', or "
                 "leave it out for the schedule's own")
    if per_rank != default and schedule not in LOOPED:
        how = "places 2 stages per rank in a V" if schedule in V_SHAPED else "runs 1 stage per rank"
        raise UsageError(f"pipeline schedule {schedule!r} {how}, got stages_per_rank={per_rank}; leave "
                         f"stages_per_rank out, or use a looped schedule ({', '.join(LOOPED)}) for {per_rank} per rank")
    return per_rank


def stage_ids(schedule: str, pp_rank: int, pp_size: int, per_rank: int | None = None) -> list[int]:
    """The stages this rank runs: ``pp_rank`` (+ ``pp_size``, + 2 ``pp_size``, ... in loop placement; the mirror
    stage in V placement). ``per_rank``: as ``stages_per_rank`` takes it.

    >>> pp.stage_ids("interleaved_1f1b", 1, 2, per_rank=3)
    [1, 3, 5]
    """
    n = stages_per_rank(schedule, per_rank)
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(n)]


def microbatches_refusal(schedule: str, pp_size: int, accum_steps: int) -> str | None:
    """Why ``schedule`` on ``pp_size`` pipeline ranks cannot run ``accum_steps`` micro-batches a step, in one
    line with the fix, or None. The one rule: ``mg.parallel.pipeline``, tune and forecast all ask it.

    What torch 2.13's schedules accept (their constructors' checks; each accepted count also runs and
    equals one process, tests/test_pipeline_checks.py): ``1f1b`` at least as many micro-batches as stages;
    ``interleaved_1f1b`` and ``interleaved_zero_bubble`` run them in max(1, m // pp) rounds, which must
    divide m (m = 5 on 2 ranks is refused, 1 is not); ``gpipe``, ``looped_bfs`` and ``zbv`` any count
    (zbv pads its V to 2 x pp - 1 micro-batches and drops the padding).

    >>> pp.microbatches_refusal("zbv", 2, 1) is None
    True
    """
    stages = pp_size * stages_per_rank(schedule)  # only 1f1b's rule counts them: single-stage, whatever is asked
    if accum_steps < 1:
        return f"a pipeline step needs at least 1 micro-batch, got {accum_steps}; lower the micro-batch size"
    if schedule == "1f1b" and accum_steps < stages:
        return (f"pipeline schedule '1f1b' needs at least as many micro-batches as stages, got {accum_steps} "
                f"micro-batches for {stages} stages; raise the accumulation (micro_batch=global_batch/dp/{stages} "
                f"or smaller) or use schedule 'gpipe'")
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and _rounds_refuse(pp_size, accum_steps):
        near = [m for m in (_accepted(pp_size, accum_steps, -1), _accepted(pp_size, accum_steps, +1)) if m]
        return (f"pipeline schedule {schedule!r} on {pp_size} pp ranks runs {accum_steps} micro-batches in "
                f"max(1, {accum_steps} // {pp_size}) = {accum_steps // pp_size} rounds, which must divide them; "
                f"use {' or '.join(map(str, near))} micro-batches a step (another micro-batch size) "
                f"or schedule 'looped_bfs'")
    return None


def _rounds_refuse(pp_size: int, m: int) -> bool:
    """torch's interleaved schedules (flex_pp): m micro-batches in max(1, m // pp) rounds of equal size."""
    return m % max(1, m // pp_size) != 0


def _accepted(pp_size: int, m: int, way: int) -> int | None:
    """The nearest micro-batch count below (way -1) or above (+1) ``m`` that the interleaved schedules run."""
    m += way
    while m >= 1 and _rounds_refuse(pp_size, m):
        m += way
    return m if m >= 1 else None


def check(schedule: str, pp_size: int, accum_steps: int, per_rank: int | None = None) -> int:
    """Refuse what the schedule cannot run (``microbatches_refusal``, ``stages_per_rank``), before any
    process-group work; return the number of stages."""
    n = stages_per_rank(schedule, per_rank)
    why = microbatches_refusal(schedule, pp_size, accum_steps)
    if why:
        raise UsageError(why)
    return pp_size * n


def _ranks(values: list[Any], ranks: list[int] | None = None) -> str:
    """``pp rank 0 [0], pp rank 1 [1]``: each value after its pp rank (``ranks``: which ones, default all)."""
    ranks = list(range(len(values))) if ranks is None else ranks
    return ", ".join(f"pp rank {r} {values[r]}" for r in ranks)


def check_stages(modules: Any, ids: Any, n_stages: Any, group: Any, schedule: str, accum_steps: int) -> None:
    """Refuse stages the schedule cannot run, the same one line on every pipeline rank.

    Every rank's schedule, ``n_stages``, stage ids and module count are gathered over ``group``
    first, so each rank judges the same facts and all raise together (none is left waiting in a
    collective): the ids over the group are 0..n_stages-1 once each, where the schedule places them
    (``stage_ids``), ``n_stages`` is the schedule's count, and each rank passes one module per id.
    """
    try:
        mine_ids: Any = [operator.index(i) for i in ids]
    except TypeError:
        mine_ids = f"{ids!r} ({type(ids).__name__})"
    n_modules = len(modules) if isinstance(modules, (list, tuple)) else f"a {type(modules).__name__}"
    mine = {"schedule": schedule, "n_stages": n_stages, "ids": mine_ids, "modules": n_modules}
    size = tdist.get_world_size(group)
    got: list[Any] = [None] * size
    tdist.all_gather_object(got, mine, group=group)
    for key in ("schedule", "n_stages"):
        if len({repr(g[key]) for g in got}) > 1:
            raise UsageError(f"pipeline ranks were given different {key} ({_ranks([repr(g[key]) for g in got])}); "
                             f"pass the same {key} on every pp rank")
    check(schedule, size, accum_steps)  # an unknown schedule, too few micro-batches
    # A looped schedule runs any number of stages a rank: n_stages says how many (checked below, as a multiple).
    looped = schedule in LOOPED and is_positive_int(n_stages) and n_stages % size == 0
    per_rank = n_stages // size if looped else stages_per_rank(schedule)
    want = [stage_ids(schedule, r, size, per_rank) for r in range(size)]
    asked = f", per_rank={per_rank}" if per_rank != stages_per_rank(schedule) else ""
    fix = f"pass ids=pp.stage_ids({schedule!r}, pp_rank, pp_size{asked}) ({_ranks(want)})"
    for r, g in enumerate(got):
        if isinstance(g["ids"], str):
            raise UsageError(f"pipeline stage ids must be a list of ints, got {g['ids']} on pp rank {r}; {fix}")
        if isinstance(g["modules"], str):
            raise UsageError(f"pipeline stages must be a list of modules, got {g['modules']} on pp rank {r}; "
                             f"pass [module] for one stage per rank")
        if g["modules"] != len(g["ids"]):
            raise UsageError(f"pipeline pp rank {r} passed {g['modules']} modules for {len(g['ids'])} stage ids "
                             f"{g['ids']}; pass one module per stage id, in the same order")
    counts = [len(g["ids"]) for g in got]
    if any(c != per_rank for c in counts):
        other = ("use a multi-stage schedule (interleaved_1f1b, looped_bfs, interleaved_zero_bubble, zbv)"
                 if per_rank == 1 else f"pass n_stages={size} x the stages a rank runs" if schedule in LOOPED
                 else "use a single-stage schedule (gpipe, 1f1b)")
        raise UsageError(f"pipeline schedule {schedule!r} runs {per_rank} stage{'s' if per_rank > 1 else ''} per rank, "
                         f"got {_ranks([g['ids'] for g in got])}; {fix}, or {other}")
    expected = size * per_rank
    if n_stages != expected:
        runs = (f"a multiple of {size} stages (any number per rank)" if schedule in LOOPED
                else f"{expected} stages ({per_rank} per rank)")
        raise UsageError(f"pipeline schedule {schedule!r} on {size} pp ranks runs {runs}, got n_stages={n_stages!r}; "
                         f"pass n_stages=pp.check({schedule!r}, pp_size, accum_steps{asked})")
    _check_cover([g["ids"] for g in got], want, schedule, fix)


def _check_cover(ids: list[list[int]], want: list[list[int]], schedule: str, fix: str) -> None:
    """Refuse stage ids (``ids``, by pp rank) that do not cover the stages once each where ``want`` places them."""
    size, expected = len(ids), sum(map(len, want))
    held: dict[int, list[int]] = {}
    for r, mine in enumerate(ids):
        for i in mine:
            held.setdefault(i, []).append(r)
    problems = [f"{i} {'twice' if len(rs) == 2 else f'{len(rs)} times'} (pp ranks {', '.join(map(str, rs))})"
                for i, rs in sorted(held.items()) if len(rs) > 1]
    missing = [i for i in range(expected) if i not in held]
    if missing:
        problems.append(f"missing {', '.join(map(str, missing))}")
    outside = sorted(i for i in held if not 0 <= i < expected)
    if outside:
        problems.append(f"out of range {', '.join(map(str, outside))}")
    if problems:
        raise UsageError(f"pipeline stage ids over the {size} pp ranks must cover 0..{expected - 1} once each, got "
                         f"{_ranks(ids)}: {'; '.join(problems)}; {fix}")
    wrong = [r for r, mine in enumerate(ids) if sorted(mine) != sorted(want[r])]
    if wrong:
        raise UsageError(f"pipeline schedule {schedule!r} places stages {_ranks(want, wrong)}, got "
                         f"{_ranks(ids, wrong)} (the stages would exchange with the wrong ranks); {fix}")


class Pipeline:
    """This rank's pipeline stages and their schedule.

    Built on every rank of ``group`` at once: ``check_stages`` refuses, the same line on every rank,
    stage ids, ``n_stages`` or module counts the schedule cannot run (see ``stage_ids``, ``check``).

    >>> pipe = mg.parallel.Pipeline(parts, ids, n_stages, mesh.pp_mesh.get_group(), dist.device,
    ...                             "1f1b", plan.accum_steps, loss_fn)
    >>> loss = pipe.step(micro_batches)          # forward and backward of every micro-batch
    >>> pipe.clip_grad_norm_(1.0); opt.step()

    ``tied``: groups of parameter names one process ties (one tensor, e.g. ``[["transformer.wte.weight",
    "lm_head.weight"]]``, what ``tied.tied_groups(model)`` finds) that stages hold as copies: after each
    step's backward their gradients are summed over the copies (``tied.TiedGrads``), and the norm of
    ``clip_grad_norm_`` counts them once.
    """

    def __init__(self, modules: list[nn.Module], ids: list[int], n_stages: int, group: Any, device: torch.device,
                 schedule: str, accum_steps: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 *, tied: list[list[str]] | None = None) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        from .hf.tied import TiedGrads

        check_stages(modules, ids, n_stages, group, schedule, accum_steps)
        self.tied = TiedGrads(modules, ids, group, tied or [])
        self.modules, self.ids, self.n_stages, self.group = modules, ids, n_stages, group
        self.stages = [PipelineStage(m, i, n_stages, device, group=group) for m, i in zip(modules, ids)]
        cls = getattr(schedules, SCHEDULES[schedule])
        stages = self.stages[0] if schedule in SINGLE_STAGE else self.stages
        try:
            self.schedule = cls(stages, n_microbatches=accum_steps, loss_fn=loss_fn, scale_grads=True)
        except ValueError as err:  # a torch whose schedules ask more than microbatches_refusal knows (every rank alike)
            raise UsageError(f"torch {torch.__version__}'s {SCHEDULES[schedule]} refuses {accum_steps} micro-batches "
                             f"on {len(stages) if isinstance(stages, list) else 1} stage(s) per rank: "
                             f"{' '.join(str(err).split()).rstrip('.')}; use another micro-batch count or schedule") from None
        self.accum_steps, self.schedule_name = accum_steps, schedule
        # The last stage would keep every micro-batch's output (the logits) to return them merged: unused here
        # (where this torch's schedules can be told so).
        takes = "return_outputs" in inspect.signature(self.schedule.step).parameters
        self._step = functools.partial(self.schedule.step, return_outputs=False) if takes else self.schedule.step
        self.has_first, self.has_last = 0 in ids, n_stages - 1 in ids
        self.clock = StageClock(device)
        for stage in self.stages:
            self.clock.wrap(stage)
        self._union: nn.Module | None = None  # built once, on first use: what mg.parallel.pipeline records

    def parameters(self) -> Iterable[nn.Parameter]:
        for m in self.modules:
            yield from m.parameters()

    @property
    def model(self) -> nn.Module:
        """This rank's stages as one module under one process's parameter names: what a
        ``Checkpointer`` saves and loads (``model=pipe.model``), so a pipeline checkpoint resumes
        under any layout and back."""
        if self._union is None:
            self._union = stage_union(self.modules)
        return self._union

    def step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """Forward and backward of one optimizer step's micro-batches; their mean loss on the last stage's rank."""
        if len(micro_batches) != self.accum_steps:
            raise UsageError(f"the pipeline was built for {self.accum_steps} micro-batches per step but got "
                             f"{len(micro_batches)}; build it with the plan's accum_steps")
        # The stages are copies of the model amp.convert saw: their FSDP float8 weights' scales are refreshed
        # here, from the whole weights (float8.py; nothing without float8 layers).
        float8.refresh_scales(self.modules)
        with self.clock.step():
            loss = self._run(self._step, micro_batches)
            self.tied.sum_()  # the copies of a tied tensor: one process's gradient on each
            return loss

    def evaluate(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """Forward only (the schedule's ``eval``): the mean micro-batch loss on the last stage's rank."""
        if self.schedule_name in ZERO_BUBBLE:
            # torch 2.13's eval() of these runs their split backward anyway and fails on a stage without one
            # ("can't steal_bwd_input if this stage doesn't have backward"), leaving the other ranks waiting.
            raise UsageError(f"pipeline evaluation under the {self.schedule_name!r} schedule is not supported by "
                             "torch's schedules; build the evaluation pipeline with schedule '1f1b' or "
                             "'interleaved_1f1b' (Layout(schedule=...)), or evaluate a one-process copy")
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
        from .clip import clip_groups, group_norm, grouped, reduce_norm

        params = list(self.parameters())
        groups = grouped(params)
        # A tied tensor's copies (equal gradients after step) count once, as one process's single tensor does.
        counted = grouped(p for p in params if id(p) not in self.tied.skip)
        if counted:
            own = group_norm(counted, norm_type)
        else:  # nothing of its own to count (no gradients, or only copies counted elsewhere)
            first = next((_local_grad(p) for p in params if p.grad is not None), None)
            own = torch.tensor(0.0) if first is None else torch.zeros((), dtype=first.dtype, device=first.device)
        # What is counted is disjoint over the stages, so their norms combine as FSDP's shards do; returned
        # in the dtype the norm was computed in, as clip_grad_norm_ returns it (a fixed float32 here moved
        # float64 pipelines 8e-10 off one process).
        total = reduce_norm(own, norm_type, self.group)
        clip_groups(groups, max_norm, total)
        return total


def _local_grad(p: nn.Parameter) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad


def stage_union(parts: list[nn.Module]) -> nn.Module:
    """The stage modules of one rank as one module with the names one process has.

    A stage is the full model with what it does not run deleted or emptied (``recipes.gpt.pipeline``,
    ``stages.split``), so two stages of one rank (interleaved and V schedules) hold the same names only
    where at most one of them holds state there: a name both hold is merged into a new container of
    both's children, recursively (the base model, its blocks under their original indices), and where
    one side has no state (an emptied norm, rotary embeddings' non-persistent buffers) the other's is
    kept. The parameters are the parts' own: an optimizer over ``pipe.parameters()`` keys its state by
    these names, and the stages themselves are left as they are.
    """
    if len(parts) == 1:
        return parts[0]

    def stateless(m: nn.Module) -> bool:
        return not m.state_dict()

    def merge(name: str, a: nn.Module, b: nn.Module) -> nn.Module:
        if stateless(b):
            return a
        if stateless(a):
            return b
        direct = [n for n, _ in a.named_parameters(recurse=False)] + [n for n, _ in b.named_parameters(recurse=False)]
        if direct or not any(True for _ in a.children()) or not any(True for _ in b.children()):
            raise UsageError(f"two pipeline stages of this rank both hold {name} ({type(a).__name__}, "
                             f"{type(b).__name__}); give each module with weights to one stage")
        shell = nn.Module()
        for child_name, child in list(a.named_children()) + list(b.named_children()):
            have = direct_child(shell, child_name)
            full = f"{name}.{child_name}"
            shell.add_module(child_name, child if have is None else merge(full, have, child))
        return shell

    union = parts[0]
    for part in parts[1:]:
        union = merge("the stage", union, part)
    return union


def gathered_state_dict(pipe: Any) -> dict:
    """The full weights of every stage, under one process's names, on every rank (a collective)."""
    import torch.distributed as tdist
    from torch.distributed.tensor import DTensor

    mine = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            for part in pipe.modules for k, v in part.state_dict().items()}
    gathered: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(gathered, mine)
    return {k: v for d in gathered for k, v in d.items()}
