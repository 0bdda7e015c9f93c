"""The largest per-rank micro-batch that fits in memory, agreed by every rank.

Search: double from ``start`` until a trial does not fit, then bisect between
the last fit and the first miss. Every rank runs every trial and the verdict
is one all-reduce (MAX) of an "out of memory" flag, so a rank that fails does
not leave the others waiting in a collective, and all ranks end with the same
answer. The global batch is kept by raising accumulation (``BatchPlan``).

"Does not fit" means:
* CUDA: ``torch.OutOfMemoryError`` during the trial, or a peak
  (``torch.cuda.max_memory_allocated``) above ``memory_budget`` if one is given;
* CPU (no OOM signal before the OS kills the process): a peak resident set
  above ``memory_budget``. The peak is the kernel's high-water mark
  ``VmHWM`` from ``/proc/self/status``, reset before each trial by writing 5 to
  ``/proc/self/clear_refs`` (Linux >= 4.0, proc(5)), minus the resident set
  before the trial: real memory of the process, including torch's allocations.

Under ``multigpu run --find-batch [--memory-budget SIZE]`` the launcher asks
through the variables of its contract with the workers
(``multigpu.runtime.contract``): ``find_batch_requested()`` tells the script,
the search takes the budget when the caller gave none, and local rank 0 of
each node writes the result to ``<run dir>/find_batch.json``, which the
launcher reads for its closing line.
"""

from __future__ import annotations

import ctypes
import gc
import os
import pathlib
import re
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as tdist

from ..batch import BatchPlan
from ..errors import UsageError
from ..runtime.values import positive_int
from ..runtime.contract import find_batch_requested, write_find_batch
from ..runtime.contract import memory_budget as _launcher_budget, run_dir as _run_dir
from .ran import Watch

__all__ = ["MicroBatchSearch", "SequenceSearch", "find_batch_requested", "find_micro_batch", "find_sequence_length"]


@dataclass(frozen=True)
class MicroBatchSearch:
    """Result of ``find_micro_batch``: the agreed micro-batch, its plan and the trials."""

    micro_batch: int
    plan: BatchPlan | None
    trials: tuple[tuple[int, bool, int | None], ...]  # (micro-batch, fits on all ranks, this rank's peak bytes)
    limit: str  # what decided "does not fit": "cuda-oom", "cuda-budget" or "cpu-budget"

    def summary(self) -> str:
        tried = ", ".join(f"{mb}{'' if ok else ' x'}" for mb, ok, _ in self.trials)
        line = f"largest micro-batch that fits: {self.micro_batch} per rank (tried {tried}; limit: {self.limit})"
        if self.plan is not None:
            line += (f"; global batch {self.plan.global_batch} = {self.plan.world_size} ranks x "
                     f"{self.plan.micro_batch} x {self.plan.accum_steps} accumulation")
        return line


def _load_libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (musl, macOS): nothing to trim
        return None


_LIBC = _load_libc()


def _proc_status(key: str) -> int:
    text = pathlib.Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def _reset_peak(device: torch.device) -> int:
    """Reset the peak counter; return the current usage (the trial's baseline)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    return _proc_status("VmRSS")


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return _proc_status("VmHWM")


def _free(device: torch.device, collect: bool) -> None:
    # Tensors of a trial that returned die with their last reference; a full
    # collection (0.1-0.2 s with torch loaded) is only needed after an
    # exception, whose traceback keeps the trial's frames in a reference cycle.
    if collect:
        gc.collect()
    if device.type == "cpu" and _LIBC is not None:
        # glibc keeps freed heap pages resident (its mmap threshold adapts
        # upwards); they would count in the next trial's baseline, not its peak.
        _LIBC.malloc_trim(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _write_result(found: "MicroBatchSearch | SequenceSearch", dist, memory_budget: int | None) -> None:
    """``find_batch.json`` in the run directory, for the launcher's closing line."""
    run_dir = _run_dir()
    local_rank = getattr(dist, "local_rank", None)
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    # Every rank holds the same agreed result; local rank 0 writes it so that each node's
    # launcher (one run directory per node) finds it, not only the node of global rank 0.
    if not run_dir or local_rank != 0:
        return
    if isinstance(found, SequenceSearch):
        record = {"sequence_length": found.length,
                  "trials": [{"sequence_length": n, "fits": ok, "peak_bytes": peak} for n, ok, peak in found.trials]}
    else:
        plan = found.plan
        record = {
            "micro_batch": found.micro_batch,
            "plan": None if plan is None else {"global_batch": plan.global_batch, "world_size": plan.world_size,
                                               "micro_batch": plan.micro_batch, "accum_steps": plan.accum_steps},
            "trials": [{"micro_batch": m, "fits": ok, "peak_bytes": peak} for m, ok, peak in found.trials]}
    record |= {
        "limit": found.limit,
        "memory_budget": memory_budget,
        "world_size": getattr(dist, "world_size", 1),
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        "time": time.time(),
        "summary": found.summary(),
    }
    write_find_batch(run_dir, record)


OK, OOM, SHORT, FAILED = 0, 1, 2, 3  # agreed as the worst over ranks: a failure's own error wins


def _agree(code: int, device: torch.device, group) -> int:
    """The worst outcome over ranks (one all-reduce of a flag): OK, OOM, SHORT or FAILED."""
    if not (tdist.is_available() and tdist.is_initialized()):
        return code
    flag = torch.tensor([code], device=device)
    tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=group)
    return int(flag.item())


def _check_arguments(device: torch.device, plan, start, max_micro_batch, memory_budget) -> None:
    if plan is not None and not isinstance(plan, BatchPlan):
        raise UsageError(f"find_micro_batch plan= must be an mg.BatchPlan, got {type(plan).__name__}; "
                         "pass plan=mg.BatchPlan(global_batch, world_size=dist.world_size)")
    for name, v in (("start", start), ("max_micro_batch", max_micro_batch), ("memory_budget", memory_budget)):
        if v is not None:
            positive_int(v, f"find_micro_batch {name}")
    if max_micro_batch is not None and max_micro_batch < start:
        raise UsageError(f"find_micro_batch max_micro_batch {max_micro_batch} is below start {start}; raise it or lower start")
    if device.type == "cpu":
        if memory_budget is None:
            raise UsageError("on CPU there is no out-of-memory signal to search against; pass memory_budget=<bytes> (e.g. 8 << 30), "
                             "or under multigpu run: --memory-budget SIZE")
        if not pathlib.Path("/proc/self/clear_refs").exists():
            raise UsageError("measuring CPU peak memory needs Linux /proc/self/clear_refs; run the search on CUDA or on Linux")


@dataclass(frozen=True)
class _Short:
    """The one line of a search over a step that ran fewer than asked (``ran.Watch.short``)."""

    name: str     # the finder
    unit: str     # what a size counts
    larger: str   # what would be measured on the data's size
    more: str     # what step_fn should be given
    fix: Callable[[int], str]  # the cap to pass, from what ran

    def line(self, asked: int, ran: int, exact: bool) -> str:
        if exact:
            return (f"{self.name}: step_fn({asked}) ran {ran} {self.unit}, not the {asked} asked (the data it reads "
                    f"holds {ran}), so {self.larger} would be measured on {ran}; {self.fix(ran)}, or give step_fn "
                    f"{self.more}")
        return (f"{self.name}: step_fn({asked}) ran the same inputs as step_fn({ran}) (the data it reads holds at most "
                f"{ran} {self.unit}), so {self.larger} would be measured on them; {self.fix(ran)} or less, or give "
                f"step_fn {self.more}")


def _short_line(line: str | None, group) -> str:
    """The refusal of a trial that ran fewer than asked, the same on every rank: the first rank's that saw it."""
    lines = [line]
    if tdist.is_available() and tdist.is_initialized():
        lines = [None] * tdist.get_world_size(group)
        tdist.all_gather_object(lines, line, group=group)
    return next(x for x in lines if x is not None)


def _trial(step_fn: Callable[[int], object], device: torch.device, memory_budget: int | None, group,
           trials: list, short: "_Short", scale: int = 1) -> Callable[..., bool]:
    """``fits(m)``: run ``step_fn(m)`` on every rank and agree whether it fit; measured trials go to ``trials``.
    A step that ran fewer than ``m * scale`` along the dimension that carried the size (``ran.Watch``) is
    refused on every rank in ``short``'s line: its memory says nothing of the size asked."""
    watch = Watch()

    def fits(m: int, warmup: bool = False) -> bool:
        base = _reset_peak(device)
        code, peak, error, line = OK, None, None, None
        try:
            with watch.trial(m * scale, slices=warmup):
                step_fn(m)
            peak = _peak(device) - base
            code = OOM if memory_budget is not None and peak > memory_budget and not warmup else OK
            ran = watch.short(m * scale)
            if ran is not None:
                code, line = SHORT, short.line(m * scale, *ran)
        except torch.OutOfMemoryError:
            # Decide outside the except block: the traceback holds the trial's tensors.
            code = OOM
        except Exception as err:  # noqa: BLE001 - re-raised below, after the other ranks know
            code, error = FAILED, err
        _free(device, collect=code != OK)
        agreed = _agree(code, device, group)
        if agreed == FAILED:
            # Every rank leaves the search; the failing one with its own error.
            if error is not None:
                raise error
            raise RuntimeError(f"find_micro_batch: another rank failed in step_fn({m}); see its log")
        if agreed == SHORT:
            raise UsageError(_short_line(line, group))
        if not warmup:
            trials.append((m, agreed == OK, peak))
        return agreed == OK

    return fits


@dataclass(frozen=True)
class SequenceSearch:
    """Result of ``find_sequence_length``: the agreed longest sequence and the trials."""

    length: int
    trials: tuple[tuple[int, bool, int | None], ...]  # (tokens, fits on all ranks, this rank's peak bytes)
    limit: str

    def summary(self) -> str:
        tried = ", ".join(f"{n}{'' if ok else ' x'}" for n, ok, _ in self.trials)
        return f"longest sequence that fits: {self.length} tokens (tried {tried}; limit: {self.limit})"


def _largest(fits: Callable[..., bool], start: int, max_micro_batch: int | None, what: str = "micro-batch",
             unit: int = 1) -> int:
    """Double from ``start`` until a trial misses (or ``max_micro_batch``), then bisect."""
    # One unmeasured call first: the first backward pays one-time costs (gradient
    # buffers, lazy library and thread-pool initialisation) that no batch size needs again.
    good, bad, m = None, None, start
    if not fits(start, warmup=True):
        bad = start
    while bad is None:
        if fits(m):
            good = m
            if max_micro_batch is not None and m >= max_micro_batch:
                break
            m = m * 2 if max_micro_batch is None else min(m * 2, max_micro_batch)
        else:
            bad = m
    if good is None:
        raise UsageError(f"{what} {start * unit} does not fit in memory on some rank; lower start, shrink the model, "
                         "or use a sharded strategy")
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def find_micro_batch(
    step_fn: Callable[[int], object],
    dist=None,
    *,
    plan: BatchPlan | None = None,
    start: int = 1,
    max_micro_batch: int | None = None,
    memory_budget: int | None = None,
    group=None,
) -> MicroBatchSearch:
    """Largest micro-batch ``m`` for which ``step_fn(m)`` (one forward + backward) fits.

    ``step_fn`` must not run collectives (a rank that fails would leave the
    others waiting in them): give it the unwrapped model, or run its backward
    under ``no_sync``; let it zero its gradients. ``memory_budget`` (bytes) is
    required on CPU. With ``plan`` the result carries the same global batch in
    the largest micro-batch that fits and divides the plan's rank share, the
    rest as accumulation. A trial that ran fewer than ``m`` samples (``x[:m]``
    past the data's end) is refused in one line, never counted as fitting
    (``ran.Watch``); ``max_micro_batch`` caps the search at what the data holds.

    >>> def step(m):
    ...     model.zero_grad(set_to_none=True)
    ...     loss_fn(model(x[:m]), y[:m]).backward()
    >>> found = mg.find_micro_batch(step, dist, plan=mg.BatchPlan(1024, dist.world_size))
    >>> found.micro_batch, found.plan.accum_steps
    """
    device = torch.device(dist.device) if dist is not None else torch.device("cpu")
    if memory_budget is None:
        memory_budget = _launcher_budget()  # an explicit argument wins over the launcher's
    _check_arguments(device, plan, start, max_micro_batch, memory_budget)
    limit = "cpu-budget" if device.type == "cpu" else ("cuda-budget" if memory_budget else "cuda-oom")
    trials: list[tuple[int, bool, int | None]] = []
    _free(device, collect=True)
    def fix(ran: int) -> str:
        return f"pass max_micro_batch={ran}" + (f" and start={ran}" if ran < start else "")

    short = _Short("find_micro_batch", "samples", "every larger micro-batch", "more samples", fix)
    good = _largest(_trial(step_fn, device, memory_budget, group, trials, short), start, max_micro_batch)
    found = MicroBatchSearch(good, None if plan is None else plan.fitting(good), tuple(trials), limit)
    if find_batch_requested():
        _write_result(found, dist, memory_budget)
    return found


def find_sequence_length(
    step_fn: Callable[[int], object],
    dist=None,
    *,
    multiple: int = 128,
    start: int = 1024,
    max_length: int | None = None,
    memory_budget: int | None = None,
    group=None,
) -> SequenceSearch:
    """Longest sequence ``n`` (a multiple of ``multiple``) for which ``step_fn(n)`` (one forward and backward
    of one sequence of ``n`` tokens) fits, agreed by every rank; ``find_micro_batch``'s search over lengths.

    Under ``multigpu run --find-batch`` the launcher's closing line reports it, as for the micro-batch.
    Under context parallelism (``Layout(cp=N)``) each rank holds n / cp of the sequence: run the search on
    the cp ranks to see how much longer a sequence fits than on one (docs/context.md). The step's all-to-alls
    are collectives, so on CUDA give ``memory_budget`` (decided by the peak after the step) rather than
    relying on an out-of-memory error, which one rank can hit while its peers wait in the all-to-all.
    ``multiple``: what the length must divide by (2 x cp at least: the head-tail chunks). A trial that ran
    fewer tokens than asked (``tokens[:, :n]`` past the data's end) is refused in one line, never counted as
    fitting; ``max_length`` caps the search at what the data holds.

    >>> def step(n):
    ...     model.zero_grad(set_to_none=True)
    ...     x = tokens[:, :n]
    ...     loss_fn(model(input_ids=x).logits, mg.context_share(model, targets[:, :n])).backward()
    >>> mg.find_sequence_length(step, dist, multiple=2 * layout.cp, memory_budget=8 << 30).length
    """
    positive_int(multiple, "find_sequence_length multiple")
    if start % multiple:
        raise UsageError(f"find_sequence_length start {start} is not a multiple of {multiple}; use "
                         f"start={max(multiple, start // multiple * multiple)}")
    device = torch.device(dist.device) if dist is not None else torch.device("cpu")
    if memory_budget is None:
        memory_budget = _launcher_budget()
    _check_arguments(device, None, start, max_length, memory_budget)
    limit = "cpu-budget" if device.type == "cpu" else ("cuda-budget" if memory_budget else "cuda-oom")
    trials: list[tuple[int, bool, int | None]] = []
    _free(device, collect=True)
    def fix(ran: int) -> str:
        cap = ran // multiple * multiple
        return (f"pass max_length={cap}" + (f" and start={cap}" if cap < start else "") if cap else
                f"give step_fn sequences of at least {multiple} tokens (multiple={multiple})")

    short = _Short("find_sequence_length", "tokens", "every longer sequence", "longer sequences", fix)
    fits = _trial(lambda k: step_fn(k * multiple), device, memory_budget, group, trials, short, scale=multiple)
    units = _largest(fits, start // multiple, None if max_length is None else max_length // multiple,
                     what="sequence length", unit=multiple)
    found = SequenceSearch(units * multiple, tuple((k * multiple, ok, peak) for k, ok, peak in trials), limit)
    if find_batch_requested():  # under multigpu run --find-batch: the launcher's closing line says it
        _write_result(found, dist, memory_budget)
    return found
