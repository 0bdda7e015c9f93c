"""``mg.profile``: torch.profiler over a window of steps on every rank, and where that time went.

Per rank it writes a Chrome trace (``trace_rank<R>.json``, open it in
Perfetto or chrome://tracing) and a summary that splits the profiled steps'
time into parts that add up to the step time:

- compute: operators (CPU) or kernels (GPU) running, no communication;
- overlapped comm: communication while compute runs;
- exposed comm: communication with no compute (the ranks wait on the network);
- data wait: blocked on the loader (the meter's ``multigpu:data_wait`` spans);
- idle: none of the above (Python overhead, launch gaps, the GPU starving).

Communication is gloo's ``gloo:*`` spans on CPU (enqueue to completion, on
gloo's threads), ``c10d::*``/``nccl:*`` operators, and NCCL kernels
(``ncclDevKernel_*``, ``ncclKernel_*``) on GPU.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist

from ..errors import UsageError

PARTS = ("compute", "overlapped_comm", "exposed_comm", "data_wait", "idle")
DATA_MARK = "multigpu:data_wait"
_COMM_PREFIXES = ("gloo:", "nccl:", "c10d::", "record_param_comms")


def parse_steps(spec: str | tuple[int, int]) -> tuple[int, int]:
    """``"10:15"`` or ``(10, 15)`` -> (10, 15): steps 10..14 (end exclusive, like a slice)."""
    try:
        start, stop = (int(x) for x in (spec.split(":") if isinstance(spec, str) else spec))
    except (ValueError, TypeError):
        raise UsageError(f"--profile expects START:STOP steps like 10:15, got {spec!r}") from None
    if not 0 <= start < stop:
        raise UsageError(f"--profile {start}:{stop} needs 0 <= START < STOP; use e.g. 10:15 (steps 10 to 14)")
    return start, stop


def _merge(iv: list[tuple[float, float]]) -> np.ndarray:
    """Sorted, disjoint union of [start, end) intervals as an (n, 2) array."""
    if not iv:
        return np.zeros((0, 2))
    a = np.array(sorted(iv), dtype=float)
    out = [a[0].copy()]
    for s, e in a[1:]:
        if s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append(np.array([s, e]))
    return np.array(out)


def _inside(points: np.ndarray, merged: np.ndarray) -> np.ndarray:
    if len(merged) == 0:
        return np.zeros(len(points), dtype=bool)
    i = np.searchsorted(merged[:, 0], points, side="right") - 1
    ok = i >= 0
    res = np.zeros(len(points), dtype=bool)
    res[ok] = points[ok] < merged[i[ok], 1]
    return res


def _is_comm(name: str) -> bool:
    return name.startswith(_COMM_PREFIXES) or "nccl" in name.lower()


def breakdown(steps: list[tuple[float, float]], compute: list[tuple[float, float]],
              comm: list[tuple[float, float]], data: list[tuple[float, float]]) -> dict[str, float]:
    """Split the step windows into PARTS (same unit as the inputs). Pure; the parts sum to the steps."""
    windows = _merge(steps)
    cm, co, da = _merge(compute), _merge(comm), _merge(data)
    edges = np.unique(np.concatenate([windows.ravel(), cm.ravel(), co.ravel(), da.ravel()]))
    if len(edges) < 2:
        return {p: 0.0 for p in PARTS} | {"step_total": 0.0}
    mid, width = (edges[:-1] + edges[1:]) / 2, np.diff(edges)
    inw = _inside(mid, windows)
    c, m, d = _inside(mid, cm), _inside(mid, co), _inside(mid, da)
    parts = {
        "compute": c & ~m, "overlapped_comm": c & m, "exposed_comm": m & ~c,
        # Activity wins over the data mark: on GPU the kernels of the last step may still run.
        "data_wait": d & ~c & ~m,
    }
    parts["idle"] = ~(c | m | d)
    out = {k: float(width[v & inw].sum()) for k, v in parts.items()}
    out["step_total"] = float(width[inw].sum())
    return out


def summarize(events: Any, key_averages: Any = None, top: int = 8) -> dict[str, Any]:
    """This rank's summary from ``prof.events()``: PARTS in ms over the profiled steps, and top operators."""
    steps, compute, comm, data, gpu_compute, gpu_comm = [], [], [], [], [], []
    main_threads = {e.thread for e in events if e.name.startswith("ProfilerStep")}
    for e in events:
        s, t = e.time_range.start, e.time_range.end
        name = e.name
        if e.device_type != torch.autograd.DeviceType.CPU:
            (gpu_comm if _is_comm(name) else gpu_compute).append((s, t))
        elif name.startswith("ProfilerStep"):
            steps.append((s, t))
        elif name == DATA_MARK:
            data.append((s, t))
        elif _is_comm(name):
            comm.append((s, t))
        elif e.thread in main_threads and e.cpu_parent is not None and e.cpu_parent.name.startswith("ProfilerStep"):
            # Direct children of a step on the main thread; their children are inside them.
            compute.append((s, t))
    on_gpu = bool(gpu_compute or gpu_comm)
    if on_gpu:
        # On GPU the device timeline is what counts: kernels are compute, NCCL kernels communication.
        compute, comm = gpu_compute, gpu_comm
    parts = breakdown(steps, compute, comm, data)
    n = len(steps)
    out = {"device": "cuda" if on_gpu else "cpu", "steps": n,
           **{k: v / 1e3 for k, v in parts.items()}}  # us -> ms
    out["step_ms"] = out["step_total"] / n if n else 0.0
    if key_averages is not None:
        attr = "self_device_time_total" if on_gpu else "self_cpu_time_total"
        rows = [k for k in key_averages if not k.key.startswith("ProfilerStep")]
        rows.sort(key=lambda k: getattr(k, attr, 0.0), reverse=True)
        out["top_ops"] = [{"name": k.key, "calls": k.count, "self_ms": getattr(k, attr, 0.0) / 1e3} for k in rows[:top]]
    return out


def format_table(summaries: list[dict[str, Any]]) -> str:
    """The per-rank table rank 0 prints (times in ms per profiled window, and % of the step time)."""
    head = (f"{'rank':>4} {'steps':>5} {'ms/step':>8} " + " ".join(f"{p.replace('_', ' '):>16}" for p in PARTS)
            + "   (ms over the profiled steps, % of their time)")
    lines = [head]
    for r, s in enumerate(summaries):
        tot = s["step_total"] or 1.0
        cells = " ".join(f"{s[p]:9.1f} ({100 * s[p] / tot:3.0f}%)" for p in PARTS)
        lines.append(f"{r:>4} {s['steps']:>5} {s['step_ms']:8.2f} {cells}")
    for r, s in enumerate(summaries):
        if s.get("top_ops"):
            ops = ", ".join(f"{o['name']} {o['self_ms']:.1f} ms" for o in s["top_ops"][:5])
            lines.append(f"rank {r} top ops (self time): {ops}")
    return "\n".join(lines)


class Profile:
    """torch.profiler over steps [start, stop) on every rank. Call ``step()`` after each step.

    >>> with mg.profile(dist, "10:15", out_dir="runs/x/profile") as prof:
    ...     for step, batch in enumerate(loader):
    ...         train_step(batch); prof.step()
    """

    def __init__(self, dist: Any, steps: str | tuple[int, int], out_dir: str = "profile", top: int = 8) -> None:
        self.start_step, self.stop_step = parse_steps(steps)
        self.rank = getattr(dist, "rank", 0)
        self.world_size = getattr(dist, "world_size", 1)
        self.out_dir, self.top = out_dir, top
        self.summaries: list[dict[str, Any]] | None = None
        self._step = 0
        self._prof = None
        self._gather = True
        cuda = getattr(dist, "device", torch.device("cpu"))
        self._activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.device(cuda).type == "cuda":
            self._activities.append(torch.profiler.ProfilerActivity.CUDA)

    @property
    def active(self) -> bool:
        return self._prof is not None and self.start_step - 1 <= self._step < self.stop_step

    def start(self) -> "Profile":
        warmup = 1 if self.start_step >= 1 else 0
        sched = torch.profiler.schedule(skip_first=self.start_step - warmup, wait=0, warmup=warmup,
                                        active=self.stop_step - self.start_step, repeat=1)
        os.makedirs(self.out_dir, exist_ok=True)
        self._prof = torch.profiler.profile(activities=self._activities, schedule=sched, on_trace_ready=self._ready)
        self._prof.__enter__()
        return self

    def step(self) -> None:
        if self._prof is not None:
            self._step += 1
            self._prof.step()

    def _ready(self, prof) -> None:
        prof.export_chrome_trace(os.path.join(self.out_dir, f"trace_rank{self.rank}.json"))
        mine = summarize(prof.events(), prof.key_averages(), self.top)
        mine["rank"] = self.rank
        if not self._gather:  # stopped by an error: other ranks may be gone, no collective
            with open(os.path.join(self.out_dir, f"summary_rank{self.rank}.json"), "w") as f:
                json.dump(mine, f, indent=1)
            return
        if self.world_size > 1 and tdist.is_initialized():
            everyone: list[Any] = [None] * self.world_size
            tdist.all_gather_object(everyone, mine)  # every rank reaches this at the same step
        else:
            everyone = [mine]
        self.summaries = everyone
        if self.rank == 0:
            with open(os.path.join(self.out_dir, "summary.json"), "w") as f:
                json.dump(everyone, f, indent=1)
            print(f"multigpu: profile of steps {self.start_step}..{self.stop_step - 1} "
                  f"(traces in {self.out_dir}/trace_rank*.json)\n{format_table(everyone)}", flush=True)

    def stop(self, gather: bool = True) -> None:
        """End profiling; ``gather=False`` (after an error) writes this rank's summary without a collective."""
        self._gather = gather
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)

    def __enter__(self) -> "Profile":
        return self.start()

    def __exit__(self, exc_type, *exc) -> None:
        self.stop(gather=exc_type is None)


def profile(dist: Any = None, steps: str | tuple[int, int] = "10:15", out_dir: str = "profile", top: int = 8) -> Profile:
    """Profile steps ``steps`` (``"10:15"``: steps 10 to 14) on every rank; use as a context manager.

    With a ``StepMeter`` pass ``profile="10:15"`` to it instead: it steps the
    profiler and marks the data wait for you.

    >>> with mg.profile(dist, "10:15", out_dir="runs/x/profile") as prof:
    ...     for batch in loader:
    ...         train_step(batch); prof.step()
    """
    return Profile(dist, steps, out_dir, top)
