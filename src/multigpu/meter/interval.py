"""One log interval of a ``StepMeter``: the steps' timestamps and sums since the last record.

Nothing here synchronises the device during the interval: CPU clocks on the
host, CUDA events on the GPU, loss and metrics summed on the device. At the
log step ``vector()`` reads them into the one list of floats per rank that
the meter gathers (records.py names its columns).
"""

from __future__ import annotations

import math
import resource
import statistics
import time
from typing import Any

import torch

from . import gpumon
from .records import mad


def rank_peak_memory(device: torch.device) -> float:
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return float(peak)
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # kB on Linux: peak RSS


class Interval:
    """Per step: data wait, compute and gradients-ready times; loss and metric sums."""

    def __init__(self) -> None:
        self.n = 0
        self.dws: list[float] = []  # per step: data wait, compute, ready (CPU clocks; GPU events below)
        self.cps: list[float] = []
        self.rds: list[float] = []
        self.events: list[tuple[Any, Any, Any]] = []
        self.loss_sum: Any = 0.0
        self.loss_n = 0
        self.metric_sums: dict[str, Any] = {}
        self.paused = 0.0  # seconds in meter.pause(): evaluation, checkpoints (not step time)
        self.t0 = time.perf_counter()
        self._cuda, self._ready_t, self._hooks_seen, self._t_step = False, None, 0, self.t0  # the step's (begin)

    def begin(self, data_wait: float, cuda: bool) -> None:
        """A step starts: its data wait, then its clock (CUDA events on the GPU)."""
        self.dws.append(data_wait)
        self._cuda, self._ready_t, self._hooks_seen = cuda, None, 0
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self.events.append((start, torch.cuda.Event(enable_timing=True), None))
        self._t_step = time.perf_counter()

    def grad_ready(self, hooks: int) -> None:
        """One of the ``hooks`` hooked parameters has its gradient (``register_post_accumulate_grad_hook``)."""
        if self._cuda:
            # One event record per backward pass (a record costs a few us), when every hooked parameter has
            # its gradient; a step where some get none has no ready time (stragglers judged on compute).
            self._hooks_seen += 1
            if self._hooks_seen % hooks == 0:
                self.events[-1][1].record()
        else:
            self._ready_t = time.perf_counter()

    def end(self) -> None:
        """The step ends: its compute time, and the time its gradients were ready (CPU clock or CUDA events)."""
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            start, ready, _ = self.events[-1]
            self.events[-1] = (start, ready, end)
            return
        self.cps.append(time.perf_counter() - self._t_step)
        if self._ready_t is not None:
            self.rds.append(self._ready_t - self._t_step)

    def add(self, loss: Any, metrics: dict[str, Any]) -> None:
        """One ended step's loss (tensor or float) and extra metrics, summed without a device sync."""
        if loss is not None:
            if not torch.is_tensor(loss):
                self.loss_sum = self.loss_sum + float(loss)
            elif torch.is_tensor(self.loss_sum):
                self.loss_sum.add_(loss.detach())  # on the device: no sync, no new tensor
            else:
                self.loss_sum = loss.detach().float() + self.loss_sum
            self.loss_n += 1
        for key, value in metrics.items():
            v = value.detach().float() if torch.is_tensor(value) else float(value)
            self.metric_sums[key] = self.metric_sums.get(key, 0.0) + v
        self.n += 1

    def vector(self, device: torch.device, monitor: Any) -> tuple[list[float], list[str]]:
        """This rank's numbers for the interval (one wait for the last CUDA event) and the metric names."""
        cps, rds = self.cps, self.rds
        cuda = device.type == "cuda"
        if cuda and self.events:
            self.events[-1][2].synchronize()
            for start, ready_ev, end in self.events:
                cps.append(start.elapsed_time(end) / 1e3)
                try:
                    rds.append(start.elapsed_time(ready_ev) / 1e3)
                except RuntimeError:  # never recorded: no gradient this step
                    pass
        wall = time.perf_counter() - self.t0
        loss = self.loss_sum.item() if torch.is_tensor(self.loss_sum) else self.loss_sum
        keys = sorted(self.metric_sums)
        vals = [v.item() if torch.is_tensor(v) else v for v in (self.metric_sums[k] for k in keys)]
        full = len(rds) == self.n and self.n > 0  # ready known for every step (hooks fired)
        vec = [self.n, wall, sum(self.dws), sum(cps), sum(rds) if full else math.nan, loss, self.loss_n,
               rank_peak_memory(device), statistics.median(self.dws), statistics.median(cps),
               statistics.median(rds) if full else math.nan, mad(self.dws), mad(cps),
               mad(rds) if full else math.nan, self.paused, *vals]
        if not cuda:  # same on every rank, so the gathered vectors keep one length
            return vec, keys
        mon = monitor.take() if monitor is not None and monitor.enabled else None
        return vec + gpumon.as_vector(mon), keys
