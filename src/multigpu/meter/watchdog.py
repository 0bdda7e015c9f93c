"""Hang reports: a per-rank watchdog that writes where it is stuck, and one verdict line.

Each rank's watchdog thread notices when no step has completed for
``timeout`` seconds. It then writes, next to the run's logs,
``watchdog/rank<R>.stacks.txt`` (every thread's Python stack, by
faulthandler) and ``watchdog/rank<R>.json`` (host, last completed step, the
main thread's frame, the collective it is in, if any). ``hang_verdict()``
reads those files and names the rank the others are waiting for:

    rank 1 (host a) has been in slow_step (train.py:31) for 300 s, after step 1580;
    ranks 0,2,3 are waiting in all_reduce after step 1580
"""

from __future__ import annotations

import faulthandler
import glob
import json
import os
import pickle
import sys
import threading
import time
import traceback
from typing import Any, Callable

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
    from ..launch.contract import hang_timeout

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
        print(f"multigpu: rank {self.rank}: no step completed for {stalled:.0f} s; in {_waits_for_peers(status) or status['function']} "
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
        from ..compat import dump_nccl_trace

        data = dump_nccl_trace()
    except Exception:  # noqa: BLE001 - older torch, no NCCL group, recorder off
        return None
    path = os.path.join(out_dir, f"nccl_trace_rank_{rank}")
    with open(path, "wb") as f:
        f.write(data)
    return path


def last_collective(trace_path: str) -> str | None:
    """``"nccl:all_reduce #1581 (started)"`` from a flight recorder dump, or None."""
    try:
        with open(trace_path, "rb") as f:
            entries = pickle.load(f).get("entries") or []
    except Exception:  # noqa: BLE001 - unreadable or foreign format
        return None
    if not entries:
        return None
    e = entries[-1]
    return f"{e.get('profiling_name', '?')} #{e.get('collective_seq_id', '?')} ({e.get('state', '?')})"


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


def _waits_for_peers(s: dict[str, Any]) -> str | None:
    """The collective a rank waits in; DDP waits for gradients inside backward, in C++."""
    if s.get("collective"):
        return s["collective"]
    if s.get("in_backward"):
        return "backward (gradient all-reduce)"
    return None


def _ranks(rs: list[int]) -> str:
    return ",".join(map(str, sorted(rs)))


def hang_verdict(run_dir: str, world_size: int | None = None) -> str | None:
    """One line naming the rank(s) the others wait for; None when no rank reported a stall.

    A rank that is not inside a collective (nor in backward's gradient wait) is
    where the job is stuck; if every rank is in a collective, the one behind in
    steps is. Ranks without a status file are listed as silent.

    >>> hang_verdict("runs/x")
    'rank 1 (host a) has been in DataLoader.__next__ (train.py:40) for 300 s, after step 1579; ranks 0,2,3 are waiting in all_reduce after step 1580'
    """
    status = read_status(run_dir)
    if not status:
        return None
    waiting = {r: s for r, s in status.items() if _waits_for_peers(s)}
    stuck = {r: s for r, s in status.items() if r not in waiting}
    if not stuck:
        # Everyone is in a collective: the one that is behind (fewest steps) is the odd one out.
        least = min((s.get("last_step") if s.get("last_step") is not None else -1) for s in status.values())
        behind = {r: s for r, s in status.items() if (s.get("last_step") if s.get("last_step") is not None else -1) == least}
        if len(behind) < len(status):
            stuck, waiting = behind, {r: s for r, s in status.items() if r not in behind}
    parts = []
    for r, s in sorted(stuck.items()):
        step = s.get("last_step")
        where_ = _waits_for_peers(s) or s.get("function")
        parts.append(f"rank {r} (host {s.get('host')}) has been in {where_} ({os.path.basename(s.get('file', '?'))}:"
                     f"{s.get('line')}) for {s.get('stalled_s', 0):.0f} s, "
                     + (f"after step {step}" if step is not None else "before its first step"))
    by_coll: dict[tuple, list[int]] = {}
    for r, s in waiting.items():
        by_coll.setdefault((_waits_for_peers(s) or s.get("function"), s.get("last_step")), []).append(r)
    for (coll, step), rs in sorted(by_coll.items(), key=lambda kv: min(kv[1])):
        after = f"after step {step}" if step is not None else "before the first step"
        parts.append(f"rank{'s' if len(rs) > 1 else ''} {_ranks(rs)} {'are' if len(rs) > 1 else 'is'} waiting in {coll} {after}")
    if world_size:
        silent = [r for r in range(world_size) if r not in status]
        if silent:
            parts.append(f"rank{'s' if len(silent) > 1 else ''} {_ranks(silent)} wrote no report (exited, or not stalled)")
    traces = [(r, s["nccl_trace"]) for r, s in sorted(status.items()) if s.get("nccl_trace")]
    if traces:
        last = last_collective(traces[0][1])
        parts.append(f"NCCL flight recorder dumps: {os.path.dirname(traces[0][1])}/nccl_trace_rank_*"
                     + (f" (rank {traces[0][0]} last: {last})" if last else ""))
    first = min(stuck) if stuck else min(status)
    parts.append(f"stacks: {status[first]['stacks']}")
    return "; ".join(parts)


class HangMonitor:
    """For the launcher: polls ``run_dir`` and prints ``hang_verdict`` once, when ranks report a stall.

    A verdict is drawn when every rank has reported (or ``settle`` seconds after
    the first report) and the reports stayed unchanged for ``confirm`` seconds;
    a rank whose stall ends withdraws its report, so a slow step is no verdict.

    With ``end_hang`` (``multigpu run --hang-timeout``) the verdict also ends the
    hang: ``end_hang(verdict, reported pids)`` stops the workers, the reports move
    to ``watchdog/hang<k>/`` (the verdict names the stacks there), and the monitor
    goes on watching the next attempt (``--max-restarts``). If no worker could be
    stopped the reports stay where they are and the monitor stops.
    """

    def __init__(self, run_dir: str, world_size: int | None, settle: float = 30.0, confirm: float = 3.0,
                 poll: float = 1.0, stream=None, expect: int | None = None,
                 end_hang: Callable[[str, list[int]], bool] | None = None) -> None:
        self.run_dir, self.world_size, self.settle, self.confirm, self.poll = run_dir, world_size, settle, confirm, poll
        self.expect = expect or world_size or 1  # reports to wait for (this node's ranks)
        self.stream = stream or sys.stderr
        self.end_hang = end_hang
        self.verdict: str | None = None
        self.hangs = 0  # hangs ended (with end_hang)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="multigpu-hang-monitor", daemon=True)

    def start(self) -> "HangMonitor":
        self._thread.start()
        return self

    def _run(self) -> None:
        first = stable = None
        key = None
        while not self._stop.wait(self.poll):
            status = read_status(self.run_dir)
            now = time.monotonic()
            if not status:
                first = stable = key = None
                continue
            new_key = sorted((r, s.get("time")) for r, s in status.items())
            if new_key != key:
                key, stable = new_key, now
            first = first or now
            if (len(status) >= self.expect or now - first >= self.settle) and now - stable >= self.confirm:
                if self.end_hang is None:
                    self.verdict = hang_verdict(self.run_dir, self.world_size)
                    if self.verdict:
                        print(f"multigpu run: hang: {self.verdict}", file=self.stream, flush=True)
                    return
                if not self._end(status):
                    return
                first = stable = key = None

    def _end(self, status: dict[int, dict[str, Any]]) -> bool:
        """Stop the hung workers and set their reports aside, so the next attempt starts with none."""
        kept = os.path.join(self.run_dir, "watchdog", f"hang{self.hangs + 1}")
        verdict = hang_verdict(self.run_dir, self.world_size) or "no rank's report could be read"
        # The reports move once the workers are stopped: the verdict names where their stacks will be.
        self.verdict = verdict.replace(os.path.join(self.run_dir, "watchdog") + os.sep, kept + os.sep)
        print(f"multigpu run: hang: {self.verdict}", file=self.stream, flush=True)
        if not self.end_hang(self.verdict, [s["pid"] for s in status.values() if isinstance(s.get("pid"), int)]):
            return False
        self.hangs += 1
        self._set_aside(kept)
        return True

    def _set_aside(self, kept: str) -> None:
        base = os.path.join(self.run_dir, "watchdog")
        os.makedirs(kept, exist_ok=True)
        for path in glob.glob(os.path.join(base, "rank*")):
            os.replace(path, os.path.join(kept, os.path.basename(path)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.poll + 1)
