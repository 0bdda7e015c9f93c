"""Hang reports, the launcher's side: one verdict line from the ranks' watchdog reports, and the
monitor that prints it (and, with ``--hang-timeout``, stops the hung workers).

The workers' watchdogs (``multigpu.meter.watchdog``) write ``watchdog/rank<R>.json``;
``hang_verdict()`` reads them and names the rank the others are waiting for:

    rank 1 (host a) has been in slow_step (train.py:31) for 300 s, after step 1580;
    ranks 0,2,3 are waiting in all_reduce after step 1580
"""

from __future__ import annotations

import contextlib
import glob
import os
import pickle
import sys
import threading
import time
from typing import Any, Callable, Iterator

from ..meter.watchdog import read_status, waits_for_peers


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
    waiting = {r: s for r, s in status.items() if waits_for_peers(s)}
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
        where_ = waits_for_peers(s) or s.get("function")
        parts.append(f"rank {r} (host {s.get('host')}) has been in {where_} ({os.path.basename(s.get('file', '?'))}:"
                     f"{s.get('line')}) for {s.get('stalled_s', 0):.0f} s, "
                     + (f"after step {step}" if step is not None else "before its first step"))
    by_coll: dict[tuple, list[int]] = {}
    for r, s in waiting.items():
        by_coll.setdefault((waits_for_peers(s) or s.get("function"), s.get("last_step")), []).append(r)
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


@contextlib.contextmanager
def hang_monitor(run_dir: str, world_size: int | None, **kw) -> Iterator[HangMonitor]:
    """Watch ``run_dir`` while the workers run; prints the verdict once if ranks report a stall.

    ``world_size=None`` on one node of several (its reports cover its own ranks only);
    ``expect`` is then the number of local ranks to wait for.
    """
    mon = HangMonitor(run_dir, world_size, **kw).start()
    try:
        yield mon
    finally:
        mon.stop()
