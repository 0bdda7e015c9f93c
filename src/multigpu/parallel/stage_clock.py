"""A pipeline stage's clock: its compute calls and whole steps timed, for ``Pipeline.stage_times``.

Host time on CPU; CUDA events on a GPU (kernels run after the host returns), read when asked.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable

import torch


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
