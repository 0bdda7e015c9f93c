"""Hang reports, the worker's side: a per-rank watchdog that writes where it is stuck.

Each rank's watchdog thread notices when no step has completed for
``timeout`` seconds. It then writes, next to the run's logs,
``watchdog/rank<R>.stacks.txt`` (every thread's Python stack, by
faulthandler) and ``watchdog/rank<R>.json`` (host, last completed step, the
main thread's frame, the collective it is in, if any); ``read_status`` reads
them back. The launcher's side, which turns the reports into one verdict line
and ends the hang, is ``multigpu.launch.hang``.
"""

from __future__ import annotations

import faulthandler
import glob
import json
import os
import sys
import threading
import time
import traceback
from typing import Any

import torch

_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch,)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # multigpu itself
    os.path.dirname(os.__file__) + os.sep,  # the standard library
)
# Functions of torch.distributed that block until the peers arrive.
_COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "reduce", "barrier", "monitored_barrier",
    "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv", "wait", "gather_object", "scatter_object_list",
}


def flight_recorder_env(run_dir: str, buffer_entries: int = 2000) -> dict[str, str]:
    """Variables that make PyTorch's NCCL flight recorder keep the last collectives and
    dump them on a timeout into ``run_dir/watchdog/nccl_trace_rank_<R>``.

    They must be in the workers' environment before the process group exists, so
    the launcher sets them when it starts the workers.
    """
    prefix = os.path.join(os.path.abspath(run_dir), "watchdog", "nccl_trace_rank_")
    return {
        "TORCH_FR_BUFFER_SIZE": str(buffer_entries),
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(buffer_entries),  # the name before torch 2.6
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }


def where(frame) -> dict[str, Any]:
    """The main thread's position: innermost function, the user's file:line, and the collective if any."""
    stack = traceback.extract_stack(frame)  # outermost first
    user = [f for f in stack if not f.filename.startswith(_LIBRARY_DIRS)]
    innermost = stack[-1] if stack else None
    loc = user[-1] if user else innermost
    collective = None
    for f in stack:
        if f.filename.endswith(os.path.join("distributed", "distributed_c10d.py")) and f.name in _COLLECTIVES:
            collective = f.name
            break
    # Name the innermost *interesting* function: a DataLoader, a collective, or the user's own.
    name = innermost.name if innermost else "?"
    for f in reversed(stack):
        if f.filename.endswith(os.path.join("data", "dataloader.py")) and f.name == "__next__":
            name = "DataLoader.__next__"
            break
    if collective:
        name = collective
    elif user and innermost is not None and not innermost.filename.startswith(_LIBRARY_DIRS):
        name = user[-1].name
    return {
        "function": name,
        "file": loc.filename if loc else "?",
        "line": loc.lineno if loc else 0,
        "collective": collective,
        "in_backward": any(f.name == "_engine_run_backward" for f in stack),
    }


def start_watchdog(out_dir: str, rank: int, host: str, timeout: float | None) -> "Watchdog | None":
    """This rank's running watchdog (None: off); under ``multigpu run --hang-timeout S`` it reports
    after S seconds at the latest, even if the script turned it off, so the launcher can end the hang."""
    from ..runtime.contract import hang_timeout

    limit = hang_timeout()
    if limit is not None:
        timeout = min(timeout or limit, limit)
    return Watchdog(out_dir, rank, host, timeout).start() if timeout else None


class Watchdog:
    """Writes this rank's stacks and status when no step completes for ``timeout`` seconds.

    ``beat(step)`` is one attribute store; the check runs on a daemon thread.

    >>> wd = Watchdog("runs/x/watchdog", rank=0, host="a", timeout=300).start()
    >>> wd.beat(step)   # after every step (StepMeter does this)
    """

    def __init__(self, out_dir: str, rank: int, host: str, timeout: float = 300.0, poll: float | None = None,
                 first_step_factor: float = 3.0) -> None:
        self.out_dir, self.rank, self.host, self.timeout = out_dir, rank, host, float(timeout)
        # The first step also pays for compilation, lazy initialisation and NCCL setup.
        self.first_timeout = self.timeout * first_step_factor
        self._status_path = os.path.join(out_dir, f"rank{rank}.json")
        self._reported = False
        self.poll = poll if poll is not None else min(5.0, self.timeout / 4)
        self.last_step: int | None = None
        self._last_beat = time.monotonic()
        self._dumped_for: float | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._main = threading.main_thread().ident
        self._thread: threading.Thread | None = None

    def start(self) -> "Watchdog":
        os.makedirs(self.out_dir, exist_ok=True)
        try:  # a report left by a previous attempt (--max-restarts) is not about this one
            os.remove(self._status_path)
        except OSError:
            pass
        self._thread = threading.Thread(target=self._run, name="multigpu-watchdog", daemon=True)
        self._thread.start()
        return self

    def beat(self, step: int) -> None:
        self.last_step = step
        self._last_beat = time.monotonic()
        if self._reported:  # the stall ended: withdraw the report so no verdict is drawn from it
            with self._lock:
                if self._reported:
                    self._reported = False
                    self._withdraw()
            print(f"multigpu: rank {self.rank}: step {step} completed; the stall is over", file=sys.stderr, flush=True)

    def _withdraw(self) -> None:
        try:
            os.remove(self._status_path)
        except OSError:
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            beat_at = self._last_beat
            stalled = time.monotonic() - beat_at
            limit = self.timeout if self.last_step is not None else self.first_timeout
            # One report per stall: a new report only after a step completed in between.
            if stalled >= limit and self._dumped_for != beat_at:
                self._dumped_for = beat_at
                self.dump(stalled, beat_at)

    def dump(self, stalled: float, beat_at: float | None = None) -> str:
        """Write stacks and status now; returns the status file's path.

        ``beat_at``: the step completion the stall is counted from; if another step
        completes while the report is written, the report is withdrawn at once.
        """
        stacks = os.path.join(self.out_dir, f"rank{self.rank}.stacks.txt")
        with open(stacks, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        frame = sys._current_frames().get(self._main)
        status = {
            "rank": self.rank, "host": self.host, "pid": os.getpid(), "last_step": self.last_step,
            "stalled_s": round(stalled, 1), "time": time.time(), "stacks": stacks,
            **(where(frame) if frame is not None else {"function": "?", "file": "?", "line": 0, "collective": None}),
        }
        nccl = _dump_flight_recorder(self.out_dir, self.rank)
        if nccl:
            status["nccl_trace"] = nccl
        path = self._status_path
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(status, f)
        os.replace(tmp, path)  # readers never see half a file
        with self._lock:
            if beat_at is not None and self._last_beat != beat_at:
                self._withdraw()  # the stall ended while we wrote: no stale report
                return path
            self._reported = True
        print(f"multigpu: rank {self.rank}: no step completed for {stalled:.0f} s; in {waits_for_peers(status) or status['function']} "
              f"({status['file']}:{status['line']}); stacks in {stacks}", file=sys.stderr, flush=True)
        return path

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll + 1)


def _dump_flight_recorder(out_dir: str, rank: int) -> str | None:
    """On CUDA, ask the NCCL flight recorder for its ring buffer (private torch API; best effort)."""
    if not torch.cuda.is_available():
        return None
    try:
        from ..runtime.compat import dump_nccl_trace

        data = dump_nccl_trace()
    except Exception:  # noqa: BLE001 - older torch, no NCCL group, recorder off
        return None
    path = os.path.join(out_dir, f"nccl_trace_rank_{rank}")
    with open(path, "wb") as f:
        f.write(data)
    return path


def read_status(run_dir: str) -> dict[int, dict[str, Any]]:
    """The watchdog status files under ``run_dir`` (or ``run_dir/watchdog``), by rank."""
    base = os.path.join(run_dir, "watchdog") if os.path.isdir(os.path.join(run_dir, "watchdog")) else run_dir
    out = {}
    for path in glob.glob(os.path.join(base, "rank*.json")):
        try:
            with open(path) as f:
                s = json.load(f)
            out[int(s["rank"])] = s
        except (OSError, ValueError, KeyError):
            continue
        if s.get("stacks"):  # next to the status file, wherever the reports were moved since
            s["stacks"] = os.path.join(os.path.dirname(path), os.path.basename(s["stacks"]))
    return out


def waits_for_peers(s: dict[str, Any]) -> str | None:
    """The collective a rank waits in; DDP waits for gradients inside backward, in C++."""
    if s.get("collective"):
        return s["collective"]
    if s.get("in_backward"):
        return "backward (gradient all-reduce)"
    return None
